"""Token id <-> exact bytes, decided from each tokenizer's own description.

The ensemble's output is a byte string, so every token id of every member must map to the
exact bytes it stands for. The family is read from the tokenizer (its ``decoder`` and
``pre_tokenizer`` in tokenizer.json), never guessed from the spelling of a few tokens:

* byte-level BPE (GPT-2, SmolLM, Qwen, Llama-3): every character of a token string stands for
  one byte through the GPT-2 byte<->unicode table (all 256 entries);
* SentencePiece with byte fallback (Llama-2, Mistral, Gemma): ``<0xNN>`` is the single byte NN,
  ``▁`` is a space, everything else is the UTF-8 of the string;
* added tokens that are not special are text (their content, as written); special tokens
  (BOS, pad, chat markers, ``<unused…>``) are not text and map to ``None``;
* every end-of-sequence / end-of-turn id maps to ``None`` too and is listed in ``end_ids``;
  the union vocabulary gives all of them one shared END symbol.

Encoding goes the other way without the traps of plain ``tokenizer.encode``: special-token
strings inside generated text are split as text, no BOS/EOS is added, no dummy ``▁`` prefix is
added (the tokenizer is rebuilt with its prefix option switched off), and bytes that are not
(yet) valid UTF-8 are fed as single-byte tokens.

A member's tables are cached on disk (``load_or_build_codec``), keyed by the tokenizer's content,
its chat template, END ids and vocabulary size.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from tokenfuse.errors import AlignmentError
from tokenfuse.paths import save_npz

BYTE_LEVEL = "byte_level"
SENTENCEPIECE = "sentencepiece"
PLAIN = "plain"

ALIGNMENT_VERSION = "1"
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """The GPT-2 unicode character -> byte table (inverse of ``bytes_to_unicode``), all 256 entries."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _components(node: dict | None) -> list[dict]:
    """Flatten a tokenizer.json normalizer/pre_tokenizer/decoder node (``Sequence`` nests)."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        key = next(k for k in ("decoders", "pretokenizers", "normalizers") if k in node)
        out: list[dict] = []
        for child in node[key]:
            out.extend(_components(child))
        return out
    return [node]


def detect_kind(spec: dict) -> str:
    """Tell the tokenizer family from a parsed tokenizer.json."""
    parts = _components(spec.get("decoder")) + _components(spec.get("pre_tokenizer"))
    types = {p.get("type") for p in parts}
    if "ByteLevel" in types:
        return BYTE_LEVEL
    if "Metaspace" in types or any(
        p.get("type") == "Replace" and "▁" in json.dumps(p.get("pattern"), ensure_ascii=False) for p in parts
    ):
        return SENTENCEPIECE
    return PLAIN


def _without_prefix_space(spec: dict) -> dict:
    """A copy of a tokenizer.json spec that never adds a dummy leading space / ``▁``."""
    spec = json.loads(json.dumps(spec))

    def fix(node: Any) -> Any:
        if isinstance(node, dict):
            kind = node.get("type")
            if kind == "Metaspace":
                node["prepend_scheme"] = "never"
                node.pop("add_prefix_space", None)
            if kind == "ByteLevel" and "add_prefix_space" in node:
                node["add_prefix_space"] = False
            for key, value in list(node.items()):
                if key == "normalizers" and isinstance(value, list):
                    node[key] = [v for v in value if not (isinstance(v, dict) and v.get("type") == "Prepend")]
                else:
                    fix(value)
            if node.get("type") == "Prepend":
                return None
        elif isinstance(node, list):
            for v in node:
                fix(v)
        return node

    if isinstance(spec.get("normalizer"), dict) and spec["normalizer"].get("type") == "Prepend":
        spec["normalizer"] = None
    fix(spec)
    return spec


def _state(component: Any) -> dict | None:
    """The JSON description of one tokenizers component (normalizer, pre_tokenizer, decoder)."""
    return json.loads(component.__getstate__()) if component is not None else None


def _adds_prefix(node: Any) -> bool:
    text = json.dumps(node or {})
    return '"Prepend"' in text or '"prepend_scheme": "always"' in text or '"prepend_scheme": "first"' in text


class ByteCodec:
    """Exact bytes of every token id of one member, and a safe bytes -> ids encoder.

    Attributes:
        kind: ``byte_level``, ``sentencepiece`` or ``plain``.
        token_bytes: one entry per model output row (``len == vocab_size``, which may exceed the
            tokenizer's size because of padding rows): the token's bytes, or ``None`` when the id is
            not text (special, END, padding, unknown).
        end_ids: ids that end the sequence (EOS, end-of-turn, generation-config EOS).
        special_ids: ids that are not text (includes ``end_ids``).
        byte_ids: for each byte value 0..255 the id of its single-byte token, or ``None``.
        fingerprint: content hash of the tokenizer and the END set (alignment cache key).
        cache_path: the file the tables were read from or written to (``None``: not cached).
    """

    cache_path = None

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        extra_end_ids: Iterable[int] = (),
        extra_special_ids: Iterable[int] = (),
        content_hash: str | None = None,
        tables: dict | None = None,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        if backend is None:
            raise AlignmentError(
                f"{type(tokenizer).__name__} has no fast (Rust) tokenizer; tokenfuse needs a tokenizer.json-based tokenizer"
            )
        self._encoder = self._prefix_free(backend)
        if tables is not None:  # from the on-disk cache: no per-token work
            self.__dict__.update(tables)
        else:
            self._build(tokenizer, backend, vocab_size, extra_end_ids, extra_special_ids, content_hash)
        if self.decode(self.encode_text("a b")) != b"a b":
            raise AlignmentError(
                "tokenizer round trip failed after removing the dummy prefix: "
                f"{self.encode_text('a b')} decodes to {self.decode(self.encode_text('a b'))!r}"
            )

    @staticmethod
    def _prefix_free(backend: Any) -> Any:
        """The backend itself, or (only if it adds a dummy prefix) a copy that does not."""
        pre, norm = _state(backend.pre_tokenizer), _state(backend.normalizer)
        if not (_adds_prefix(pre) or _adds_prefix(norm) or '"add_prefix_space": true' in json.dumps(pre or {})):
            return backend
        from tokenizers import Tokenizer

        probe = backend.encode("a", add_special_tokens=False).tokens
        if probe and not probe[0].startswith(("▁", "Ġ")):
            return backend  # declared but not applied (e.g. ByteLevel use_regex quirk)
        return Tokenizer.from_str(json.dumps(_without_prefix_space(json.loads(backend.to_str()))))

    def _build(self, tokenizer, backend, vocab_size, extra_end_ids, extra_special_ids, content_hash) -> None:
        decoder, pre = _state(backend.decoder), _state(backend.pre_tokenizer)
        self.kind = detect_kind({"decoder": decoder, "pre_tokenizer": pre})
        byte_fallback = bool(getattr(backend.model, "byte_fallback", False))

        n_tok = backend.get_vocab_size(with_added_tokens=True)
        size = max(vocab_size or 0, n_tok)
        pieces: list[str | None] = [None] * size
        for piece, idx in backend.get_vocab(with_added_tokens=True).items():
            if 0 <= idx < size:
                pieces[idx] = piece

        added = {i: a for i, a in backend.get_added_tokens_decoder().items() if 0 <= i < size}
        special = {i for i, a in added.items() if a.special}
        special.update(int(i) for i in extra_special_ids)
        special.update(i for i in (getattr(tokenizer, "all_special_ids", None) or []) if i is not None)
        unk = getattr(backend.model, "unk_token", None)
        if unk is not None and backend.token_to_id(unk) is not None:
            special.add(backend.token_to_id(unk))

        ends = {int(i) for i in extra_end_ids if i is not None}
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None:
            ends.add(int(eos))
        ends.update(_end_of_turn_ids(tokenizer, added))
        self.end_ids = frozenset(i for i in ends if 0 <= i < size)
        self.special_ids = frozenset(special | self.end_ids)

        decode_piece = _piece_decoder(self.kind, byte_fallback)
        token_bytes: list[bytes | None] = [None] * size
        byte_ids: list[int | None] = [None] * 256
        for idx, piece in enumerate(pieces):
            if piece is None or idx in self.special_ids:
                continue
            b = added[idx].content.encode("utf-8") if idx in added else decode_piece(piece)
            token_bytes[idx] = b
            if len(b) == 1:
                # SentencePiece: prefer the explicit <0xNN> byte-fallback id for raw bytes.
                if byte_ids[b[0]] is None or (byte_fallback and _BYTE_FALLBACK.match(piece)):
                    byte_ids[b[0]] = idx
        self.token_bytes = token_bytes
        self.byte_ids = byte_ids
        self.vocab_size = size
        self.fingerprint = codec_key(tokenizer, vocab_size=vocab_size, extra_end_ids=extra_end_ids,
                                     extra_special_ids=extra_special_ids, content_hash=content_hash)

    def tables(self) -> dict:
        """Everything but the encoder, for the on-disk cache (see ``tokenfuse.alignment.union``)."""
        keys = ("kind", "token_bytes", "byte_ids", "vocab_size", "end_ids", "special_ids", "fingerprint")
        return {k: getattr(self, k) for k in keys}

    # ------------------------------------------------------------------ encode / decode
    def decode(self, ids: Sequence[int]) -> bytes:
        """The exact bytes of ``ids`` (special and END ids contribute nothing)."""
        tb = self.token_bytes
        return b"".join(tb[i] or b"" for i in ids)

    def encode_text(self, text: str) -> list[int]:
        """Ids of ``text`` as mid-stream text: no BOS/EOS, no dummy prefix, specials split as text."""
        if not text:
            return []
        enc = self._encoder
        enc.encode_special_tokens = True  # "<|im_end|>" written as text stays text
        try:
            return enc.encode(text, add_special_tokens=False).ids
        finally:
            enc.encode_special_tokens = False

    def encode_bytes(self, data: bytes) -> list[int]:
        """Ids whose bytes are exactly ``data``; invalid or incomplete UTF-8 goes in as byte tokens.

        Raises:
            AlignmentError: the bytes cannot be represented (no byte token for an invalid byte).
        """
        ids: list[int] = []
        rest = data
        while rest:
            try:
                text, bad, rest = rest.decode("utf-8"), b"", b""
            except UnicodeDecodeError as err:
                text = rest[: err.start].decode("utf-8")
                # An incomplete final character: the whole tail goes in as bytes.
                cut = len(rest) if err.reason == "unexpected end of data" else max(err.end, err.start + 1)
                bad, rest = rest[err.start : cut], rest[cut:]
            if text:
                seg = self.encode_text(text)
                if self.decode(seg) != text.encode("utf-8"):  # a normalizer changed the text
                    seg = self.bytes_as_tokens(text.encode("utf-8"))
                ids.extend(seg)
            if bad:
                ids.extend(self.bytes_as_tokens(bad))
        return ids

    def bytes_as_tokens(self, data: bytes) -> list[int]:
        """One single-byte token per byte (raises ``AlignmentError`` for a byte with no token)."""
        out = []
        for b in data:
            idx = self.byte_ids[b]
            if idx is None:
                raise AlignmentError(
                    f"byte 0x{b:02X} has no single-byte token in this {self.kind} vocabulary; "
                    "it cannot stand outside a complete UTF-8 character"
                )
            out.append(idx)
        return out

    def can_encode_bytes(self, data: bytes) -> bool:
        return all(self.byte_ids[b] is not None for b in data)


def codec_key(
    tokenizer: Any,
    *,
    vocab_size: int | None,
    extra_end_ids: Iterable[int] = (),
    extra_special_ids: Iterable[int] = (),
    content_hash: str | None = None,
) -> str:
    """Cache key of a member's byte tables: tokenizer content, chat template, END ids, vocab size."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if content_hash is None:
        content_hash = hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()
    parts = [
        ALIGNMENT_VERSION,
        content_hash,
        str(getattr(tokenizer, "chat_template", None)),
        str(getattr(tokenizer, "eos_token_id", None)),
        str(sorted(int(i) for i in extra_end_ids if i is not None)),
        str(sorted(int(i) for i in extra_special_ids)),
        str(vocab_size),
    ]
    return hashlib.sha256("|".join(parts).encode("utf-8")).hexdigest()[:24]


# ---------------------------------------------------------------------------------------- on-disk cache
# What reading a damaged cache file can raise (truncated or empty .npz: BadZipFile, EOFError).
DAMAGED = (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile)


def pack_bytes(items: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((-1 if b is None else len(b) for b in items), dtype=np.int64, count=len(items))
    data = np.frombuffer(b"".join(b for b in items if b), dtype=np.uint8)
    return data, lengths


def unpack_bytes(data: np.ndarray, lengths: np.ndarray) -> list[bytes | None]:
    raw = data.tobytes()
    ends = np.cumsum(np.maximum(lengths, 0)).tolist()
    out: list[bytes | None] = []
    start = 0
    for n, end in zip(lengths.tolist(), ends):
        out.append(None if n < 0 else raw[start:end])
        start = end
    return out


def save_codec(path: Path, codec: ByteCodec) -> None:
    """Write a member's byte tables (not its encoder) to ``path``."""
    t = codec.tables()
    data, lengths = pack_bytes(t["token_bytes"])
    save_npz(
        path,
        data=data,
        lengths=lengths,
        byte_ids=np.array([-1 if i is None else i for i in t["byte_ids"]], dtype=np.int64),
        end_ids=np.array(sorted(t["end_ids"]), dtype=np.int64),
        special_ids=np.array(sorted(t["special_ids"]), dtype=np.int64),
        meta=np.array([t["kind"], str(t["vocab_size"]), t["fingerprint"]]),
    )


def load_codec_tables(path: Path) -> dict:
    """Read tables written by ``save_codec`` (pass them as ``ByteCodec(..., tables=...)``)."""
    with np.load(path) as z:
        kind, size, fp = z["meta"].tolist()
        return {
            "token_bytes": unpack_bytes(z["data"], z["lengths"]),
            "byte_ids": [None if i < 0 else int(i) for i in z["byte_ids"].tolist()],
            "end_ids": frozenset(z["end_ids"].tolist()),
            "special_ids": frozenset(z["special_ids"].tolist()),
            "kind": kind,
            "vocab_size": int(size),
            "fingerprint": fp,
        }


def load_or_build_codec(tokenizer, *, vocab_size: int | None, extra_end_ids=(), extra_special_ids=(),
                        content_hash: str | None = None, cache: Path | None = None) -> ByteCodec:
    """A member's ``ByteCodec``, from the on-disk cache (``cache/codec-<key>.npz``) when its key matches."""
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
        except DAMAGED:
            pass  # a damaged cache file is rebuilt below
    codec = ByteCodec(tokenizer, vocab_size=vocab_size, extra_end_ids=extra_end_ids,
                      extra_special_ids=extra_special_ids, content_hash=content_hash)
    save_codec(path, codec)
    codec.cache_path = path
    return codec


def _piece_decoder(kind: str, byte_fallback: bool):
    if kind == BYTE_LEVEL:
        table = byte_decoder()

        def decode(piece: str) -> bytes:
            try:
                return bytes(table[c] for c in piece)
            except KeyError:  # a non-byte-level character: the piece is plain text
                return piece.encode("utf-8")

        return decode
    if kind == SENTENCEPIECE:

        def decode(piece: str) -> bytes:
            m = _BYTE_FALLBACK.match(piece) if byte_fallback else None
            if m:
                return bytes([int(m.group(1), 16)])
            return piece.replace("▁", " ").encode("utf-8")

        return decode
    return lambda piece: piece.encode("utf-8")


def _end_of_turn_ids(tokenizer: Any, added: dict) -> set[int]:
    """End-of-turn ids read off the chat template: the special token right after an assistant turn."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return set()
    marker = "tfmarker7"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
            tokenize=False,
        )
    except Exception:  # templates that refuse this shape have no end-of-turn to learn from
        return set()
    if not isinstance(text, str) or marker not in text:
        return set()
    after = text[text.rindex(marker) + len(marker) :].lstrip(" ")
    matches = [(len(a.content), i) for i, a in added.items() if a.special and a.content and after.startswith(a.content)]
    return {max(matches)[1]} if matches else set()
