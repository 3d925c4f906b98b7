"""In-process members (``placement: local``): which backend a member config gets, and loading it.

A Ray actor loads its member with the same ``load_member`` (``tokenfuse.placement.ray``).
Members whose configs differ only in name, weight and score (a self-ensemble, ``--models x,x``)
load the model once: ``shared_with`` says which, ``share_member`` makes the copies.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from difflib import get_close_matches
from pathlib import Path

from tokenfuse.bundled import BUNDLED, ensure_converted
from tokenfuse.config import MemberConfig
from tokenfuse.errors import ConfigError
from tokenfuse.logs import route_transformers_logs
from tokenfuse.members.base import Member
from tokenfuse.members.gguf_tokenizer import ensure_tokenizer
from tokenfuse.paths import cache_dir


def resolve_backend(cfg: MemberConfig) -> str:
    """``auto``: llama.cpp for GGUF sources (bundled models, ``.gguf`` files) on CPU when
    llama-cpp-python is installed; transformers otherwise."""
    if cfg.backend != "auto":
        return cfg.backend
    import torch

    source = cfg.resolved_source
    gguf = source in BUNDLED or source.endswith(".gguf") or bool(cfg.gguf_file)
    on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    if gguf and on_cpu and importlib.util.find_spec("llama_cpp") is not None:
        return "llamacpp"
    return "transformers"


def check_source(cfg: MemberConfig, index: int = 0) -> None:
    """Fail fast, before any model is loaded, on a source that cannot be a model."""
    if cfg.backend == "openai":  # served elsewhere; its tokenizer is checked when it loads
        return
    source = cfg.resolved_source
    if source not in BUNDLED and not Path(source).expanduser().exists() and "/" not in source:
        hint = get_close_matches(source, BUNDLED, n=1)
        raise ConfigError(
            f"members.{index}.source: {source!r} is neither a bundled model, a local path nor a hub id"
            + (f"; did you mean {hint[0]!r}?" if hint else f" (bundled: {', '.join(BUNDLED)})")
        )


def load_member(cfg: MemberConfig, *, root: Path | None = None, progress: bool = True, index: int = 0) -> Member:
    """Load one member (a bundled name is converted into the cache on first use); its default
    ``weight`` is the config's (the config's ``score`` is the ensemble's: ``load.ensemble_from_members``)."""
    return _load(cfg, root=cache_dir(root), progress=progress, index=index)


# what a member's own copy may differ in from the member whose loaded model it shares
_OWN = {"name", "weight", "score"}


def shared_with(cfgs: Sequence[MemberConfig]) -> list[int]:
    """For each member, the index of the first member with the same model and load settings (its
    config equal but for name, weight and score): the one whose loaded model it shares, itself
    when none comes before it. Remote members (``backend: openai``) are never shared."""
    keys = [None if c.backend == "openai" else c.model_dump(exclude=_OWN) | {"source": c.resolved_source}
            for c in cfgs]
    return [next((j for j in range(i) if key is not None and keys[j] == key), i) for i, key in enumerate(keys)]


def share_member(first: Member, cfg: MemberConfig, *, root: Path | None = None, index: int = 0) -> Member:
    """A member named ``cfg.name`` (its default weight ``cfg.weight``) running ``first``'s loaded model: the
    weights (a transformers model object, a llama.cpp model) and tokenizer are shared, each
    sequence keeps its own cache. Other backends load it again."""
    from tokenfuse.members.llamacpp import LlamaCppMember
    from tokenfuse.members.transformers import TransformersMember

    root = cache_dir(root)
    if isinstance(first, TransformersMember):
        return TransformersMember(cfg.name, first.model, first.tokenizer, weight=cfg.weight,
                                  align_cache=root / "alignment", batched=first.batched)
    if isinstance(first, LlamaCppMember):
        return LlamaCppMember.sharing(first, cfg.name, weight=cfg.weight)
    return _load(cfg, root=root, progress=False, index=index)


def _load(cfg: MemberConfig, *, root: Path, progress: bool, index: int) -> Member:
    source = cfg.resolved_source
    backend = resolve_backend(cfg)
    check_source(cfg, index)
    if needs_transformers(cfg, root):
        route_transformers_logs()
    if backend == "openai":
        from tokenfuse.members.remote import load_remote_member

        return load_remote_member(cfg, root=root, progress=progress)
    if backend == "llamacpp":
        from tokenfuse.members.llamacpp import load_llamacpp_member

        if source in BUNDLED:
            gguf, tok_dir = BUNDLED[source].gguf_path(root), ensure_tokenizer(source, root=root, progress=progress)
        else:
            gguf = Path(source).expanduser() / cfg.gguf_file if cfg.gguf_file else Path(source).expanduser()
            if gguf.suffix != ".gguf":
                raise ConfigError(f"members.{index}.backend: llamacpp needs a .gguf file, got {source!r}; "
                                  "set `backend: transformers` for a model directory or hub id")
            tok_dir = None
        return load_llamacpp_member(cfg.name, gguf, tokenizer_dir=tok_dir, weight=cfg.weight, n_ctx=cfg.n_ctx,
                                    n_threads=cfg.n_threads, multi_seq=cfg.multi_seq, prefix_cache=cfg.prefix_cache,
                                    exact_calls=cfg.exact_calls, align_cache=root / "alignment",
                                    tokenizer_cache=root / "tokenizers")

    from tokenfuse.members.transformers import load_transformers_member

    tokenizer = None
    if source in BUNDLED:
        from tokenfuse.members.fasttok import FastTokenizer

        ensure_tokenizer(source, root=root, progress=progress)  # from the GGUF: seconds, not transformers
        source = str(ensure_converted(source, root=root, progress=progress))
        tokenizer = FastTokenizer(source)  # checked against AutoTokenizer in tests/test_real.py
    return load_transformers_member(
        cfg.name, source, gguf_file=cfg.gguf_file, weight=cfg.weight, device=cfg.device, dtype=cfg.dtype,
        trust_remote_code=cfg.trust_remote_code, align_cache=root / "alignment", tokenizer=tokenizer,
        batched=cfg.batched,
    )


def needs_transformers(cfg: MemberConfig, root: Path) -> bool:
    """Loading this member imports transformers (its backend, or a tokenizer not converted yet)."""
    source = cfg.resolved_source
    if resolve_backend(cfg) == "transformers":
        return True
    return source not in BUNDLED  # a bundled tokenizer is built from its GGUF without transformers
