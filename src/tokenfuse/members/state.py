"""A member's per-sequence state (``SeqState``): its ids and how much of its KV cache is still good.

The engine keeps the ids in sync with the shared output bytes and tells the member, through the cache
methods (``drop_cache_after``, ``mark_cached``, ``reuse_cache``; ``snapshot``/``restore`` for
speculative rounds), how much of its cache holds; they keep ``SeqState.n_valid``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class SeqState:
    """One member's view of one sequence.

    Attributes:
        prompt_ids: the member's own ids for the prompt (fixed; re-sync never reaches into them).
        ids: ids of the output so far (may cover less than the output: see ``covered``).
        starts: byte offset in the output where each of ``ids`` starts.
        covered: output bytes that ``ids`` stand for; bytes past it are held back (they cannot be
            represented yet, e.g. a split UTF-8 character in a vocabulary without that byte).
        provisional: the last ids are raw byte tokens for an unfinished character; the next
            re-sync replaces them.
        n_valid: how many positions of ``prompt_ids + ids`` the backend's cache still holds
            correctly; the next forward crops the cache to it and feeds the rest. Outside the
            backends it changes only through the methods below (``drop_cache_after``,
            ``mark_cached``, ``reuse_cache``).
        cache: the backend's KV cache object.
        logprobs: the last computed next-token log-probabilities, ``float32[V]``, and the
            sequence length they belong to.
    """

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    covered: int = 0
    provisional: bool = False
    n_valid: int = 0
    cache: Any = None
    logprobs: torch.Tensor | None = None
    logprobs_len: int = -1

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.ids

    @property
    def stale(self) -> bool:
        """The last log-probabilities do not belong to the current ids (a forward is needed)."""
        return self.logprobs is None or self.logprobs_len != self.length or self.pending > 0

    @property
    def pending(self) -> int:
        """Ids not yet in the cache (fed in one chunk at the next forward)."""
        return self.length - self.n_valid

    # ------------------------------------------------------------------ the cache's validity
    def drop_cache_after(self, n: int) -> None:
        """The cache keeps at most its first ``n`` positions (the next forward crops it and feeds the rest)."""
        self.n_valid = min(self.n_valid, n)

    def mark_cached(self) -> None:
        """The cache now holds every id of the sequence (they were fed)."""
        self.n_valid = self.length

    def cached_ids(self) -> list[int]:
        """The ids whose positions the cache holds correctly."""
        return self.all_ids()[: self.n_valid]

    def reuse_cache(self, cached: list[int]) -> None:
        """The ids changed while the cache held ``cached`` (``cached_ids()`` then): it stays valid as
        far as they agree with the current ids."""
        self.n_valid = common_prefix(cached, self.all_ids())

    def snapshot(self) -> StateSnapshot:
        """Its ids and last log-probabilities, for ``restore`` (the cache's validity is not part of it)."""
        return StateSnapshot(tuple(self.ids), tuple(self.starts), self.covered, self.provisional, self.logprobs,
                             self.logprobs_len)

    def restore(self, snap: StateSnapshot) -> None:
        """Back to ``snap``'s ids and log-probabilities; the cache's validity stays as it is (``reuse_cache``)."""
        self.ids, self.starts = list(snap.ids), list(snap.starts)
        self.covered, self.provisional = snap.covered, snap.provisional
        self.logprobs, self.logprobs_len = snap.logprobs, snap.logprobs_len


@dataclass(frozen=True)
class StateSnapshot:
    """A ``SeqState``'s ids and last log-probabilities at one moment (``SeqState.snapshot``)."""

    ids: tuple[int, ...]
    starts: tuple[int, ...]
    covered: int
    provisional: bool
    logprobs: torch.Tensor | None
    logprobs_len: int


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """The length of the common prefix of two id lists (of their first ``limit`` ids, if given)."""
    n = min(len(a), len(b), len(a) if limit is None else limit)
    if n <= 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n
