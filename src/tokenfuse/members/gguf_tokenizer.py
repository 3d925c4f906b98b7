"""A GGUF model's tokenizer built straight from the file's own metadata, in about a second.

A GGUF holds its tokenizer as metadata under llama.cpp's key names: the vocabulary
(``tokenizer.ggml.tokens``), each token's type (normal, control, user-defined, byte, ...), the BPE
merges or the SentencePiece scores, the pre-tokenizer name, the special-token ids and flags, and
``tokenizer.chat_template``. This module reads those keys through ``tokenfuse.members.gguf_file``
(tensor data and other metadata values are skipped, never decoded) and builds with the
``tokenizers`` library the same files that ``AutoTokenizer.from_pretrained(gguf_file=...)`` +
``save_pretrained`` write (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``),
without importing transformers. ``tests/test_gguf_tokenizer.py`` checks them against that conversion, which stays
available as ``tokenfuse.bundled.convert_tokenizer_with_transformers``.

Families, by ``tokenizer.ggml.model``:

* ``gpt2``: byte-level BPE (SmolLM2, Qwen2). Tokens are respelled into the GPT-2 byte alphabet where
  the file writes them as plain text; merges come from the file; the pre-tokenizer is ``ByteLevel``
  with GPT-2's split regex, or the named regex (``tokenizer.ggml.pre`` = ``qwen2``) followed by
  ``ByteLevel`` without its own regex.
* ``llama`` on a Gemma architecture: SentencePiece-style BPE with byte fallback (Gemma-3). Tokens made
  of spaces are respelled with ``▁``; the file has no merges, so they are rebuilt from the vocabulary
  in file order (Gemma's scores do not follow its merge order); ``" "`` is normalised to ``▁``.

Control tokens become special added tokens, user-defined ones plain added tokens (both matched
whole, never normalised); the post-processor adds BOS when ``tokenizer.ggml.add_bos_token`` is set.
Any other model, architecture or pre-tokenizer raises ``UnsupportedGGUFTokenizer`` rather than
guessing.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tokenfuse.bundled import BUNDLED, mark_tokenizer
from tokenfuse.errors import ModelLoadError
from tokenfuse.members.codec import byte_decoder
from tokenfuse.members.gguf_file import read_gguf_metadata
from tokenfuse.progress import progress_bar

CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType values
VERY_LARGE_INTEGER = int(1e30)  # transformers' model_max_length for "no limit"
log = logging.getLogger(__name__)

# tokenizer.ggml.pre -> the split regex its byte-level merges were learned with (None: GPT-2's own).
GPT2_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt-2": None,
    "smollm": None,
    "qwen2": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
             r"""|\s*[\r\n]+|\s+(?!\S)|\s+""",
}
# (architecture, tokenizer.ggml.model) -> the transformers tokenizer class the conversion names.
TOKENIZER_CLASSES = {
    ("llama", "gpt2"): "TokenizersBackend",
    ("qwen2", "gpt2"): "Qwen2Tokenizer",
    ("gemma", "llama"): "GemmaTokenizer",
    ("gemma2", "llama"): "GemmaTokenizer",
    ("gemma3", "llama"): "GemmaTokenizer",
}
# Files transformers 4.x also saved beside tokenizer.json; a rebuild removes them.
STALE = ("special_tokens_map.json", "added_tokens.json")
_NAMED = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
          "pad_token": "padding_token_id"}


class UnsupportedGGUFTokenizer(ModelLoadError):
    """The GGUF describes a tokenizer this builder does not reproduce (use the transformers path)."""


# ---------------------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class GGUFVocabulary:
    """The tokenizer a GGUF file describes, as its metadata spells it."""

    architecture: str
    model: str  # tokenizer.ggml.model: gpt2 (byte-level BPE), llama (SentencePiece), ...
    pre: str | None  # tokenizer.ggml.pre
    tokens: list[str]
    token_types: list[int]
    merges: list[str] | None
    special_ids: dict[str, int | None]  # bos_token / eos_token / unk_token / pad_token -> id
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    @property
    def tokenizer_class(self) -> str:
        key = (self.architecture, self.model)
        if key not in TOKENIZER_CLASSES:
            raise UnsupportedGGUFTokenizer(
                f"tokenizer.ggml.model {self.model!r} on architecture {self.architecture!r} is not built from "
                f"GGUF metadata (supported: {sorted(TOKENIZER_CLASSES)}); convert it with transformers instead")
        return TOKENIZER_CLASSES[key]

    def token(self, name: str) -> str | None:
        idx = self.special_ids.get(name)
        return self.tokens[idx] if idx is not None and 0 <= idx < len(self.tokens) else None


def read_vocabulary(path: str | os.PathLike) -> GGUFVocabulary:
    """Read a GGUF file's tokenizer metadata."""
    md = read_gguf_metadata(path)
    if "tokenizer.ggml.tokens" not in md or "tokenizer.ggml.model" not in md:
        raise UnsupportedGGUFTokenizer(f"{path}: no tokenizer.ggml.tokens / tokenizer.ggml.model in the GGUF metadata")
    model = md["tokenizer.ggml.model"]
    types = md.get("tokenizer.ggml.token_type")
    return GGUFVocabulary(
        architecture=md.get("general.architecture", ""),
        model=model,
        pre=md.get("tokenizer.ggml.pre"),
        tokens=md["tokenizer.ggml.tokens"],
        token_types=[] if types is None else types.tolist(),
        merges=md.get("tokenizer.ggml.merges"),
        special_ids={name: md.get(f"tokenizer.ggml.{key}") for name, key in _NAMED.items()},
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        add_bos=bool(md.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos=bool(md.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=md.get("tokenizer.chat_template"),
    )


# ---------------------------------------------------------------------------------------- building
@lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[dict[int, str], frozenset[str]]:
    """GPT-2's byte -> printable character table, and its 256 characters."""
    table = {b: ch for ch, b in byte_decoder().items()}
    return table, frozenset(table.values())


def _byte_level_model(vocab: GGUFVocabulary):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if vocab.pre not in GPT2_SPLITS:
        raise UnsupportedGGUFTokenizer(
            f"tokenizer.ggml.pre {vocab.pre!r} is not built from GGUF metadata (supported: {sorted(GPT2_SPLITS)}); "
            "convert it with transformers instead")
    if vocab.merges is None:
        raise UnsupportedGGUFTokenizer("a byte-level GGUF tokenizer without tokenizer.ggml.merges is not supported")
    table, alphabet = _byte_alphabet()
    spelled = {
        (t if set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(vocab.tokens)
    }
    merges = [tuple(m.split(" ")) for m in vocab.merges]
    tok = Tokenizer(models.BPE(vocab=spelled, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False))
    split = GPT2_SPLITS[vocab.pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    return tok, spelled, alphabet


def merges_in_file_order(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary whose order is its merge order (Gemma).

    Every split of a token into two vocabulary entries is a merge; merges are ranked by the token's
    position (a repeated spelling counts at its last position), then by a longer left part first.
    This is transformers' ``generate_merges`` with position scores, without its sort.
    """
    index = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    add = merges.append
    for i, tok in enumerate(tokens):
        if len(tok) < 2 or index[tok] != i:
            continue
        for cut in range(len(tok) - 1, 0, -1):
            left = tok[:cut]
            if left in index:
                right = tok[cut:]
                if right in index:
                    add((left, right))
    return merges


def _gemma_model(vocab: GGUFVocabulary):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    if vocab.merges is not None:
        raise UnsupportedGGUFTokenizer("a Gemma GGUF tokenizer with tokenizer.ggml.merges is not supported")
    # A token of two or more spaces is stored as real spaces; the model looks it up as "▁▁".
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in vocab.tokens]
    index = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=index, merges=merges_in_file_order(tokens), fuse_unk=True, unk_token="<unk>",
                               dropout=None, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.normalizer = normalizers.Replace(" ", "▁")
    return tok, index, None


def build_tokenizer(vocab: GGUFVocabulary):
    """The ``tokenizers.Tokenizer`` a GGUF vocabulary describes (see the module docstring)."""
    from tokenizers import AddedToken, processors

    cls = vocab.tokenizer_class
    tok, spelled, alphabet = _byte_level_model(vocab) if vocab.model == "gpt2" else _gemma_model(vocab)
    types = vocab.token_types
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(vocab.tokens, types)
               if k == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        tok.add_special_tokens(control)
    known = spelled.keys() | {a.content for a in control}  # == tok.get_vocab(with_added_tokens=True), 5x faster
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(vocab.tokens, types)
            if k == USER_DEFINED and t in known]
    if user:
        tok.add_tokens(user)
    named = [t for t in _named_tokens(vocab, cls).values() if t is not None]
    present = {a.content for a in tok.get_added_tokens_decoder().values()}
    missing = [AddedToken(t, special=True) for t in dict.fromkeys(named) if t not in present]
    if missing:
        tok.add_tokens(missing)
    tok.post_processor = _post_processor(vocab, tok, processors)
    return tok


def _named_tokens(vocab: GGUFVocabulary, cls: str) -> dict[str, str | None]:
    named = {name: vocab.token(name) for name in _NAMED}
    if cls == "GemmaTokenizer":
        named["mask_token"] = "<mask>"
    return named


def _post_processor(vocab: GGUFVocabulary, tok, processors):
    """transformers' ``update_post_processor``: BOS / EOS around each sequence as the file asks."""
    bos, eos = vocab.token("bos_token"), vocab.token("eos_token")
    add_bos, add_eos = vocab.add_bos and bos is not None, vocab.add_eos and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    special = ([(bos, tok.token_to_id(bos))] if add_bos else []) + ([(eos, tok.token_to_id(eos))] if add_eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def tokenizer_config(vocab: GGUFVocabulary) -> dict:
    """The ``tokenizer_config.json`` the transformers conversion saves for this vocabulary."""
    cls = vocab.tokenizer_class
    cfg = {"backend": "tokenizers", "is_local": True, "local_files_only": False,
           "model_max_length": VERY_LARGE_INTEGER, "tokenizer_class": cls, **_named_tokens(vocab, cls)}
    if cls == "Qwen2Tokenizer":
        cfg["add_prefix_space"] = None
    return cfg


# ---------------------------------------------------------------------------------------- files
def write_tokenizer(gguf: str | os.PathLike, out: str | os.PathLike) -> float:
    """Build ``gguf``'s tokenizer and write tokenizer.json, tokenizer_config.json and (when the file
    has one) chat_template.jinja into ``out``; return the seconds it took.

    Each file is written under a temporary name and renamed, so a reader never sees half a file;
    tokenizer files an older build may have left (``STALE``) are removed.
    """
    t0 = time.perf_counter()
    vocab = read_vocabulary(gguf)
    tok = build_tokenizer(vocab)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _replace(out / "tokenizer.json", lambda p: tok.save(str(p)))
    cfg = json.dumps(tokenizer_config(vocab), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    _replace(out / "tokenizer_config.json", lambda p: p.write_text(cfg, encoding="utf-8"))
    if vocab.chat_template is not None:
        _replace(out / "chat_template.jinja", lambda p: p.write_text(vocab.chat_template, encoding="utf-8"))
    for name in STALE + (() if vocab.chat_template is not None else ("chat_template.jinja",)):
        (out / name).unlink(missing_ok=True)
    return time.perf_counter() - t0


def _replace(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def ensure_tokenizer(name: str, *, root: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The directory holding bundled model ``name``'s tokenizer files, built from its GGUF on first use.

    A drop-in for ``ensure_converted(name, root=root, model=False, progress=progress)``: same
    directory, same files, same cache mark (with ``TOKENIZER_VERSION``, so older caches are rebuilt),
    about a second instead of half a minute. ``progress``: the build is one step of
    ``tokenfuse.progress.progress_bar`` (a bar on a terminal, else one line when done).
    """
    out, gguf = BUNDLED[name].to_build(root, model=False)
    if gguf is None:
        return out
    with progress_bar(total=1, desc=f"building the {name} tokenizer", unit="step", enabled=progress) as bar:
        seconds = write_tokenizer(gguf, out)
        bar.update(1)
    mark_tokenizer(out, gguf, seconds, builder="gguf")
    log.info("built the %s tokenizer from its GGUF in %.2f s", name, seconds)
    return out
