"""The shared llama.cpp context of ``multi_seq``: many sequences in one context, one batched decode.

``SharedContext`` is the part of ``LlamaCppMember`` (``tokenfuse.members.llamacpp``) that runs the
sequences given a sequence id of one shared context: the context itself (``_multi_context``), a new
sequence's place in it (``_shared_start``; the choice of a stream with a reusable prefix is the
member's ``_acquire``), and the batched calls — one llama.cpp batch for every sequence's new ids
(``_forward_multi``), or with ``exact_calls`` the calls that give each row its one-by-one numbers
(``_forward_streams``). It uses the member's contexts, statistics and feeding rules
(``_acquire``, ``_call_end``, ``_logprobs``, ``_threads_on``, ``prefix_stats``).
"""

from __future__ import annotations

from typing import Any

import torch

from tokenfuse.members.base import SeqState
from tokenfuse.members.llamacpp_cache import SMALL, Slot, Stream, prompt_head, start_at_a_block
from tokenfuse.members.llamacpp_lib import LOAD_LOCK

# multi_seq "auto" with exact_calls: the shared context's sequence slots (more live sequences than
# this get contexts of their own, with the same numbers). The loadtest's 8 clients; a stream costs
# its KV cache (``n_ctx`` positions, BF16: 50-94 MB for the bundled files at 4096), allocated with
# the shared context on first use.
AUTO_SLOTS = 8


def resolve_multi_seq(multi_seq: int | str, exact_calls: bool) -> int:
    """The shared context's sequence slots for a ``multi_seq`` setting: an integer as given; ``"auto"``
    ``AUTO_SLOTS`` with ``exact_calls`` (batched calls then give the one-by-one numbers), else 0 (a
    context per sequence: without exact_calls a batched call's numbers depend on the batch)."""
    if multi_seq == "auto":
        return AUTO_SLOTS if exact_calls else 0
    if isinstance(multi_seq, bool) or not isinstance(multi_seq, int) or multi_seq < 0:
        raise ValueError(f"multi_seq: expected \"auto\" or a number of sequence slots >= 0, got {multi_seq!r}")
    return multi_seq


def put_token(b: Any, j: int, token: int, pos: int, seq: int) -> None:
    """Write one token into position ``j`` of a llama.cpp batch (no logits requested)."""
    b.token[j], b.pos[j], b.seq_id[j][0], b.n_seq_id[j], b.logits[j] = token, pos, seq, 1, False


