"""One member's sequences forwarded side by side, its cores split among them.

A llama.cpp member keeps one context per sequence (``tokenfuse.members.llamacpp``), and a context's
numbers do not depend on its thread count (tests/test_llamacpp.py checks it bit for bit), so the
sequences of a batch can run in threads of their own, each with a share of the member's cores,
and give the very numbers they give one after another. On a small CPU this is faster: a small
model's one-token decode does not use two cores well (measured on this project's 2-core machine,
docs/benchmarks.md "Batched decoding"), and the Python around each forward overlaps too.

Rules (``SideBySide.run``):

* sequences without a context yet go first, one after another, in batch order: each takes a
  context from the member's pool, and a later one can copy an earlier one's prompt cache (the pool
  is touched by one thread only);
* the others run in ``min(count, cores)`` threads (sequence ``i`` in thread ``i mod workers``), each
  forward with ``cores // workers`` threads; with fewer than 2 workers, one after another on all
  the cores;
* it returns once every forward has finished, even when one raised (then it raises the first
  error), so no context is still in use when the caller goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

S = TypeVar("S")
R = TypeVar("R")


class SideBySide:
    """A member's threads for forwarding its sequences side by side (created on first use)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0
        self.side_by_side_calls = 0  # runs that used two or more threads

    def run(self, states: Sequence[S], forward: Callable[[S, int], R], *, cores: int,
            new: Callable[[S], bool]) -> list[R]:
        """``forward(state, threads)`` of every state, in the states' order (module docstring)."""
        out: dict[int, R] = {}
        for st in states:
            if new(st):
                out[id(st)] = forward(st, cores)
        live = [st for st in states if id(st) not in out]
        workers = min(len(live), cores)
        if workers < 2:
            out.update((id(st), forward(st, cores)) for st in live)
            return [out[id(st)] for st in states]
        share = cores // workers

        def group(part: Sequence[S]) -> list[tuple[int, R]]:
            return [(id(st), forward(st, share)) for st in part]

        pool = self._threads(workers)
        self.side_by_side_calls += 1
        futures = [pool.submit(group, live[i::workers]) for i in range(workers)]
        wait(futures)
        for f in futures:
            out.update(f.result())
        return [out[id(st)] for st in states]

    def _threads(self, workers: int) -> ThreadPoolExecutor:
        if self._pool is None or self._size < workers:
            self.close()
            self._pool, self._size = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sequence"), workers
        return self._pool

    def close(self) -> None:
        """Let its threads end (a later ``run`` starts new ones)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool, self._size = None, 0
