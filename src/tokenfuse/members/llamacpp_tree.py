"""Rows after many id lists that branch off one trunk, on the llama.cpp member (its ``reader``).

A byte-level view (alignment/byteview.py) reads the member's rows after its own tokens of a text (the
trunk) and after many branches a few ids off it. Fed one by one, each branch is a decode call of its
own that crops and re-feeds a cache. Here the trunk stays in sequence 0 of a context with one KV cache
for all its sequences (``kv_unified``), and the branches go in one call: each gets a sequence id of its
own, the trunk's cells below its branch point are tagged with that id too (``llama_memory_seq_cp``: no
copy) and its ids after that point are decoded with every other branch's; afterwards the ids are removed
again. A list whose ids all lie on the trunk is a branch of its last id; a list that is a prefix of a
longer one's ids in the same read is a row of that branch; a list that leaves the trunk by more than
``TAIL`` ids becomes the trunk (fed after the cells it shares with the old one).

The numbers are the member's rows as these calls compute them. llama.cpp's kernels depend on a call's
size: a row computed with others differs from the same row in a call of its own by up to 0.065 in
total variation on the bundled files (a branch alone in its call gives that call's numbers bit for
bit; tests/test_llamacpp_tree.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tokenfuse.members.base import common_prefix
from tokenfuse.members.llamacpp_cache import Slot
from tokenfuse.members.llamacpp_lib import LOAD_LOCK
from tokenfuse.members.llamacpp_shared import put_token

TRUNK, DETOUR = 0, 1  # the two sequences kept across reads; branches take the ids after them
BRANCHES = 62  # sequence ids for branches in one call (llama.cpp allows 256 sequences; below n_batch)
TAIL = 32  # a list that leaves both kept sequences by more ids than this becomes the trunk


@dataclass
class _Branch:
    """Ids fed after the first ``point`` cells of sequence ``source`` (the trunk or the detour) in a
    sequence of their own (``full[point:]``), and the rows wanted there: ``(position, list index)``."""

    source: int
    point: int
    full: list[int]
    rows: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class CallStats:
    """What one kind of a reader's decode calls cost: calls, ids fed, rows taken, seconds in llama.cpp's
    decode (the rest of a read's time is host work: the rows' log-softmax, the byte model)."""

    calls: int = 0
    ids: int = 0
    rows: int = 0
    seconds: float = 0.0

    def add(self, ids: int, rows: int, seconds: float) -> None:
        self.calls, self.ids, self.rows, self.seconds = self.calls + 1, self.ids + ids, self.rows + rows, self.seconds + seconds


class TreeReader:
    """``take(lists, ids)`` (``members.reading.Take``: the log-probabilities of ``ids[j]`` after
    ``lists[j]``, ``None`` the whole row) on a context of its own: the module docstring. ``stats``:
    its decode calls so far, ``"kept"`` (feeding the trunk or the detour) and ``"branches"``."""

    def __init__(self, member: Any) -> None:
        from llama_cpp._internals import LlamaBatch, LlamaContext

        self.member = member
        params = type(member.llm.context_params).from_buffer_copy(member.llm.context_params)
        params.n_seq_max, params.kv_unified = BRANCHES + 2, True
        params.n_ctx = 2 * member.context_length + member.n_batch  # the trunk, the detour's own cells, a call
        with LOAD_LOCK:
            ctx = LlamaContext(model=member.llm._model, params=params, verbose=False)
        self.slot = Slot(ctx, LlamaBatch(n_tokens=member.n_batch, embd=0, n_seq_max=1, verbose=False))
        self.held: dict[int, list[int]] = {TRUNK: [], DETOUR: []}  # the ids each kept sequence holds
        self.stats = {"kept": CallStats(), "branches": CallStats()}

    def close(self) -> None:
        self.slot.close()

    def take(self, lists: list[list[int]], ids: list[Sequence[int]]) -> list[np.ndarray]:
        self.member._threads_on(self.slot)
        out: list[np.ndarray | None] = [None] * len(lists)
        while far := [x for x, o in zip(lists, out) if o is None and self._off(x)[1] > TAIL]:
            self._keep(TRUNK, max(far, key=len), lists, ids, out)
        if off := [x for x, o in zip(lists, out) if o is None and self._off(x)[1] > 1]:
            self._keep(DETOUR, max(off, key=len), lists, ids, out)
        call: list[_Branch] = []
        for br in self._branches_of([j for j, o in enumerate(out) if o is None], lists):
            if call and (len(call) == BRANCHES or sum(len(c.full) - c.point for c in call) + len(br.full) - br.point
                         > self.member.n_batch):
                self._decode(call, ids, out)
                call = []
            call.append(br)
        if call:
            self._decode(call, ids, out)
        return out  # type: ignore[return-value]

    def _off(self, x: list[int]) -> tuple[int, int]:
        """The kept sequence sharing most of ``x`` (the trunk on ties) and how many ids ``x`` has past it."""
        shared = {seq: common_prefix(held, x) for seq, held in self.held.items()}
        seq = DETOUR if shared[DETOUR] > shared[TRUNK] else TRUNK
        return seq, len(x) - shared[seq]

    def _branches_of(self, todo: list[int], lists: list[list[int]]) -> list[_Branch]:
        """The lists ``todo`` as branches, longest first: a list that is a prefix of a branch's ids and
        ends in its fed part is a row of that branch; a list within a kept sequence re-feeds its last id."""
        out: list[_Branch] = []
        for j in sorted(todo, key=lambda j: -len(lists[j])):
            x = lists[j]
            seq, past = self._off(x)
            shared = len(x) - past
            for br in out:
                if (br.source == seq and br.point < len(x) <= len(br.full) and shared >= br.point
                        and br.full[br.point:len(x)] == x[br.point:]):
                    br.rows.append((len(x) - 1, j))
                    break
            else:
                out.append(_Branch(seq, min(shared, len(x) - 1), x, [(len(x) - 1, j)]))
        return out

    def _keep(self, seq: int, root: list[int], lists: list[list[int]], ids: list[Sequence[int]],
              out: list[np.ndarray | None]) -> None:
        """Make ``root`` what sequence ``seq`` holds: it keeps its common prefix with what it held, or
        starts from the other kept sequence's cells where those share more of ``root``. With the rows of
        the lists that are prefixes of it and end past what was kept."""
        ctx, b = self.slot.ctx, self.slot.batch.batch
        if len(root) > self.member.context_length:
            raise ValueError(f"member {self.member.name!r}: {len(root)} ids do not fit its context "
                             f"({self.member.context_length})")
        other = DETOUR if seq == TRUNK else TRUNK
        keep, theirs = common_prefix(self.held[seq], root), common_prefix(self.held[other], root)
        if theirs > keep:  # start from the other one's cells
            keep = theirs
            ctx.kv_cache_seq_rm(seq, -1, -1)
            ctx.kv_cache_seq_cp(other, seq, 0, keep)
        ctx.kv_cache_seq_rm(seq, keep, -1)
        want: dict[int, list[int]] = {}  # position -> the lists ending after it
        for j, x in enumerate(lists):
            if out[j] is None and keep < len(x) <= len(root) and root[: len(x)] == x:
                want.setdefault(len(x) - 1, []).append(j)
        for start in range(keep, len(root), self.member.n_batch):
            stop = min(len(root), start + self.member.n_batch)
            for i, pos in enumerate(range(start, stop)):
                put_token(b, i, root[pos], pos, seq)
                b.logits[i] = pos in want
            b.n_tokens = stop - start
            t0 = time.perf_counter()
            ctx.decode(self.slot.batch)
            self.stats["kept"].add(stop - start, sum(len(want.get(p, ())) for p in range(start, stop)),
                                   time.perf_counter() - t0)
            for pos in range(start, stop):
                for j in want.get(pos, ()):
                    out[j] = self._row(ctx, pos - start, ids[j])
        self.held[seq] = list(root)

    def _decode(self, call: list[_Branch], ids: list[Sequence[int]], out: list[np.ndarray | None]) -> None:
        """The rows of the branches ``call`` (at most ``BRANCHES``, ``n_batch`` ids in all), in one call:
        each in a sequence of its own, which shares its source's cells below its point."""
        ctx, b = self.slot.ctx, self.slot.batch.batch
        n, rows = 0, []
        for k, br in enumerate(call):
            ctx.kv_cache_seq_cp(br.source, 2 + k, 0, br.point)
            for pos in range(br.point, len(br.full)):
                put_token(b, n, br.full[pos], pos, 2 + k)
                mine = [j for p, j in br.rows if p == pos]
                b.logits[n] = bool(mine)
                rows += [(n, j) for j in mine]
                n += 1
        b.n_tokens = n
        t0 = time.perf_counter()
        ctx.decode(self.slot.batch)
        self.stats["branches"].add(n, len(rows), time.perf_counter() - t0)
        for i, j in rows:
            out[j] = self._row(ctx, i, ids[j])
        for k in range(len(call)):
            ctx.kv_cache_seq_rm(2 + k, -1, -1)

    def _row(self, ctx: Any, i: int, ids: Sequence[int] | None) -> np.ndarray:
        pick = None if ids is None else torch.as_tensor(ids, dtype=torch.long)
        return self.member._logprobs(ctx, i, pick).numpy().astype(np.float64)


@contextmanager
def tree_reader(member: Any) -> Iterator[Any]:
    """A ``TreeReader``'s ``take`` for the ``with`` block; its context is freed afterwards."""
    reader = TreeReader(member)
    try:
        yield reader.take
    finally:
        reader.close()
