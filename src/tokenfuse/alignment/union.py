"""The union vocabulary (GaC Eq. 1) over exact bytes, and each member's index map into it.

Entry 0 is the shared END symbol; every other entry is one distinct byte string, sorted by its
bytes, so the order depends neither on the members' order nor on a hash seed. A member's map is
an index array ``member id -> union index`` (``-1`` for ids that are not text), never a dense
``|V| x |U|`` matrix. Both the members' byte tables and the union are cached on disk, keyed by
the tokenizers' content.
"""

from __future__ import annotations

import hashlib
import os
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokenfuse.alignment.bytes import ByteCodec

END = 0
# What reading a damaged cache file can raise (truncated or empty .npz: BadZipFile, EOFError).
_DAMAGED = (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile)


@dataclass(frozen=True)
class UnionVocab:
    """Union of the members' text tokens.

    Attributes:
        pieces: the bytes of every entry, ``pieces[0] == b""`` stands for END.
        maps: per member, ``int64[V_i]``: member id -> union index (``-1``: not text, dropped).
        inverse: per member, ``int64[U]``: union index -> the member's preferred id for those
            bytes (``-1``: not a single token of that member).
        representable: ``bool[U]``: every member can hold the entry's bytes (some byte-level
            vocabularies lack a few control bytes); the combiner never picks the others.
        build_seconds: time spent building (or loading) it.
    """

    pieces: list[bytes]
    maps: list[np.ndarray]
    inverse: list[np.ndarray]
    representable: np.ndarray
    build_seconds: float = field(default=0.0, compare=False)
    from_cache: bool = field(default=False, compare=False)

    def __len__(self) -> int:
        return len(self.pieces)


def _key(codecs: Sequence[ByteCodec]) -> str:
    return hashlib.sha256("|".join(sorted(c.fingerprint for c in codecs)).encode()).hexdigest()[:24]


def build_union(codecs: Sequence[ByteCodec], *, cache: Path | None = None) -> UnionVocab:
    """Build (or load from ``cache``) the union of ``codecs`` and their index maps."""
    start = time.perf_counter()
    path = cache / f"union-{_key(codecs)}.npz" if cache is not None else None
    if path is not None and path.exists():
        try:
            union = _load(path, codecs)
            object.__setattr__(union, "build_seconds", time.perf_counter() - start)
            object.__setattr__(union, "from_cache", True)
            return union
        except _DAMAGED:
            pass  # a damaged cache file is rebuilt below
    distinct: set[bytes] = set()
    for c in codecs:
        distinct.update(b for b in c.token_bytes if b)
    pieces = [b""] + sorted(distinct)
    index = {b: i for i, b in enumerate(pieces)}
    index[b""] = -1  # an empty text token carries no text; drop it
    maps = []
    for c in codecs:
        m = np.fromiter((index[b] if b is not None else -1 for b in c.token_bytes), dtype=np.int64, count=len(c.token_bytes))
        for e in c.end_ids:
            m[e] = END
        maps.append(m)
    union = UnionVocab(pieces, maps, [_inverse(c, m, len(pieces)) for c, m in zip(codecs, maps)],
                       _representable(pieces, codecs))
    if path is not None:
        _save(path, union, codecs)
    object.__setattr__(union, "build_seconds", time.perf_counter() - start)
    return union


def _inverse(codec: ByteCodec, mapping: np.ndarray, size: int) -> np.ndarray:
    """Union index -> the member's id for those bytes: the lowest id that is not a raw byte token."""
    inv = np.full(size, -1, dtype=np.int64)
    ids = np.nonzero(mapping >= 0)[0]
    # Assign from the highest id down so the lowest wins; raw byte tokens (<0xNN>) go first so a
    # normal token with the same bytes overrides them.
    fallback = {i for i in codec.byte_ids if i is not None and codec.kind == "sentencepiece"}
    order = sorted(ids.tolist(), key=lambda i: (i not in fallback, -i))
    inv[mapping[order]] = order
    eos = min(codec.end_ids) if codec.end_ids else -1
    inv[END] = eos
    return inv


def _representable(pieces: list[bytes], codecs: Sequence[ByteCodec]) -> np.ndarray:
    allowed = set(range(256))
    for c in codecs:
        allowed &= {b for b in range(256) if c.byte_ids[b] is not None}
    if len(allowed) == 256:
        return np.ones(len(pieces), dtype=bool)
    missing = bytes(sorted(set(range(256)) - allowed))
    table = bytes.maketrans(b"", b"")
    return np.fromiter((len(p.translate(table, missing)) == len(p) for p in pieces), dtype=bool, count=len(pieces))


