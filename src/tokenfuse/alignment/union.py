"""The union vocabulary (GaC Eq. 1) over exact bytes, and each member's index map into it.

Entry 0 is the shared END symbol; every other entry is one distinct byte string, sorted by its
bytes, so the order depends neither on the members' order nor on a hash seed. A member's map is
an index array ``member id -> union index`` (``-1`` for ids that are not text), never a dense
``|V| x |U|`` matrix. Both the members' byte tables and the union are cached on disk, keyed by
the tokenizers' content.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokenfuse.members.codec import DAMAGED, ByteCodec, pack_bytes, unpack_bytes
from tokenfuse.paths import save_npz

END = 0


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
        except DAMAGED:
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


def _save(path: Path, union: UnionVocab, codecs: Sequence[ByteCodec]) -> None:
    arrays: dict[str, np.ndarray] = {}
    arrays["pieces_data"], arrays["pieces_len"] = pack_bytes(union.pieces)
    arrays["representable"] = union.representable
    for c, m, inv in zip(codecs, union.maps, union.inverse):
        arrays[f"{c.fingerprint}.map"] = m
        arrays[f"{c.fingerprint}.inverse"] = inv
    save_npz(path, **arrays)


def _load(path: Path, codecs: Sequence[ByteCodec]) -> UnionVocab:
    with np.load(path) as z:
        pieces = unpack_bytes(z["pieces_data"], z["pieces_len"])
        return UnionVocab(
            pieces=[p or b"" for p in pieces],
            maps=[z[f"{c.fingerprint}.map"] for c in codecs],
            inverse=[z[f"{c.fingerprint}.inverse"] for c in codecs],
            representable=z["representable"],
        )