class SharedContext:
    """``LlamaCppMember``'s shared context (the module docstring)."""

    def _shared_slots_left(self) -> int:
        """How many more sequences the shared context takes (``multi_seq`` less its live ones)."""
        return self.multi_seq - len(self._streams_busy)

    def _forward_multi(self, states: list[SeqState]) -> list[torch.Tensor]:
        """One llama.cpp batch for the new tokens of every sequence (one context, one seq id each)."""
        if self.exact_calls:
            rows = self._forward_streams(states)
            return [rows[id(st), st.length - 1] for st in states]
        ctx, batch = self._multi_context()
        out: dict[int, torch.Tensor] = {}
        queue = [(st, st.all_ids()[self._shared_start(st, st.length - 1) :]) for st in states]
        while queue:  # fill batches of at most n_batch tokens; a long prefill spans several
            b, last, used, rest = batch.batch, {}, 0, []
            for st, ids in queue:
                take, stream = ids[: self.n_batch - used], st.cache
                for j, tok in enumerate(take):
                    put_token(b, used + j, tok, stream.n + j, stream.seq)
                if take:
                    stream.n += len(take)
                    used += len(take)
                    if len(take) == len(ids):
                        b.logits[used - 1] = True
                        last[id(st)] = used - 1
                if len(take) < len(ids):
                    rest.append((st, ids[len(take):]))
            b.n_tokens = used
            ctx.decode(batch)
            for st, _ in queue:
                if id(st) in last:
                    out[id(st)] = self._logprobs(ctx, last[id(st)])
            queue = rest
        return [out[id(st)] for st in states]

    def _multi_context(self) -> tuple[Any, Any]:
        """The shared context of ``multi_seq`` (created on first use, with its ``multi_seq`` sequence
        ids): one KV cache for every sequence, or with ``exact_calls`` one KV stream per sequence."""
        if self._multi is None:
            from llama_cpp._internals import LlamaBatch, LlamaContext

            params = type(self.llm.context_params).from_buffer_copy(self.llm.context_params)
            params.n_seq_max, params.kv_unified = self.multi_seq, not self.exact_calls
            params.n_ctx = self.context_length * self.multi_seq
            with LOAD_LOCK:
                ctx = LlamaContext(model=self.llm._model, params=params, verbose=False)
            self._multi = Slot(ctx, LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1, verbose=False))
            self._streams = [Stream(self._multi, seq) for seq in range(self.multi_seq)]
        self._threads_on(self._multi)
        return self._multi.ctx, self._multi.batch

    def _shared_start(self, st: SeqState, limit: int) -> int:
        """Give a new ``st`` a sequence id of the shared context (``_acquire``: with ``exact_calls``
        one whose stream shares a reusable prefix, of at most ``limit`` ids), crop what its stream
        caches to ``n_valid``; returns how many of its ids are cached."""
        if st.cache is None:
            st.cache = self._acquire(st, limit, shared=True)
        if self.exact_calls:
            start_at_a_block(st)
        stream: Stream = st.cache
        if stream.n > st.n_valid:
            stream.crop(st.n_valid)
        st.n_valid = stream.n
        with self._stats_lock:
            self.prefix_stats["fed"] += st.length - stream.n
        return stream.n

    def _forward_streams(self, states: list[SeqState], want: dict[int, set[int]] | None = None
                         ) -> dict[tuple[int, int], torch.Tensor]:
        """``multi_seq`` with ``exact_calls``: each sequence's prompt blocks in block calls of its own,
        then every other id of every sequence in shared calls of at most ``SMALL`` ids — each row is
        computed as a one-id call of that sequence alone computes it (``scripts/measure/measure_batch_invariance.py
        --exact``), so the batch gives the one-by-one numbers. A new sequence takes its stream after
        the sequences before it fed their blocks, so it can copy a prompt one of them shares. Returns
        the log-probabilities after the positions in ``want[id(st)]`` (default: each sequence's
        last), keyed ``(id(st), position)``."""
        ctx, batch = self._multi_context()
        want = want or {id(st): {st.length - 1} for st in states}
        b, out, queue = batch.batch, {}, []
        for st in states:
            start = self._shared_start(st, min(want[id(st)]))
            stream, ids, head = st.cache, st.all_ids()[start:], prompt_head(st)
            while start < head:
                stop, _ = self._call_end(start, st.length, head)
                for j, tok in enumerate(ids[: stop - start]):
                    put_token(b, j, tok, start + j, stream.seq)
                    b.logits[j] = start + j in want[id(st)]
                b.n_tokens = stop - start
                ctx.decode(batch)
                out.update(((id(st), p), self._logprobs(ctx, p - start)) for p in range(start, stop) if p in want[id(st)])
                if start == stream.exact:
                    stream.exact = stop
                ids, start = ids[stop - start :], stop
                stream.n = st.n_valid = stop  # already now, so a later new sequence can copy the blocks
            queue += [(st, start + j, tok) for j, tok in enumerate(ids)]
        for i in range(0, len(queue), SMALL):
            rows = queue[i : i + SMALL]
            for j, (st, pos, tok) in enumerate(rows):
                put_token(b, j, tok, pos, st.cache.seq)
                b.logits[j] = pos in want[id(st)]
            b.n_tokens = len(rows)
            ctx.decode(batch)
            out.update(((id(st), pos), self._logprobs(ctx, j)) for j, (st, pos, _) in enumerate(rows)
                       if pos in want[id(st)])
        for st in states:
            st.cache.n = st.n_valid = st.length
        return out
