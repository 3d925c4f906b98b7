"""Ray placement (``placement: ray``, extra ``tokenfuse[ray]``): each member in its own Ray actor.

The driver keeps what the engine needs locally (each member's tokenizer and byte codec, every
sequence's ids) and runs alignment, combination and re-sync; an actor holds one loaded model and
its sequences' caches. Per step the driver sends each actor only the ids its cache does not hold
yet, and the actor answers with only what the combiner asks for: the top-k (``logprobs``, ``ids``)
for top-k methods (UniTE), plus the log-probabilities of the few ids the combiner names; or the
member's distribution over its own vocabulary for full-distribution methods (GaC). (That vector is
``V_i`` floats, smaller than the union the driver maps it into, so the mapping stays on the driver.)

Actors are placed with a placement group, one bundle per member with its ``num_cpus`` /
``num_gpus``, ``PACK`` (as few nodes as possible) or ``SPREAD`` (one member per node where it
can). ``ray.init`` is called only by ``load_ray_members`` and only when Ray is not initialised:
start Ray (or connect to a cluster) yourself first to choose its options.

Faults: a call to a dead actor raises ``MemberUnavailableError`` (the server answers 503
``member_unavailable`` or, with ``on_member_failure: skip``, goes on without the member). With
``max_restarts`` Ray restarts a dead actor (the factory loads the member again) and sends it the
calls it had not answered; a restarted actor holds no sequence, so it answers them with
``LostSequences`` and the driver sends every sequence again whole (prompt and every id): the step
goes on, later by the reload. ``call_timeout`` bounds every call (an actor that cannot be placed
again would otherwise be waited for without end).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenfuse.errors import MemberUnavailableError, ModelNotInstalledError
from tokenfuse.members.base import Member, SeqState, Shared, kept_logprobs


def import_ray():
    try:
        import ray
    except ImportError as err:
        raise ModelNotInstalledError('placement: ray needs Ray: pip install "tokenfuse[ray]"') from err
    return ray


class LostSequences(Exception):
    """The actor does not hold sequences the driver thinks it does (it was restarted)."""


class MemberActor:
    """The actor side: one member and its sequences, keyed by the driver's sequence keys."""

    def __init__(self, factory: Callable[[], Member], num_threads: int | None = None) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.member = factory()
        self.states: dict[int, SeqState] = {}

    def info(self) -> dict:
        """What the driver side keeps locally: the member's name, default weight, codec, tokenizer,
        context length and load time."""
        m = self.member
        return {"name": m.name, "weight": m.weight, "codec": m.codec, "tokenizer": m.tokenizer,
                "context_length": m.context_length, "load_seconds": m.load_seconds}

    def _sync(self, updates: list[tuple[int, list[int] | None, int, list[int]]]) -> list[SeqState]:
        """Bring each sequence's ids up to the driver's: keep the first ``n_valid``, append the tail."""
        lost = [key for key, prompt, _, _ in updates if prompt is None and key not in self.states]
        if lost:
            raise LostSequences(lost)
        states = []
        for key, prompt, n_valid, tail in updates:
            st = self.states.get(key)
            if st is None:
                st = self.states[key] = self.member.new_state(prompt)
            ids = st.all_ids()[:n_valid] + tail
            st.ids = ids[len(st.prompt_ids):]
            st.drop_cache_after(n_valid)
            states.append(st)
        return states

    def topk(self, updates, k: int) -> tuple[np.ndarray, np.ndarray]:
        lp, ids = self.member.next_topk(self._sync(updates), k)
        return lp.numpy(), ids.numpy()

    def logprobs(self, updates) -> np.ndarray:
        return self.member.next_logprobs(self._sync(updates)).numpy()

    def token_logprobs(self, keys: list[int], ids: np.ndarray) -> np.ndarray:
        if any(k not in self.states for k in keys):
            raise LostSequences([k for k in keys if k not in self.states])
        states = [self.states[k] for k in keys]
        return self.member.token_logprobs(states, torch.from_numpy(ids)).numpy()

    def release(self, keys: list[int]) -> None:
        for k in keys:
            st = self.states.pop(k, None)
            if st is not None:
                self.member.release(st)


@functools.cache
def _actor_class():
    return import_ray().remote(MemberActor)


