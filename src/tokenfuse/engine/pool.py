"""The member pool: forward several members on the same sequences, in threads or one by one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from tokenfuse.members.base import Member, SeqState, cpu_cores

log = logging.getLogger("tokenfuse.engine")
T = TypeVar("T")


@dataclass(frozen=True)
class MemberOutput:
    """One member's next-token output for ``R`` rows: its full log-probabilities ``float32[R, V]``
    (``logprobs``), or only its top-k ``(logprobs float32[R, k], ids int64[R, k])`` (``topk``, most
    likely first) when the combiner asks for no more."""

    logprobs: torch.Tensor | None = None
    topk: tuple[torch.Tensor, torch.Tensor] | None = None
    _text_tops: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # top_text per map

    def rows(self, pick: torch.Tensor | None) -> MemberOutput:
        """The output restricted to rows ``pick`` (all rows for ``None``)."""
        if pick is None:
            return self
        if self.logprobs is not None:
            return MemberOutput(logprobs=self.logprobs[pick])
        return MemberOutput(topk=(self.topk[0][pick], self.topk[1][pick]))

    def top_logprob(self) -> torch.Tensor:
        """Each row's highest log-probability ``float32[R]``."""
        if self.logprobs is not None:
            return self.logprobs.max(dim=-1).values
        return self.topk[0][:, 0]

    def top_text(self, umap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's most likely *text* id (``umap``: the member's id -> union map, ``-1`` = not
        text) and its log-probability, as host arrays ``int64[R]`` and ``float32[R]``: the argmax runs
        where the log-probabilities are, only those ``R`` ids and values cross to the host. With
        top-k output a row whose top-k holds no text id gives its first id (not text). Computed once
        per map: a step's agreement skip, its strategies and its trace ask for the same rows."""
        hit = self._text_tops.get(id(umap))
        if hit is not None and hit[0] is umap:
            return hit[1]
        out = self._top_text(umap)
        self._text_tops[id(umap)] = (umap, out)
        return out

    def _top_text(self, umap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.logprobs is not None and self.logprobs.device.type == "cpu":
            # numpy on a CPU: its 1-D argmax is ~10x faster than torch's, and the array is a view
            arr = self.logprobs.numpy()
            ids = arr.argmax(axis=-1)
            for r, tid in enumerate(ids):
                if umap[tid] < 0:  # a special token on top: look at text ids only
                    ids[r] = np.where(umap[: arr.shape[-1]] >= 0, arr[r], -np.inf).argmax()
            return ids, arr[np.arange(len(ids)), ids]
        if self.logprobs is not None:
            ids, tops = top_text_torch(self.logprobs, umap)
            return ids.cpu().numpy(), tops.cpu().numpy()
        tlp, tids = self.topk[0].cpu().numpy(), self.topk[1].cpu().numpy()  # (top-k: a few numbers a row)
        col = (umap[tids] >= 0).argmax(axis=-1)
        rows = np.arange(len(col))
        return tids[rows, col], tlp[rows, col]


def top_text_torch(lp: torch.Tensor, umap: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``MemberOutput.top_text`` of full log-probabilities ``lp`` on their device: the first most
    likely text id of each row ``int64[R]`` and its log-probability."""
    ids = torch.where(_text_mask(umap, lp), lp, -torch.inf).argmax(-1, keepdim=True)
    return ids[:, 0], lp.gather(1, ids)[:, 0]


_TEXT_MASKS: dict[tuple[int, str, int], tuple[np.ndarray, torch.Tensor]] = {}


def _text_mask(umap: np.ndarray, lp: torch.Tensor) -> torch.Tensor:
    """``bool[V]`` on ``lp``'s device: which of ``lp``'s ids are text (rows past the map are not);
    kept per map, device and width (the last few)."""
    key = (id(umap), str(lp.device), lp.shape[-1])
    hit = _TEXT_MASKS.get(key)
    if hit is None or hit[0] is not umap:
        mask = np.zeros(lp.shape[-1], dtype=bool)
        n = min(len(umap), lp.shape[-1])
        mask[:n] = umap[:n] >= 0
        hit = _TEXT_MASKS[key] = (umap, torch.from_numpy(mask).to(lp.device))
        if len(_TEXT_MASKS) > 16:
            _TEXT_MASKS.pop(next(iter(_TEXT_MASKS)))
    return hit[1]


class MemberPool:
    """Runs members' forward passes for a list of sequences.

    With ``parallel`` each member runs in its own thread (llama.cpp and PyTorch release the GIL, so
    members overlap); otherwise one after another. The CPU cores are shared out per call
    (``Member.share_cores``): members side by side split them (a member that finishes first leaves
    its share to those still running), a member running alone (one after another, or the gate on a
    gated step) gets them all. ``forward`` returns only when every member it
    started has finished, even if one raised, so no member is still touching a sequence's state.
    ``quiesce`` waits for any forward still running (e.g. one abandoned by a caller's exception).
    """

    def __init__(self, members: Sequence[Member], *, parallel: bool = True) -> None:
        self.members = list(members)
        self.parallel = parallel
        self.workers = len(self.members) if parallel else 0
        self.cores = cpu_cores()
        self._threads = (ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="member")
                         if parallel else None)

    def forward(self, which: Sequence[int], states: Sequence[Sequence[SeqState]], *,
                topk: int = 0) -> dict[int, MemberOutput]:
        """Members ``which`` on their states (``states[i]``: member ``i``'s state of every row):
        their full log-probabilities, or with ``topk > 0`` their top-k."""
        return self.run(which, lambda i: self._one(i, states[i], topk))

    def run(self, which: Sequence[int], work: Callable[[int], T]) -> dict[int, T]:
        """``work(i)`` for each member ``i`` in ``which`` (each in its own thread when parallel); returns
        only when every one has finished, even if one raised."""
        if not which:
            return {}
        local = [i for i in which if self.members[i].in_process]
        if self._threads is None or len(which) == 1:
            for i in local:  # one at a time: all the cores
                self.members[i].share_cores(self.cores)
            return {i: work(i) for i in which}
        running = set(local)
        lock = threading.Lock()

        def share() -> None:  # the cores split among the local members still running
            for i in running:
                self.members[i].share_cores(max(1, self.cores // len(running)))

        def done(i: int) -> None:  # a member that finishes early leaves its cores to the others
            with lock:
                running.discard(i)
                share()

        share()
        futures = {i: self._threads.submit(work, i) for i in which}
        for i, f in futures.items():
            f.add_done_callback(lambda _f, i=i: done(i))
        wait(futures.values())  # all finished (even when one raises) before anyone touches the states
        return {i: f.result() for i, f in futures.items()}

    def _one(self, i: int, states: Sequence[SeqState], topk: int) -> MemberOutput:
        if topk > 0:
            return MemberOutput(topk=self.members[i].next_topk(states, topk))
        return MemberOutput(logprobs=self.members[i].next_logprobs(states))

    def quiesce(self, timeout: float = 600.0) -> bool:
        """Wait until no member thread is running a forward pass; ``False`` if ``timeout`` passed first.

        One barrier task per thread can only all run once every earlier task is done.
        """
        if self._threads is None:
            return True
        barrier = threading.Barrier(self.workers + 1)
        for _ in range(self.workers):
            self._threads.submit(barrier.wait, timeout)
        try:
            barrier.wait(timeout)
        except threading.BrokenBarrierError:
            log.warning("member threads did not finish within %.0f s", timeout)
            return False
        return True

    def shutdown(self) -> None:
        """Wait for any forward still running and stop the threads; later calls run the members one
        after another (``Ensemble.unload``: its members then say they were unloaded)."""
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None
