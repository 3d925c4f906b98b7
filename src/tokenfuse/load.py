"""Build an ensemble from a config: its members placed (``tokenfuse.placement``), then combined.

``load_member`` (one in-process member) lives in ``tokenfuse.placement.local`` and is re-exported here.

``with load_ensemble(cfg) as ens:`` unloads the members at the end of the block; an ensemble left
open is unloaded at exit (``tokenfuse.engine.ensemble``).
"""

from __future__ import annotations

from tokenfuse.config import EnsembleConfig
from tokenfuse.engine import Ensemble
from tokenfuse.logs import route_transformers_logs
from tokenfuse.paths import cache_dir
from tokenfuse.progress import progress_bar
from tokenfuse.placement.local import check_source, load_member, needs_transformers, share_member, shared_with

__all__ = ["check_source", "ensemble_from_members", "load_ensemble", "load_member"]

def load_ensemble(cfg: EnsembleConfig, *, progress: bool = True) -> Ensemble:
    """Load every member of ``cfg`` (in threads, with a progress bar) and build the ensemble.

    Loading overlaps well (llama.cpp and safetensors reads release the GIL), which matters for the
    time from process start to the first token. A member that repeats an earlier one's model and
    load settings (a self-ensemble, ``--models x,x``) shares its loaded model
    (``tokenfuse.placement.local.share_member``).
    """
    from concurrent.futures import ThreadPoolExecutor

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

        route_transformers_logs()
    with ThreadPoolExecutor(max_workers=len(cfg.members)) as pool, \
            progress_bar(total=len(cfg.members), desc="loading members", unit="model", enabled=progress) as bar:
        firsts = shared_with(cfg.members)
        futures = {i: pool.submit(load_member, m, root=root, progress=progress, index=i)
                   for i, m in enumerate(cfg.members) if firsts[i] == i}
        for f in futures.values():
            f.add_done_callback(lambda _: bar.update(1))
        loaded = {i: f.result() for i, f in futures.items()}
        members = []
        for i, m in enumerate(cfg.members):
            if i not in loaded:
                loaded[i] = share_member(loaded[firsts[i]], m, root=root, index=i)
                bar.update(1)
            members.append(loaded[i])
    return ensemble_from_members(cfg, members, progress=progress)


def ensemble_from_members(cfg: EnsembleConfig, members, *, union=None, progress: bool = False) -> Ensemble:
    """The ``Ensemble`` a config describes, on already loaded members (in the config's order), with
    what its combiner needs built or loaded (e.g. DeePEn's relative matrices).

    The ensemble's weights and scores are the member configs' (``weight``, ``score``); nothing is
    written to the members, so the same loaded members may serve several ensembles.
    """
    ens = Ensemble(members, cfg.options, weights=[mc.weight for mc in cfg.members],
                   scores=[mc.score for mc in cfg.members], union=union,
                   align_cache=cache_dir(cfg.cache_dir) / "alignment")
    ens.combiner.prepare(progress=progress)
    return ens
