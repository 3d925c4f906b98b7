"""The llama.cpp member's KV caches: one context per sequence (``Slot``) or one sequence id of the
shared context (``Stream``, ``multi_seq``), and how much of a cached prefix a new sequence may reuse
and still get a fresh prefill's numbers (the prefix cache's rules; ``tokenfuse.members.llamacpp``
explains why, and holds the member that uses them).
"""

from __future__ import annotations

import ctypes
from typing import Any

from tokenfuse.members.base import SeqState

# llama.cpp's CPU kernels compute a decode call of fewer than BLOCK ids differently from a longer one
# and group the rows of a longer one from its first position (scripts/measure/measure_split.py). A cached
# prefix is therefore reused only where that gives a fresh prefill's very numbers: up to a multiple
# of BLOCK, within the positions the cache computed as a fresh prefill does (``Slot.exact``), with at
# least BLOCK ids left to feed; and long feeds are cut at absolute multiples of ``n_batch``.
BLOCK = 8
# A live sequence's cache is copied for a new one when that saves at least this many ids over the
# best pooled context: one block (copying a short cache takes a few ms, feeding a block tens of ms).
COPY_MIN = BLOCK
# exact_calls (flash attention on, weights not repacked; measured on the bundled files, checked by
# tests/test_llamacpp.py): a call of at most SMALL ids computes every row as a one-id call does; calls
# of whole LARGE-blocks starting at a multiple of LARGE compute every row as one long call does.
SMALL = 7
LARGE = 64


class Slot:
    """One llama.cpp context holding one sequence's KV cache (as llama.cpp's sequence ``seq``)."""

    seq = 0

    def __init__(self, ctx: Any, batch: Any) -> None:
        self.ctx = ctx
        self.batch = batch
        self.n = 0  # positions in the cache
        self.exact = 0  # positions [0, exact) were computed as a fresh prefill computes them (BLOCK)
        self.threads = 0  # the thread count last set on its context
        self.owner: SeqState | None = None  # the live sequence using it; None while pooled
        self.ids: list[int] = []  # while pooled: the ids its cache still holds (prefix reuse)

    def cached_ids(self) -> list[int]:
        """Ids whose keys and values the cache holds correctly (a prefix of what was fed)."""
        if self.owner is None:
            return self.ids
        return self.owner.all_ids()[: min(self.owner.n_valid, self.n)]

    def copy_from(self, src: Slot, lib: Any) -> bool:
        """Copy ``src``'s whole cache into this one (llama.cpp's sequence state; ``lib``: the
        ``llama_cpp`` module); False if it failed."""
        size = lib.llama_state_seq_get_size(src.ctx.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        got = lib.llama_state_seq_get_data(src.ctx.ctx, buf, size, 0)
        self.ctx.kv_cache_seq_rm(0, 0, -1)
        ok = got > 0 and lib.llama_state_seq_set_data(self.ctx.ctx, buf, got, 0) == got
        self.n = src.n if ok else 0
        self.exact = src.exact if ok else 0
        if not ok:
            self.ctx.kv_cache_seq_rm(0, 0, -1)
        return ok

    def crop(self, n: int) -> None:
        """Keep the cache's first ``n`` positions (``n`` <= ``self.n``); all of them dropped where
        llama.cpp cannot cut there."""
        if not self.ctx.kv_cache_seq_rm(self.seq, n, -1):
            self.ctx.kv_cache_seq_rm(self.seq, 0, -1)
            n = 0
        self.n, self.exact = n, min(self.exact, n)

    def close(self) -> None:
        """Free its llama.cpp context and batch now (not when llama-cpp-python's ``__del__`` runs)."""
        self.ctx.close()
        self.batch.close()


class Stream(Slot):
    """One sequence id of the member's shared context (``multi_seq``): with ``exact_calls`` a KV
    stream of its own (``context_length`` cells). Pooled and reused like a ``Slot``; the context and
    batch are the shared one's (closed with it, not here)."""

    def __init__(self, shared: Slot, seq: int) -> None:
        super().__init__(shared.ctx, shared.batch)
        self.seq = seq

    def copy_from(self, src: Slot, lib: Any) -> bool:
        """Copy ``src``'s whole stream into this one (llama.cpp copies the buffers cell for cell at
        its next decode, so the copy holds the very cells, in the same places); True."""
        self.ctx.kv_cache_seq_cp(src.seq, self.seq, -1, -1)
        self.n, self.exact = src.n, src.exact
        return True

    def close(self) -> None:
        """Nothing to free: the shared context goes with the member's ``Slot`` for it."""


def reusable_prefix(common: int, exact: int, total: int, limit: int) -> int:
    """How many of a cache's ids a sequence of ``total`` ids sharing ``common`` with them may reuse
    and still get a fresh prefill's numbers (``BLOCK``); at most ``limit``."""
    n = min(common, exact, limit, total - BLOCK)
    return max(0, n - n % BLOCK)


def reusable_prefix_exact(common: int, exact: int, head: int, limit: int) -> int:
    """``reusable_prefix`` under ``exact_calls``, for a sequence whose prompt's whole ``LARGE``-blocks
    end at ``head``: the cache's rows ``[0, exact)`` came from block calls, the rest from short calls,
    and a reused row must have been computed as this sequence computes it (rows below ``head`` in
    block calls, the others in short calls); a feed inside the blocks starts at a block boundary."""
    n = min(common, limit)
    if exact != head:
        n = min(n, exact, head)
    if n < head:
        n -= n % LARGE
    return max(0, n)


def prompt_head(st: SeqState) -> int:
    """Where the whole ``LARGE``-blocks of ``st``'s prompt end (``exact_calls``)."""
    return len(st.prompt_ids) - len(st.prompt_ids) % LARGE


def start_at_a_block(st: SeqState) -> None:
    """``exact_calls``: a feed inside the prompt's blocks starts at a block boundary (crop further)."""
    if st.n_valid < prompt_head(st):
        st.n_valid -= st.n_valid % LARGE
