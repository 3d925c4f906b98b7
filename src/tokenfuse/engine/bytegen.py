"""The ``byte`` method's steps: every member as a byte-level model, one byte (or the end) chosen per step.

``ByteDecider`` stands in for ``decide.Decider`` when the method's unit is a byte
(``combiners/bytemix.py``). On ``admit`` each sequence gets, for every member with a positive weight,
a ``ByteState`` after the member's prompt ids (``tokenfuse.alignment.bytestate``), reading its rows on
sequence states of its own (``text_features.state_reader``: a member's KV cache per live branch, so the
row after one more token of a branch is one token's forward; on the bundled llama.cpp members this was
measured faster for generation than the backend's tree reader of scoring), released by ``release``.
Each step (``decide``):

1. every such member's 257-way distribution of the next symbol (those that read a row in the member
   threads, timed as ``forward``), mixed by the method (``ByteMix.mix``: mixture or product, normalised weights);
2. masked (timed as ``combine``) to the outcomes that keep the output whole UTF-8 text: a byte that
   cannot continue the output's unfinished character (or start a character) has probability 0, the
   end is impossible inside a character, a lead byte whose character would not fit in the bytes the
   length limit leaves is impossible (so ``max_new_tokens`` counts bytes and the output never ends in
   a cut character), as is a byte that is not a union entry; then renormalised (all of them
   impossible: uniform over the allowed);
3. chosen (``choose``): greedy takes the argmax (ties to the smaller byte; the end is last); sampling
   shapes the distribution as every method's (``sampling.sampled_probs``: temperature, top-k, top-p)
   and takes its inverse CDF at one uniform from the sequence's generator — exactly a draw from it.

The chosen byte is the union entry of that one byte, so the sequence appends, stops (END, stop strings
trimmed, the length limit) and hands out text as for any method (``sequence.OpenSequence``); a traced
step records the masked mixture's probability of the byte, its top entries and each member's own
byte-level probabilities. ``Generation.steps`` counts bytes.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenfuse.alignment.bytestate import END_SYMBOL, ByteState, ByteTable
from tokenfuse.alignment.byteview import TokenBytes
from tokenfuse.alignment.space import VocabSpace
from tokenfuse.alignment.union import END
from tokenfuse.combiners.bytemix import ByteMix
from tokenfuse.engine.pool import MemberPool
from tokenfuse.engine.sampling import Sampling, sampled_probs
from tokenfuse.engine.sequence import Decision, OpenSequence
from tokenfuse.engine.sync import incomplete_tail
from tokenfuse.engine.text_features import state_reader
from tokenfuse.engine.timer import StageTimer
from tokenfuse.engine.trace import MemberStep, StepRecord, TopEntry, end_text
from tokenfuse.members.base import Member

NOTE = "byte"  # the key of a sequence's byte states in ``OpenSequence.notes``
_TABLES: dict[str, ByteTable] = {}  # by tokenizer (``ByteCodec.fingerprint``)


def utf8_allowed(tail: bytes, room: int) -> np.ndarray:
    """``bool[257]``: the next symbols that keep an output ending in ``tail`` (its unfinished character,
    ``b""`` if none) whole UTF-8 text, with ``room`` bytes left (``room ≥ 1``); index 256 is the end."""
    ok = np.zeros(257, dtype=bool)
    if tail:
        lo, hi = 0x80, 0xBF
        if len(tail) == 1:  # the second byte: no overlong form, no surrogate, nothing past U+10FFFF
            lo, hi = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(tail[0], (lo, hi))
        ok[lo:hi + 1] = True
        return ok
    ok[:0x80] = True
    ok[END_SYMBOL] = True
    for first, last, size in ((0xC2, 0xDF, 2), (0xE0, 0xEF, 3), (0xF0, 0xF4, 4)):
        if room >= size:
            ok[first:last + 1] = True
    return ok


def inverse_cdf(p: np.ndarray, u: float) -> int:
    """The index whose cumulative interval of ``p`` (non-negative, not necessarily normalised) holds
    ``u ∈ [0, 1)`` of the total: a draw from ``p`` for a uniform ``u``; never an index of mass 0."""
    c = np.cumsum(p)
    k = int(np.searchsorted(c, u * c[-1], side="right"))
    return k if k < len(p) and p[k] > 0 else int(np.flatnonzero(p)[-1])


def choose(q: np.ndarray, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One symbol from ``q`` (``float64[257]``, normalised): the argmax for greedy decoding, else the
    inverse CDF of the shaped distribution at one uniform from ``generator`` (module docstring)."""
    if sampling.greedy or sampling.temperature < torch.finfo(torch.float64).tiny:
        return int(np.argmax(q))
    p = sampled_probs(torch.from_numpy(q), sampling).numpy()
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    return inverse_cdf(p, u)


@dataclass
class ByteSequence:
    """What one sequence of the ``byte`` method holds: a ``ByteState`` per member computed (by member
    index) and the member readers they read through (closed by ``ByteDecider.release``)."""

    states: dict[int, ByteState]
    readers: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