def _blob(items: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((-1 if b is None else len(b) for b in items), dtype=np.int64, count=len(items))
    data = np.frombuffer(b"".join(b for b in items if b), dtype=np.uint8)
    return data, lengths


def _unblob(data: np.ndarray, lengths: np.ndarray) -> list[bytes | None]:
    raw = data.tobytes()
    ends = np.cumsum(np.maximum(lengths, 0)).tolist()
    out: list[bytes | None] = []
    start = 0
    for n, end in zip(lengths.tolist(), ends):
        out.append(None if n < 0 else raw[start:end])
        start = end
    return out


def _save(path: Path, union: UnionVocab, codecs: Sequence[ByteCodec]) -> None:
    arrays: dict[str, np.ndarray] = {}
    arrays["pieces_data"], arrays["pieces_len"] = _blob(union.pieces)
    arrays["representable"] = union.representable
    for c, m, inv in zip(codecs, union.maps, union.inverse):
        arrays[f"{c.fingerprint}.map"] = m
        arrays[f"{c.fingerprint}.inverse"] = inv
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def _load(path: Path, codecs: Sequence[ByteCodec]) -> UnionVocab:
    with np.load(path) as z:
        pieces = _unblob(z["pieces_data"], z["pieces_len"])
        return UnionVocab(
            pieces=[p or b"" for p in pieces],
            maps=[z[f"{c.fingerprint}.map"] for c in codecs],
            inverse=[z[f"{c.fingerprint}.inverse"] for c in codecs],
            representable=z["representable"],
        )


def save_codec(path: Path, codec: ByteCodec) -> None:
    """Write a member's byte tables (not its encoder) to ``path``."""
    t = codec.tables()
    data, lengths = _blob(t["token_bytes"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
    np.savez(
        tmp,
        data=data,
        lengths=lengths,
        byte_ids=np.array([-1 if i is None else i for i in t["byte_ids"]], dtype=np.int64),
        end_ids=np.array(sorted(t["end_ids"]), dtype=np.int64),
        special_ids=np.array(sorted(t["special_ids"]), dtype=np.int64),
        meta=np.array([t["kind"], str(t["vocab_size"]), t["fingerprint"]]),
    )
    os.replace(tmp, path)


def load_codec_tables(path: Path) -> dict:
    """Read tables written by ``save_codec`` (pass them as ``ByteCodec(..., tables=...)``)."""
    with np.load(path) as z:
        kind, size, fp = z["meta"].tolist()
        return {
            "token_bytes": _unblob(z["data"], z["lengths"]),
            "byte_ids": [None if i < 0 else int(i) for i in z["byte_ids"].tolist()],
            "end_ids": frozenset(z["end_ids"].tolist()),
            "special_ids": frozenset(z["special_ids"].tolist()),
            "kind": kind,
            "vocab_size": int(size),
            "fingerprint": fp,
        }


def load_or_build_codec(tokenizer, *, vocab_size: int | None, extra_end_ids=(), extra_special_ids=(),
                        content_hash: str | None = None, cache: Path | None = None) -> ByteCodec:
    """A member's ``ByteCodec``, from the on-disk cache when its key matches."""
    from tokenfuse.alignment.bytes import codec_key

    if cache is None:
        return ByteCodec(tokenizer, vocab_size=vocab_size, extra_end_ids=extra_end_ids,
                         extra_special_ids=extra_special_ids, content_hash=content_hash)
    key = codec_key(tokenizer, vocab_size=vocab_size, extra_end_ids=extra_end_ids,
                    extra_special_ids=extra_special_ids, content_hash=content_hash)
    path = cache / f"codec-{key}.npz"
    if path.exists():
        try:
            codec = ByteCodec(tokenizer, tables=load_codec_tables(path))
            codec.cache_path = path
            return codec
        except _DAMAGED:
            pass
    codec = ByteCodec(tokenizer, vocab_size=vocab_size, extra_end_ids=extra_end_ids,
                         extra_special_ids=extra_special_ids, content_hash=content_hash)
    save_codec(path, codec)
    codec.cache_path = path
    return codec
