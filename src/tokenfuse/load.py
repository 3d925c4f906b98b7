"""Build members and ensembles from a config."""

from __future__ import annotations

from difflib import get_close_matches
from pathlib import Path

from tokenfuse.bundled import BUNDLED, ensure_converted
from tokenfuse.config import EnsembleConfig, MemberConfig
from tokenfuse.engine.generate import Ensemble
from tokenfuse.errors import ConfigError
from tokenfuse.members.base import Member
from tokenfuse.paths import cache_dir


def load_member(cfg: MemberConfig, *, root: Path | None = None, progress: bool = True, index: int = 0) -> Member:
    """Load one member; a bundled name is converted into the cache on first use."""
    from tokenfuse.members.transformers import load_transformers_member

    root = cache_dir(root)
    source = cfg.resolved_source
    gguf_file = cfg.gguf_file
    if source in BUNDLED:
        source = str(ensure_converted(source, root=root, progress=progress))
    elif not Path(source).expanduser().exists() and "/" not in source:
        hint = get_close_matches(source, BUNDLED, n=1)
        raise ConfigError(
            f"members.{index}.source: {source!r} is neither a bundled model, a local path nor a hub id"
            + (f"; did you mean {hint[0]!r}?" if hint else f" (bundled: {', '.join(BUNDLED)})")
        )
    return load_transformers_member(
        cfg.name, source, gguf_file=gguf_file, weight=cfg.weight, device=cfg.device, dtype=cfg.dtype,
        trust_remote_code=cfg.trust_remote_code, align_cache=root / "alignment",
    )


def load_ensemble(cfg: EnsembleConfig, *, progress: bool = True) -> Ensemble:
    """Load every member of ``cfg`` (with a progress bar) and build the ensemble."""
    from tqdm.auto import tqdm

    root = cache_dir(cfg.cache_dir)
    members = []
    bar = tqdm(cfg.members, desc="loading members", unit="model", disable=not progress)
    for i, m in enumerate(bar):
        bar.set_postfix_str(m.name)
        members.append(load_member(m, root=root, progress=progress, index=i))
    return Ensemble(members, method=cfg.method, method_params=cfg.params, gate=cfg.gate, threshold=cfg.threshold,
                    window=cfg.window, align_cache=root / "alignment")
