"""How a member's rows are read: its next-token log-probabilities after given id lists.

(``member`` below is a ``members.base.Member``, which gives its default reader from here.)

Everything above ``members/`` reads rows through here:

- ``positions`` / ``positions_many``: the rows after each of a sequence's id lists, computed on that
  sequence's state (one ``Member.logprobs_at`` per run of lists that only grow): likelihood scoring,
  speculative verification and the text scores;
- a **reader** (``Member.reader``): ``take(lists, ids)`` for many reads along one text (a byte
  model's histories), the entries ``ids[j]`` after ``lists[j]`` (``None``: the whole row), as float64
  arrays. By default ``state_reader``: sequence states kept across calls, one per live branch; a
  backend may give one of its own (llama.cpp: branches off one trunk in shared calls,
  ``members/llamacpp_tree.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from tokenfuse.members.state import SeqState, common_prefix

Take = Callable[[list[list[int]], list[Sequence[int] | None]], list[np.ndarray]]
"""``take(lists, ids)``: the member's next-token natural-log probabilities of ``ids[j]`` after ``lists[j]``
(start ids included; ``ids[j] is None``: the whole row), float64 arrays."""

READERS = 3  # sequence states a ``state_reader`` keeps: one per live branch of a byte model's histories
DROP = 4  # ``state_reader``: a cached id a read drops costs this many ids fed (it is re-fed when its branch grows)


def positions(member: Any, final: SeqState, before: list[list[int]], *,
              pick: list[list[int]] | None = None) -> list[torch.Tensor]:
    """``member``'s next-token log-probabilities after each id list in ``before`` (its ids before
    each piece, in order), computed on ``final`` (the sequence's state after the last piece, whose
    cache the forwards use and keep): one ``logprobs_at`` per run of lists that only grow. ``pick``
    (one list of ids per list in ``before``): only those entries of each row (``logprobs_at``)."""
    return positions_many(member, [final], [before], picks=None if pick is None else [pick])[0]


def positions_many(member: Any, finals: Sequence[SeqState], befores: Sequence[list[list[int]]], *,
                   picks: Sequence[list[list[int]]] | None = None) -> list[list[torch.Tensor]]:
    """``positions`` for several sequences (distinct states) of one member: the first run of each in
    one ``logprobs_at_many`` (batched where the member batches), then the next run of those that have
    one (a re-sync re-cut an earlier id), and so on."""
    out: list[list[torch.Tensor]] = [[] for _ in finals]
    done = [0] * len(finals)
    while todo := [r for r in range(len(finals)) if done[r] < len(befores[r])]:
        ends, runs = [], []
        for r in todo:
            before, j = befores[r], done[r]
            end = j + 1  # the run: lists j .. end-1, each a prefix of the next
            while end < len(before) and _is_prefix(before[end - 1], before[end]):
                end += 1
            last = before[end - 1]
            # feed ``last`` (plus nothing more): the state's ids become it, the cache keeps the common prefix
            finals[r].drop_cache_after(min(common_prefix(finals[r].cached_ids(), last), len(before[j]) - 1))
            _set_ids(finals[r], last)
            ends.append([len(ids) for ids in before[j:end]])
            runs.append(None if picks is None else picks[r][j:end])
            done[r] = end
        got = member.logprobs_at_many([finals[r] for r in todo], ends, picks=None if picks is None else runs)
        for r, rows in zip(todo, got):
            out[r].extend(rows)
    return out


def _is_prefix(a: list[int], b: list[int]) -> bool:
    return len(a) < len(b) and b[: len(a)] == a


def _set_ids(st: SeqState, ids: list[int]) -> None:
    """Point a state at ``ids`` (prompt ids first, which never change)."""
    st.ids = ids[len(st.prompt_ids):]
    st.logprobs = None


@contextlib.contextmanager
def state_reader(member: Any, start: Sequence[int]) -> Iterator[Take]:
    """``take(lists, ids)`` on up to ``READERS`` sequence states of ``member`` after ``start`` (each made
    when first needed), kept across calls (a live branch each): each list goes to the state where it
    costs least, the ids it must feed plus ``DROP`` times the cached ids it would drop (ties: the
    longest shared prefix, then the first state). A list that extends one read before re-feeds only its
    new ids; a short branch off the end of a long list crops it (re-feeding one or two ids is cheaper
    than a state's whole prefill), and two branches that keep growing apart (byte-level generation's
    two tokenisations of one text) end up on states of their own. The rows of a call's lists that go
    to one state are one ``positions`` call there: all whole rows, or all picked entries (a call mixing
    the two reads the whole rows and takes the entries from them)."""
    states: list[SeqState | None] = [None] * READERS  # each made when a list first goes to it

    def take(lists: list[list[int]], ids: list[Sequence[int] | None]) -> list[np.ndarray]:
        cached = [st.cached_ids() if st is not None else [] for st in states]
        where = []
        for x in lists:
            shared = [common_prefix(c, x) for c in cached]
            r = min(range(READERS), key=lambda r: (len(x) - shared[r] + DROP * (len(cached[r]) - shared[r]),
                                                   -shared[r], r))
            where.append(r)
            cached[r] = x  # what that state holds once it has read ``x``
        out: list[np.ndarray | None] = [None] * len(lists)
        for r in sorted(set(where)):
            if states[r] is None:
                states[r] = member.new_state(start)
            mine = [j for j, w in enumerate(where) if w == r]
            whole = any(ids[j] is None for j in mine)
            # the ids as they come (arrays): a list of numpy ints becomes a tensor a hundred times slower
            got = positions(member, states[r], [lists[j] for j in mine],
                            pick=None if whole else [ids[j] for j in mine])  # type: ignore[misc]
            for j, row in zip(mine, got):
                row = row.numpy().astype(np.float64)
                out[j] = row if not whole or ids[j] is None else row[np.asarray(ids[j], dtype=np.int64)]
        return out  # type: ignore[return-value]

    try:
        yield take
    finally:
        for st in states:
            if st is not None:
                member.release(st)
