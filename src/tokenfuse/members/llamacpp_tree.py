"""Rows after many id lists that branch off one trunk, on the llama.cpp member (``LlamaCppMember.tree_reader``).

A byte-level view (alignment/byteview.py) reads the member's rows after its own tokens of a text (the
trunk) and after many branches one id off it. Fed one by one, each branch is a decode call of its own
that crops and re-feeds a cache. Here the trunk stays in sequence 0 of a context with one KV cache for
all its sequences (``kv_unified``), and the branches go in one call: each gets a sequence id of its
own, the trunk's cells below its branch point are tagged with that id too (``llama_memory_seq_cp``: no
copy) and its id is decoded with every other branch's; afterwards the ids are removed again. A list
whose ids all lie on the trunk is a branch of its last id; a list that extends the trunk, or leaves it
by more than one id, becomes the trunk (fed after the cells it shares with the old one).

The numbers are the member's rows as these calls compute them. llama.cpp's kernels depend on a call's
size: a row computed with others differs from the same row in a call of its own by up to 0.065 in
total variation on the bundled files (a branch alone in its call gives that call's numbers bit for
bit; tests/test_llamacpp_tree.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from tokenfuse.members.base import common_prefix
from tokenfuse.members.llamacpp_cache import Slot
from tokenfuse.members.llamacpp_lib import LOAD_LOCK
from tokenfuse.members.llamacpp_shared import put_token

BRANCHES = 63  # sequence ids for branches in one call (llama.cpp allows 256 sequences; below n_batch)


class TreeReader:
    """``take(lists, ids)`` (the byte view's reads: the log-probabilities of ``ids[j]`` after
    ``lists[j]``) on a context of its own: the module docstring."""

    def __init__(self, member: Any) -> None:
        from llama_cpp._internals import LlamaBatch, LlamaContext

        self.member = member
        params = type(member.llm.context_params).from_buffer_copy(member.llm.context_params)
        params.n_seq_max, params.kv_unified = BRANCHES + 1, True
        params.n_ctx = member.context_length + member.n_batch
        with LOAD_LOCK:
            ctx = LlamaContext(model=member.llm._model, params=params, verbose=False)
        self.slot = Slot(ctx, LlamaBatch(n_tokens=member.n_batch, embd=0, n_seq_max=1, verbose=False))
        self.trunk: list[int] = []

    def close(self) -> None:
        self.slot.close()

    def take(self, lists: list[list[int]], ids: list[Sequence[int]]) -> list[np.ndarray]:
        self.member._threads_on(self.slot)
        out: list[np.ndarray | None] = [None] * len(lists)
        while far := [x for x, o in zip(lists, out) if o is None and self._reroots(x)]:
            self._reroot(max(far, key=len), lists, ids, out)
        todo = [j for j, o in enumerate(out) if o is None]  # each now one id off the trunk
        for k in range(0, len(todo), BRANCHES):
            self._branches(todo[k:k + BRANCHES], lists, ids, out)
        return out  # type: ignore[return-value]

    def _reroots(self, x: list[int]) -> bool:
        """Whether ``x`` becomes the trunk: it extends the trunk, or leaves it by more than one id."""
        common = common_prefix(self.trunk, x)
        return len(x) - common > 1 or (common == len(self.trunk) and len(x) > common)

    def _reroot(self, root: list[int], lists: list[list[int]], ids: list[Sequence[int]],
                out: list[np.ndarray | None]) -> None:
        """Make ``root`` the trunk (its common prefix with the old one kept), with the rows of the lists
        that are prefixes of it and end past that prefix."""
        ctx, b = self.slot.ctx, self.slot.batch.batch
        keep = common_prefix(self.trunk, root)
        if len(root) > self.member.context_length:
            raise ValueError(f"member {self.member.name!r}: {len(root)} ids do not fit its context "
                             f"({self.member.context_length})")
        ctx.kv_cache_seq_rm(0, keep, -1)
        want: dict[int, list[int]] = {}  # position -> the lists ending after it
        for j, x in enumerate(lists):
            if keep < len(x) <= len(root) and root[: len(x)] == x:
                want.setdefault(len(x) - 1, []).append(j)
        for start in range(keep, len(root), self.member.n_batch):
            stop = min(len(root), start + self.member.n_batch)
            for i, pos in enumerate(range(start, stop)):
                put_token(b, i, root[pos], pos, 0)
                b.logits[i] = pos in want
            b.n_tokens = stop - start
            ctx.decode(self.slot.batch)
            for pos in range(start, stop):
                for j in want.get(pos, ()):
                    out[j] = self._row(ctx, pos - start, ids[j])
        self.trunk = list(root)

    def _branches(self, js: list[int], lists: list[list[int]], ids: list[Sequence[int]],
                  out: list[np.ndarray | None]) -> None:
        """The rows of ``lists[j]`` for ``j`` in ``js`` (at most ``BRANCHES``, each one id off the trunk:
        a prefix of it and one more id, or a prefix of it whose last id is decoded again), in one call."""
        ctx, b = self.slot.ctx, self.slot.batch.batch
        for k, j in enumerate(js):
            x = lists[j]
            at = len(x) - 1
            ctx.kv_cache_seq_cp(0, k + 1, 0, at)
            put_token(b, k, x[at], at, k + 1)
            b.logits[k] = True
        b.n_tokens = len(js)
        ctx.decode(self.slot.batch)
        for k, j in enumerate(js):
            out[j] = self._row(ctx, k, ids[j])
        for k in range(len(js)):
            ctx.kv_cache_seq_rm(k + 1, -1, -1)

    def _row(self, ctx: Any, i: int, ids: Sequence[int]) -> np.ndarray:
        return self.member._logprobs(ctx, i, torch.as_tensor(ids, dtype=torch.long)).numpy().astype(np.float64)


@contextmanager
def tree_reader(member: Any) -> Iterator[Any]:
    """A ``TreeReader``'s ``take`` for the ``with`` block; its context is freed afterwards."""
    reader = TreeReader(member)
    try:
        yield reader.take
    finally:
        reader.close()
