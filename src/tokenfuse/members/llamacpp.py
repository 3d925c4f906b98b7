"""Member backend: a GGUF file run by llama.cpp (llama-cpp-python), quantised as it ships.

Compute runs in llama.cpp; the vocabulary goes through the same byte alignment as every other
member, from a tokenizer.json built once out of the same GGUF file (``tokenizer_dir``: the bundled
models' own build, ``tokenfuse.members.gguf_tokenizer``; otherwise transformers' conversion, cached). Its ids are the GGUF's ids, and a test checks every id's bytes against
llama.cpp's own ``token_to_piece``.

Where sequences run (``multi_seq``, default ``"auto"``: ``llamacpp_shared.resolve_multi_seq``):

* ``multi_seq=N`` (``"auto"`` with ``exact_calls``: N = ``AUTO_SLOTS``, 8) puts up to N live
  sequences in one shared context, a sequence id each, and decodes all their new ids in one
  llama.cpp batch: every batched step — ``next_logprobs`` on many states, whatever each feeds (one
  id, a catch-up chunk after a re-sync, a prefill) — is one batched call, and ``logprobs_at``
  (speculative verification, one-forward scoring, PackLLM prompt scoring) feeds its sequence
  through the same context. A sequence opened while all N ids are live gets a context of its own
  (below) instead, until it ends; nothing waits and nothing fails. With ``exact_calls`` each
  sequence id has a KV stream of its own (``n_ctx`` positions) and batched calls give the
  one-by-one numbers (below), so this is the default there.
* ``multi_seq=0`` (``"auto"`` without ``exact_calls``): each sequence gets its own llama.cpp
  context from a per-member pool (contexts share the loaded weights), so a sequence's numbers
  never depend on what else is in the batch, and a batch's sequences run side by side, the cores
  split among them (``side_by_side``, ``tokenfuse.members.side_by_side``).

Where llama.cpp's numbers are not the one-by-one numbers (the sequence alone, one id per call
after its prompt's whole blocks) — only without ``exact_calls``:

* the batch, with ``multi_seq=N`` set explicitly: every batched step (two or more sequences with
  new ids). They share one KV cache and one call, and llama.cpp's batched kernels make each row
  depend on the batch's composition (2-3 of 4 continuations identical to one by one in
  ``scripts/bench/bench_multiseq.py``, 7 of 8 in ``scripts/load/loadtest.py``); this shared context has no
  prefix cache either;
* the cut, with either setting: whatever feeds a sequence several ids in one call — a catch-up
  chunk after a re-sync, speculative verification and one-forward scoring (``logprobs_at``),
  PackLLM's prompt chunks — takes other kernels than one-id calls (below: up to 1.5 in a
  log-probability on the Gemma-3 and Qwen files), so those paths can differ from the stepwise one
  in a near-tie.

With ``multi_seq=0`` a batch still gives each sequence's numbers alone (contexts of their own; the
thread count does not change a context's numbers), and the prefix cache a fresh prefill's.

Rollback removes cached positions past the common prefix (``llama_memory_seq_rm``); logits are
requested only for the positions asked for (the last one when stepping, several for one-forward
scoring). Sliding-window layers (Gemma-3) keep their full cache (``swa_full``) so any rollback is
possible.

Prefix cache (``prefix_cache``, on by default): a new sequence starts from the pooled (or a live)
context sharing the longest prefix of its ids, reusing only what gives a fresh prefill's very
numbers (``BLOCK``), so a sequence's numbers do not depend on what ran before it either (the
contexts and these rules: ``tokenfuse.members.llamacpp_cache``). The shared context with
``exact_calls`` does the same with its sequence ids: a released one keeps its stream for the next
sequence sharing its prefix, and a live one's stream is copied whole (llama.cpp copies the buffers
cell for cell, so unlike a context's copy it is exact past Gemma-3's sliding window too). ``unload``
frees the contexts, and the model with the last member on it, while llama-cpp-python can still free
them.

How a sequence is cut into decode calls changes llama.cpp's numbers on this CPU build: a
one-token call takes other attention kernels than a longer one, the weight matrices of some
quantisation types (Q4_K/Q6_K/Q5_0, as in the bundled Gemma-3 and Qwen files) are multiplied by
other kernels in calls of fewer than 8 tokens, and flash attention (off by default) takes another path
for long calls. Calls of 8 or more tokens that start at a multiple of 8 give a fresh prefill's
numbers (``scripts/measure/measure_split.py``; docs/evaluation.md, "One-forward scoring").

``exact_calls`` (off by default) makes every row of every call the number feeding one id at a time
gives: weights are used as stored (no repacking) and flash attention is on, which makes calls of at
most ``SMALL`` ids compute each row as a one-id call does, for one sequence or several
(``scripts/measure/measure_batch_invariance.py``); the prompt's whole ``LARGE``-blocks are fed in calls of
whole blocks (one fresh prefill's numbers, whatever the cut) and every other id in calls of at most
``SMALL``. Its KV cache is kept in BF16 (``EXACT_KV_TYPE``): with F16 keys and values llama.cpp's
flash attention splits the cached positions of a one-id call among the threads once there are 512
of them, which sums them in another order than a call of 2+ ids or one thread does (the numbers of
a long sequence would depend on the cut and on the thread count); with BF16 every call takes the
per-row kernel. A sequence's numbers then do not depend on how its ids were cut into calls nor on
the threads: one-forward scoring equals the stepwise path and speculative decoding equals plain
decoding bit for bit. In the shared context (``multi_seq``) each sequence's prompt blocks go in block
calls of its own and every other id of every sequence in shared calls of at most ``SMALL`` ids,
which compute each row as that sequence's one-id call does: a batch gives the one-by-one numbers,
whatever else is in it (``tests/test_exact_calls.py``). (A build with AMX kernels runs every member
with it: ``llamacpp_lib``, which also imports the library and routes its log lines.)
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenfuse.errors import ModelLoadError
from tokenfuse.members.base import LocalMember, SeqState, Shared, common_prefix, cpu_cores, picked
from tokenfuse.members.codec import load_or_build_codec
from tokenfuse.members.embeddings import EmbeddingRows
from tokenfuse.members.llamacpp_cache import (BLOCK, COPY_MIN, LARGE, SMALL, Slot, Stream, prompt_head,
                                               reusable_prefix, reusable_prefix_exact, start_at_a_block)
from tokenfuse.members.llamacpp_lib import LOAD_LOCK, exact_calls_for_build, import_llama_cpp, weights_as_stored
from tokenfuse.members.llamacpp_shared import SharedContext, put_token, resolve_multi_seq
from tokenfuse.members.llamacpp_tree import tree_reader
from tokenfuse.members.side_by_side import SideBySide

# exact_calls' KV cache type, GGML_TYPE_BF16 (llama-cpp-python names no constant for it): keeps a
# one-id call from the thread-split attention path (F16/F32 keys and values, 512+ cached positions).
EXACT_KV_TYPE = 30
class LlamaCppMember(SharedContext, LocalMember):
    """A GGUF model run by llama.cpp: its live sequences in a shared context (``multi_seq``) or a
    context each (the module docstring).

    ``context_length`` is ``n_ctx``: each sequence's context (or stream of the shared one) holds that
    many positions.
    """

    def __init__(self, name: str, gguf_path: str | os.PathLike, tokenizer: Any, *, weight: float = 1.0,
                 n_ctx: int = 4096, n_threads: int | None = None, n_batch: int = 512, multi_seq: int | str = "auto",
                 prefix_cache: bool = True, exact_calls: bool = False, content_hash: str | None = None,
                 align_cache: Path | None = None) -> None:
        llama_cpp = import_llama_cpp()
        from llama_cpp import Llama

        self.name = name
        self.tokenizer = tokenizer
        self.weight = float(weight)
        self.path = str(gguf_path)
        self.weight_bytes = os.path.getsize(self.path)
        self.n_batch = n_batch
        exact_calls = exact_calls_for_build(llama_cpp, exact_calls)  # AMX kernels crash beside another context
        self.exact_calls = exact_calls
        if exact_calls and n_batch < LARGE:
            raise ModelLoadError(f"member {name!r}: exact_calls needs n_batch >= {LARGE}")
        try:
            with LOAD_LOCK, weights_as_stored(llama_cpp, exact_calls):
                self.llm = Llama(self.path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                                 n_threads=n_threads or cpu_cores(), logits_all=False,
                                 swa_full=True, flash_attn=exact_calls, verbose=False,
                                 **({"type_k": EXACT_KV_TYPE, "type_v": EXACT_KV_TYPE} if exact_calls else {}))
        except (ValueError, RuntimeError) as err:
            raise ModelLoadError(f"member {name!r}: llama.cpp cannot load {self.path}: {err}") from err
        self._lib = llama_cpp
        self._model_users = Shared(self.llm.close).take()  # freed with the last member on it (``unload``)
        self.fixed_threads = n_threads  # None: the member pool's share of the cores (``share_cores``)
        self._init_state(prefix_cache=prefix_cache, multi_seq=resolve_multi_seq(multi_seq, exact_calls), n_ctx=n_ctx)
        self._free = [self._new_slot(self.llm._ctx)]  # pooled contexts, least recently used first
        eos = [self.llm.token_eos()]
        eot = self._lib.llama_vocab_eot(self.llm._model.vocab)
        if eot >= 0:
            eos.append(eot)
        self.codec = load_or_build_codec(tokenizer, vocab_size=self.n_vocab, extra_end_ids=eos,
                                         extra_special_ids=self._control_ids(), content_hash=content_hash,
                                         cache=align_cache)

    @classmethod
    def sharing(cls, other: LlamaCppMember, name: str, *, weight: float = 1.0) -> LlamaCppMember:
        """A member on ``other``'s loaded model (a self-ensemble's copy): the weights, tokenizer and
        byte tables are shared, the contexts (and so every KV cache) are its own."""
        m = cls.__new__(cls)
        m.name, m.tokenizer, m.weight, m.path, m.n_batch = name, other.tokenizer, float(weight), other.path, other.n_batch
        m.llm, m._lib, m.codec, m.fixed_threads = other.llm, other._lib, other.codec, other.fixed_threads
        m.weight_bytes, m.exact_calls, m._model_users = other.weight_bytes, other.exact_calls, other._model_users.take()
        m._init_state(prefix_cache=other.prefix_cache, multi_seq=other.multi_seq, n_ctx=other.context_length)
        return m

    def _init_state(self, *, prefix_cache: bool, multi_seq: int, n_ctx: int) -> None:
        self.n_vocab = self.llm.n_vocab()
        self._free: list[Slot] = []  # pooled contexts, least recently used first
        self._busy: list[Slot] = []
        self.prefix_cache = prefix_cache
        self.prefix_stats = {"sequences": 0, "reused": 0, "copied": 0, "fed": 0}
        # multi_seq > 0: up to that many sequences share one context (a sequence id each), and a step
        # decodes all their new tokens in one llama.cpp batch; more get contexts of their own
        # (``_forward_batch``; docs/benchmarks.md, "Batched decoding").
        self.multi_seq = multi_seq
        self._multi: Slot | None = None
        self._streams: list[Stream] = []  # its pooled sequence ids, least recently used first
        self._streams_busy: list[Stream] = []
        self.context_length = n_ctx
        self.threads = self.fixed_threads or cpu_cores()
        self.side_by_side, self.side, self._stats_lock = True, SideBySide(), threading.Lock()
        self.swa_window = self._lib.llama_model_n_swa(self.llm._model.model)  # 0: no sliding window

    def share_cores(self, n: int) -> None:
        """Use ``n`` threads from the next call on, unless ``n_threads`` was set (llama.cpp's numbers do
        not depend on the thread count: tests/test_llamacpp.py checks it bit for bit)."""
        if self.fixed_threads is None:
            self.threads = max(1, int(n))

    def _threads_on(self, slot: Slot, n: int | None = None) -> None:
        """Give ``slot``'s context ``n`` threads (default: the member's current thread count)."""
        n = n or self.threads
        if slot.threads != n:
            self._lib.llama_set_n_threads(slot.ctx.ctx, n, n)
            slot.threads = n

    def _control_ids(self) -> list[int]:
        """Ids the GGUF marks as control / unused / unknown: not text, whatever their spelling."""
        lib, vocab = self._lib, self.llm._model.vocab
        mask = lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_UNUSED | lib.LLAMA_TOKEN_ATTR_UNKNOWN
        return [i for i in range(self.n_vocab) if lib.llama_vocab_get_attr(vocab, i) & mask]

    def _new_slot(self, ctx: Any = None) -> Slot:
        from llama_cpp._internals import LlamaBatch, LlamaContext

        if ctx is None:
            with LOAD_LOCK:
                ctx = LlamaContext(model=self.llm._model, params=self.llm.context_params, verbose=False)
        return Slot(ctx, LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1, verbose=False))

    def reader(self, start: Sequence[int], *, shared: bool = True) -> contextlib.AbstractContextManager:
        """With ``shared``, branches off a trunk in shared calls (``tokenfuse.members.llamacpp_tree``);
        sequence states (``Member.reader``) without it or with ``exact_calls`` (its calls follow the
        exact rules, which branches do not)."""
        if not shared or self.exact_calls:
            return super().reader(start)
        self.check_loaded()
        return tree_reader(self)

    def embedding_rows(self) -> EmbeddingRows:
        """The GGUF's ``token_embd.weight``, memory-mapped (rows dequantised on demand)."""
        return EmbeddingRows(gguf_path=self.path)

    def _forward_batch(self, states: list[SeqState]) -> list[torch.Tensor]:
        if not self.multi_seq:
            return self._forward_own(states)
        placed = self._in_shared(states)
        shared = [st for st, sh in zip(states, placed) if sh]
        own = [st for st, sh in zip(states, placed) if not sh]
        out = dict(zip(map(id, shared), self._forward_multi(shared) if shared else []))
        if own:
            out.update(zip(map(id, own), self._forward_own(own)))
        return [out[id(st)] for st in states]

    def _in_shared(self, states: list[SeqState]) -> list[bool]:
        """Where each state runs: the shared context (``multi_seq``) while it has a sequence id free
        (or the state holds one already), else a context of its own."""
        slots, placed = self._shared_slots_left(), []
        for st in states:
            placed.append(isinstance(st.cache, Stream) or (st.cache is None and slots > 0))
            if placed[-1] and st.cache is None:
                slots -= 1
        return placed

    def _forward_own(self, states: list[SeqState]) -> list[torch.Tensor]:
        """Sequences in contexts of their own: side by side (``tokenfuse.members.side_by_side``)."""
        if not self.side_by_side:
            return super()._forward_batch(states)
        return self.side.run(states, lambda st, n: self._forward(st, threads=n), cores=self.threads,
                             new=lambda st: st.cache is None)

    def _acquire(self, st: SeqState, limit: int, *, shared: bool = False) -> Slot:
        """A context for a new sequence (``shared``: a sequence id of the shared context, which has
        one free); with ``prefix_cache``, the one whose cache shares the longest prefix (of at most
        ``limit`` ids: the first position whose logits are wanted is fed) with the sequence's ids (a
        pooled one as is, or a live one's cache copied). The shared context reuses prefixes with
        ``exact_calls`` only (a KV stream per sequence; without it the sequences share one cache)."""
        free, busy = (self._streams, self._streams_busy) if shared else (self._free, self._busy)
        ids = st.all_ids()
        self.prefix_stats["sequences"] += 1
        slot, reuse = None, 0  # the forward crops the cache to ``reuse`` ids and feeds the rest
        if self.prefix_cache and (self.exact_calls or not shared):
            def reusable(cached: list[int], exact: int) -> int:
                common = common_prefix(cached, ids, limit)
                if self.exact_calls:
                    return reusable_prefix_exact(common, exact, prompt_head(st), limit)
                return reusable_prefix(common, exact, len(ids), limit)

            pooled = [reusable(sl.ids, sl.exact) for sl in free]
            best = int(np.argmax(pooled)) if pooled else -1
            reuse = pooled[best] if pooled else 0
            live = [(reusable(sl.cached_ids(), sl.exact), sl) for sl in busy if shared or self._copyable(sl)]
            donor_n, donor = max(live, key=lambda t: t[0], default=(0, None))
            if donor is not None and donor_n >= reuse + COPY_MIN:
                slot = self._least_recent(free)  # gets a copy of the live one's cache
                copied = slot.copy_from(donor, self._lib)
                reuse = donor_n if copied else 0
                self.prefix_stats["copied"] += copied
            elif reuse > 0:
                slot = free.pop(best)
            self.prefix_stats["reused"] += reuse > 0
        if slot is None:
            slot = self._least_recent(free)
        st.n_valid = reuse
        slot.owner, slot.ids = st, []
        busy.append(slot)
        return slot

    def _copyable(self, slot: Slot) -> bool:
        """Whether a copy of ``slot``'s cache gives a fresh prefill's numbers: not for a model with
        sliding-window layers (Gemma-3) once the cache is longer than the window — the copy then
        holds another set of cells for those layers, and a longer or shorter row of attention scores
        is summed in another order (measured on the bundled Gemma-3 file: up to 1.5 in a log-probability
        past 512 ids; the test in tests/test_llamacpp.py)."""
        return self.swa_window <= 0 or slot.n <= self.swa_window

    def _least_recent(self, free: list[Slot]) -> Slot:
        """The pooled context (or shared sequence id) released longest ago, or a new context."""
        return free.pop(0) if free else self._new_slot()

    def _forward(self, st: SeqState, *, threads: int | None = None) -> torch.Tensor:
        return self._feed(st, [st.length], threads=threads)[0]

    def _forward_at(self, st: SeqState, ends: list[int], *, pick: list[torch.Tensor] | None = None
                    ) -> list[torch.Tensor]:
        """One state's rows where ``_forward_at_many`` does not batch them: in a context of its own
        (``_feed``), or in the shared context without ``exact_calls``."""
        if not self._in_shared([st])[0]:
            return self._feed(st, ends, pick=pick)  # a context of its own (no multi_seq, or all its sequence ids live)
        return super()._forward_at(st, ends, pick=pick)

    def _forward_at_many(self, states: list[SeqState], ends: list[list[int]], *,
                         picks: list[list[torch.Tensor]] | None = None) -> list[list[torch.Tensor]]:
        """With ``exact_calls`` the sequences of the shared context go in its shared calls together
        (``_forward_streams``: each row its one-by-one numbers; the real prompt stays the prompt, so
        the cut rules hold), the others one after another."""
        if not (self.multi_seq and self.exact_calls):
            return super()._forward_at_many(states, ends, picks=picks)
        want = {id(st): {n - 1 for n in e} for st, e, shared in zip(states, ends, self._in_shared(states)) if shared}
        rows = self._forward_streams([st for st in states if id(st) in want], want) if want else {}
        return [[picked(rows[id(st), n - 1], pick, k) for k, n in enumerate(e)] if id(st) in want
                else self._feed(st, e, pick=pick) for st, e, pick in zip(states, ends, picks or [None] * len(states))]

    def _feed(self, st: SeqState, ends: list[int], *, threads: int | None = None,
              pick: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Crop the cache to ``n_valid`` and feed the rest in batches of ``n_batch`` ids (with
        ``threads``, default the member's), asking llama.cpp for the logits of the positions in
        ``ends`` only (with ``pick``, each row's entries taken as soon as it is computed)."""
        slot: Slot = st.cache
        if slot is None:
            slot = st.cache = self._acquire(st, ends[0] - 1)
        head = prompt_head(st) if self.exact_calls else 0
        if self.exact_calls:
            start_at_a_block(st)
        if slot.n > st.n_valid:
            slot.crop(st.n_valid)  # where it cannot cut there: from the start
            st.n_valid = slot.n
        self._threads_on(slot, threads)
        ids = st.all_ids()
        with self._stats_lock:  # sequences may be fed side by side
            self.prefix_stats["fed"] += len(ids) - slot.n
        # positions whose next-token logits are asked for -> the entries kept of each (None: all)
        want = {n - 1: None if pick is None else pick[k] for k, n in enumerate(ends)}
        rows: dict[int, torch.Tensor] = {}
        while slot.n < len(ids):
            start = slot.n
            stop, long = self._call_end(start, len(ids), head)
            b = slot.batch.batch
            for j, tok in enumerate(ids[start:stop]):
                put_token(b, j, tok, start + j, 0)
                b.logits[j] = start + j in want
            b.n_tokens = stop - start
            slot.ctx.decode(slot.batch)
            rows.update((p, self._logprobs(slot.ctx, p - start, want[p])) for p in range(start, stop) if p in want)
            if long and start == slot.exact:
                slot.exact = stop
            slot.n = stop
        st.n_valid = slot.n  # already now, so a sequence acquired later in this batch can copy it
        return [rows[n - 1] for n in ends]

    def _call_end(self, start: int, total: int, head: int) -> tuple[int, bool]:
        """Where the decode call feeding ids from ``start`` (of ``total``) ends, and whether its rows
        are a fresh prefill's (they extend ``Slot.exact``). Default: calls end at multiples of
        ``n_batch``, wherever the feed started (``BLOCK``). ``exact_calls``: the prompt's blocks below
        ``head`` in calls of whole ``LARGE``-blocks, every other id in calls of at most ``SMALL``."""
        if not self.exact_calls:
            stop = min(total, (start // self.n_batch + 1) * self.n_batch)
            return stop, start % BLOCK == 0 and stop - start >= BLOCK
        if start < head:
            return min(head, start + self.n_batch - self.n_batch % LARGE), True
        return min(total, start + SMALL), False

    def _logprobs(self, ctx: Any, i: int, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Log-softmax of the logits llama.cpp kept for batch position ``i`` (``ids``: only those entries)."""
        logits = np.ctypeslib.as_array(ctx.get_logits_ith(i), shape=(self.n_vocab,))
        row = torch.log_softmax(torch.from_numpy(logits), dim=-1)  # a new tensor: llama.cpp's buffer is only read
        return row if ids is None else row[ids]

    def release(self, state: SeqState) -> None:
        if self.unloaded:  # its contexts are freed already
            state.cache = None
        slot = state.cache
        if isinstance(slot, Slot):
            shared = isinstance(slot, Stream)
            keep = min(slot.n, state.n_valid) if self.prefix_cache and (self.exact_calls or not shared) else 0
            if slot.n > keep:
                slot.crop(keep)
            slot.ids, slot.owner = state.all_ids()[: slot.n], None
            (self._streams_busy if shared else self._busy).remove(slot)
            (self._streams if shared else self._free).append(slot)
        super().release(state)

    def _unload(self) -> None:
        """Free its contexts, then the model with the last member on it (a self-ensemble's copies share it)."""
        for slot in self._free + self._busy + ([self._multi] if self._multi is not None else []):
            slot.close()
        self._free, self._busy, self._multi, self._streams, self._streams_busy = [], [], None, [], []
        self.side.close()
        self._model_users.drop()


def load_llamacpp_member(name: str, gguf_path: str | os.PathLike, *, tokenizer_dir: str | os.PathLike | None = None,
                         weight: float = 1.0, n_ctx: int = 4096, n_threads: int | None = None,
                         multi_seq: int | str = "auto", prefix_cache: bool = True, exact_calls: bool = False,
                         align_cache: Path | None = None, tokenizer_cache: Path | None = None) -> LlamaCppMember:
    """Load a GGUF with llama.cpp; its tokenizer comes from ``tokenizer_dir`` (tokenizer.json) or,
    when not given, is built once from the GGUF by transformers and cached in ``tokenizer_cache``."""
    import hashlib

    from tokenfuse.members.fasttok import FastTokenizer

    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"member {name!r}: GGUF file not found: {path}")
    t0 = time.perf_counter()
    if tokenizer_dir is None:
        st = path.stat()
        key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
        tokenizer_dir = (tokenizer_cache or path.parent) / f"tokenizer-{key}"
        if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
            from transformers import AutoTokenizer  # only to build tokenizer.json from the GGUF, once

            AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tokenizer_dir)
    tokenizer = FastTokenizer(tokenizer_dir)
    tj = Path(tokenizer_dir) / "tokenizer.json"
    content_hash = hashlib.sha256(tj.read_bytes()).hexdigest() if tj.is_file() else None
    member = LlamaCppMember(name, path, tokenizer, weight=weight, n_ctx=n_ctx, n_threads=n_threads,
                            multi_seq=multi_seq, prefix_cache=prefix_cache, exact_calls=exact_calls,
                            content_hash=content_hash, align_cache=align_cache)
    member.load_seconds = time.perf_counter() - t0
    return member
