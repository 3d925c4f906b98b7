"""Build an ensemble from a config: its members placed (``tokenfuse.placement``), then combined.

``load_member`` (one in-process member) lives in ``tokenfuse.placement.local`` and is re-exported here.
"""

from __future__ import annotations

from tokenfuse.config import EnsembleConfig
from tokenfuse.engine import Ensemble
from tokenfuse.paths import cache_dir
from tokenfuse.placement.local import check_source, load_member, needs_transformers

__all__ = ["check_source", "ensemble_from_members", "load_ensemble", "load_member"]


def load_ensemble(cfg: EnsembleConfig, *, progress: bool = True) -> Ensemble:
    """Load every member of ``cfg`` (in threads, with a progress bar) and build the ensemble.

    Loading overlaps well (llama.cpp and safetensors reads release the GIL), which matters for the
    time from process start to the first token.
    """
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    root = cache_dir(cfg.cache_dir)
    for i, m in enumerate(cfg.members):
        check_source(m, i)
    if cfg.placement == "ray":
        from tokenfuse.placement.ray import load_ray_members

        return ensemble_from_members(cfg, load_ray_members(cfg, root=root, progress=progress))
    if any(needs_transformers(m, root) for m in cfg.members):
        # transformers resolves its classes lazily on first import; doing that in several loader
        # threads at once can fail, so do it here, once, first.
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    with ThreadPoolExecutor(max_workers=len(cfg.members)) as pool, \
            tqdm(total=len(cfg.members), desc="loading members", unit="model", disable=not progress) as bar:
        futures = [pool.submit(load_member, m, root=root, progress=progress, index=i)
                   for i, m in enumerate(cfg.members)]
        for f in futures:
            f.add_done_callback(lambda _: bar.update(1))
        members = [f.result() for f in futures]
    return ensemble_from_members(cfg, members, progress=progress)


def ensemble_from_members(cfg: EnsembleConfig, members, *, union=None, progress: bool = False) -> Ensemble:
    """The ``Ensemble`` a config describes, on already loaded members (in the config's order), with
    what its combiner needs built or loaded (e.g. DeePEn's relative matrices).

    Each member's ``score`` becomes its config's (members built in memory, and the server's
    re-weighted views of loaded members, get it here).
    """
    for m, mc in zip(members, cfg.members):
        m.score = mc.score
    ens = Ensemble(members, method=cfg.method, method_params=cfg.params, primary=cfg.primary_name,
                   agreement_skip=cfg.agreement_skip, gate=cfg.gate, threshold=cfg.threshold,
                   window=cfg.window, parallel=cfg.parallel, union=union,
                   align_cache=cache_dir(cfg.cache_dir) / "alignment")
    ens.combiner.prepare(progress=progress)
    return ens