class RayMember(Member):
    """The driver side of a member that runs in a Ray actor (same contract as a local member).

    Its weights stay in the actor: ``embedding_rows`` / ``input_embeddings`` (DeePEn) raise.
    ``call_timeout``: seconds any one call may take (``None``: no limit).
    """

    def __init__(self, actor: Any, info: dict, *, call_timeout: float | None = None,
                 placement_group: Any = None, group: Shared | None = None) -> None:
        self.actor = actor
        self.name = info["name"]
        self.weight = float(info["weight"])
        self.codec = info["codec"]
        self.tokenizer = info["tokenizer"]
        self.context_length = info["context_length"]
        self.load_seconds = info["load_seconds"]
        self.call_timeout = call_timeout
        self.placement_group = placement_group  # the Ray placement group its actor runs in
        self.group = group  # its placement group, removed when its last member unloads (``Shared``, taken)
        self._keys = itertools.count()
        self._fresh = 0  # sequence keys below this one may be gone from the actor (it failed)

    def _updates(self, states: Sequence[SeqState]) -> list:
        out = []
        for st in states:
            first = st.cache is None or st.cache < self._fresh  # (again) new to the actor: sent whole
            if first and st.cache is not None:
                self.actor.release.remote([st.cache])  # in case it still holds it (a call that timed out)
            if first:
                st.cache = next(self._keys)
                st.drop_cache_after(0)  # the actor holds nothing of it
            out.append((st.cache, st.prompt_ids if first else None, st.n_valid, st.all_ids()[st.n_valid:]))
        return out

    def _call(self, method: str, *args):
        self.check_loaded()
        ray = import_ray()
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=self.call_timeout)
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, LostSequences):
                raise LostSequences(*err.cause.args) from None
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.GetTimeoutError) as err:
            self._fresh = next(self._keys)  # a restarted actor holds none of the sequences it had
            raise MemberUnavailableError(self.name, f"its Ray actor failed: {type(err).__name__}") from None

    def _step(self, method: str, states: Sequence[SeqState], *args):
        """``method`` on the states' updates; when the actor was restarted unseen (between two calls),
        once more with every sequence sent whole."""
        try:
            return self._call(method, self._updates(states), *args)
        except LostSequences:
            self._fresh = next(self._keys)
        try:
            return self._call(method, self._updates(states), *args)
        except LostSequences:
            raise MemberUnavailableError(self.name, "its Ray actor lost the sequences sent again") from None

    def _done(self, states: Sequence[SeqState]) -> None:
        for st in states:
            st.mark_cached()
            st.logprobs_len = st.length

    def next_topk(self, states: Sequence[SeqState], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        lp, ids = self._step("topk", states, k)
        self._done(states)
        return _tensor(lp), _tensor(ids)

    def next_logprobs(self, states: Sequence[SeqState]) -> torch.Tensor:
        out = _tensor(self._step("logprobs", states))
        for st, row in zip(states, out):
            st.logprobs = row  # kept for tie-breaks and token_logprobs, as a local member does
        self._done(states)
        return out

    def token_logprobs(self, states: Sequence[SeqState], ids: torch.Tensor) -> torch.Tensor:
        if all(st.logprobs is not None and st.logprobs_len == st.length for st in states):
            return kept_logprobs(states, ids)
        try:
            return _tensor(self._call("token_logprobs", [st.cache for st in states], ids.numpy()))
        except LostSequences:  # restarted since this step's forward: the step cannot be finished
            self._fresh = next(self._keys)
            raise MemberUnavailableError(self.name, "its Ray actor was restarted during a step") from None

    def release(self, state: SeqState) -> None:
        if state.cache is not None and not self.unloaded:
            self.actor.release.remote([state.cache])  # fire and forget
        state.cache = None
        state.logprobs = None

    def _unload(self) -> None:
        """End its actor (the model and caches go with it), and the placement group with the last of its
        members; nothing to do once Ray is shut down (at exit Ray may have ended them first)."""
        ray = import_ray()
        if ray.is_initialized():
            ray.kill(self.actor, no_restart=True)
            if self.group is not None:
                self.group.drop()


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor of an array Ray handed over (read-only views of its object store are copied)."""
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def place_members(factories: Sequence[Callable[[], Member]], *, num_cpus: Sequence[float],
                  num_gpus: Sequence[float], strategy: str = "PACK", timeout: float = 600.0,
                  max_restarts: int = 0, call_timeout: float | None = None) -> list[RayMember]:
    """Start one actor per member factory inside one placement group; Ray must be initialised.

    ``factories`` are called inside the actors (they are pickled: use module-level functions or
    ``functools.partial``), so the driver never loads the weights. ``max_restarts``: how often Ray
    restarts a dead actor (-1: always); ``call_timeout``: seconds one call may take (see the module
    docstring: set it with restarts).
    """
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles = [{"CPU": c, **({"GPU": g} if g else {})} for c, g in zip(num_cpus, num_gpus)]
    pg = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        raise MemberUnavailableError("placement", f"Ray could not reserve {bundles} ({strategy}) within "
                                                  f"{timeout:.0f} s; cluster resources: {ray.cluster_resources()}")
    cls = _actor_class()
    actors = [
        cls.options(num_cpus=c, num_gpus=g, max_restarts=max_restarts, max_task_retries=max_restarts,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=i)).remote(f, max(1, int(c)))
        for i, (f, c, g) in enumerate(zip(factories, num_cpus, num_gpus))
    ]
    infos = ray.get([a.info.remote() for a in actors])
    group = Shared(functools.partial(remove_placement_group, pg))
    return [RayMember(a, info, call_timeout=call_timeout, placement_group=pg, group=group.take())
            for a, info in zip(actors, infos)]


def load_ray_members(cfg, *, root: Path, progress: bool = True) -> list[RayMember]:
    """The members of ``cfg`` as Ray actors (``placement: ray``); starts Ray if it is not running."""
    from tokenfuse.placement.local import load_member

    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=progress)
    factories = [functools.partial(load_member, m, root=root, progress=False, index=i)
                 for i, m in enumerate(cfg.members)]
    return place_members(factories, num_cpus=[m.num_cpus for m in cfg.members],
                         num_gpus=[m.num_gpus for m in cfg.members], strategy=cfg.placement_strategy,
                         max_restarts=cfg.ray_max_restarts, call_timeout=cfg.ray_call_timeout)