class ByteDecider:
    """Decides one byte per step for sequences of the ``byte`` method (module docstring); the
    ``Ensemble`` calls it as it calls a ``Decider`` (``admit``, ``decide``, ``release``)."""

    rounds = None  # no drafted rounds

    def __init__(self, members: Sequence[Member], space: VocabSpace, combiner: ByteMix, pool: MemberPool,
                 timer: StageTimer, *, primary: int) -> None:
        self.members = list(members)
        self.space, self.combiner, self.pool, self.timer = space, combiner, pool, timer
        self.primary = primary
        self.computed = [i for i, m in enumerate(self.members) if m.weight > 0]
        self.tables: dict[int, ByteTable] = {}
        self.entries = np.array([_entry(space, b) for b in range(256)], dtype=np.int64)  # -1: not in the union

    def table(self, i: int) -> ByteTable:
        """Member ``i``'s ``ByteTable``, built when a sequence first needs it (once per tokenizer: the
        server's per-request ensembles share it)."""
        if i not in self.tables:
            codec = self.members[i].codec
            if codec.fingerprint not in _TABLES:
                _TABLES[codec.fingerprint] = ByteTable(TokenBytes(codec.token_bytes))
            self.tables[i] = _TABLES[codec.fingerprint]
        return self.tables[i]

    def admit(self, s: OpenSequence) -> None:
        """Give a sequence just opened its byte states, one per member computed, after its prompt ids."""
        p = self.combiner.params
        seq = ByteSequence({})
        try:
            for i in self.computed:
                start = list(s.states[i].prompt_ids)
                take = seq.readers.enter_context(state_reader(self.members[i], start))
                seq.states[i] = ByteState(self.table(i), start, take, keep=p.keep, width=p.width, smooth=p.smooth,
                                         reserve=p.reserve)
        except BaseException:
            seq.readers.close()
            raise
        s.notes[NOTE] = seq

    def release(self, s: OpenSequence) -> None:
        """Free a sequence's byte states and their member readers (safe to call twice)."""
        seq = s.notes.pop(NOTE, None)
        if seq is not None:
            seq.readers.close()

    def decide(self, seqs: list[OpenSequence]) -> list[Decision]:
        return [self._decide(s) for s in seqs]

    def _decide(self, s: OpenSequence) -> Decision:
        states = s.notes[NOTE].states
        with self.timer.stage("forward"):  # the members that read a row now in threads, the others here
            dists = self.pool.run([i for i in states if states[i].pending], lambda i: states[i].next_distribution())
            dists |= {i: states[i].next_distribution() for i in states if i not in dists}
        with self.timer.stage("combine"):
            q = self.combiner.mix([dists[i] for i in states], [self.members[i].weight for i in states])
            last = bytes(s.output[-4:])
            ok = utf8_allowed(last[len(last) - incomplete_tail(last):], s.max_new_tokens - s.steps)
            ok[:256] &= self.entries >= 0
            q = np.where(ok, q, 0.0)
            mass = q.sum()
            q = q / mass if mass > 0 else ok / ok.sum()
        with self.timer.stage("choose"):
            sym = choose(q, s.sampling, s.generator)
        if sym != END_SYMBOL:
            for st in states.values():
                st.advance(sym)
        entry = END if sym == END_SYMBOL else int(self.entries[sym])
        rec = self._record(s, q, dists, sym) if s.trace is not None else None
        return Decision(entry, ensembled=len(states) > 1, trace=rec)

    def _record(self, s: OpenSequence, q: np.ndarray, dists: dict[int, np.ndarray], sym: int) -> StepRecord:
        """A traced step: the masked mixture's probability of ``sym`` and top entries, and each member's own."""
        k, end = s.trace.options.k, end_text(self.members[self.primary])
        members: tuple[MemberStep, ...] = ()
        if s.trace.options.members:
            members = tuple(
                MemberStep(m.name, True, True, float(np.exp(dists[i][sym])), _top(np.exp(dists[i]), k, end))
                if i in dists else MemberStep(m.name, False, False) for i, m in enumerate(self.members))
        return StepRecord(token=_symbol_text(sym, end), end=sym == END_SYMBOL, prob=float(q[sym]), top=_top(q, k, end),
                          gated=False, ensembled=len(dists) > 1, skipped=False, members=members)


def _entry(space: VocabSpace, b: int) -> int:
    """The union entry of the one byte ``b`` (``-1`` when no member has it as a token)."""
    pieces, one = space.union.pieces, bytes([b])
    at = bisect.bisect_left(pieces, one, 1)  # entries after END are sorted by their bytes
    return at if at < len(pieces) and pieces[at] == one else -1


def _symbol_text(sym: int, end: str) -> str:
    return end if sym == END_SYMBOL else bytes([sym]).decode("utf-8", errors="replace")


def _top(p: np.ndarray, k: int, end: str) -> tuple[TopEntry, ...]:
    """The ``k`` most likely of the 257 outcomes (mass 0 left out; ties to the smaller byte)."""
    order = np.argsort(-p, kind="stable")[:k].tolist()
    return tuple(TopEntry(_symbol_text(c, end), bytes([c]).hex() if c != END_SYMBOL else "", float(p[c]),
                          end=c == END_SYMBOL) for c in order if p[c] > 0)
