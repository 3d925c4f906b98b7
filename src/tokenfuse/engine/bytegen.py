"""The ``byte`` method's step decision: every member as a byte-level model, one byte (or the end) per step.

A combiner that ``needs == "bytes"`` (``combiners/bytemix.py``) is decided by ``ByteDecider``, a
``decide.Decider`` whose members' outputs are their next-byte distributions: the same loop
(``Decider.decide``: groups, combination, choice, trace; the ``Ensemble`` steps, stops and streams it
as every method), with these parts of its own:

- ``admit`` gives each sequence just opened, for every member with a positive weight, a ``ByteModel``
  after the member's prompt ids (``tokenfuse.alignment.bytemodel``; built in ``byte_states`` alone),
  reading its rows on sequence states of its own (``Member.reader`` with ``shared=False``: a member's KV
  cache per live branch, so the row after one more token of a branch is one token's forward; on the
  bundled llama.cpp members this was measured faster for generation than the backend's tree reader of
  scoring); ``release`` frees them;
- ``forward``: every such member's 257-way distribution of the next symbol on every row (the members
  that read a row in the member threads, timed as ``forward``), as its ``MemberOutput``;
- ``view`` adds the outcomes allowed (timed as ``combine``): those that keep the output whole UTF-8
  text: a byte that cannot continue the output's unfinished character (or start a character) is not,
  nor the end inside a character, nor a lead byte whose character would not fit in the bytes the
  length limit leaves (so ``max_new_tokens`` counts bytes and the output never ends in a cut
  character); the combiner (``ByteMix.combine``: mixture or product, normalised weights) mixes the
  members over the 257 outcomes, masks the others (and bytes that are no union entry) and renormalises
  (``distribution``: always the combiner's, a member alone too);
- ``choose``: greedy takes the argmax (ties to the smaller byte; the end is last); sampling shapes the
  distribution as every method's (``sampling.sampled_probs``: temperature, top-k, top-p) and takes its
  inverse CDF at one uniform from the sequence's generator — exactly a draw from it; every byte state
  of the sequence then advances by the byte;
- a traced step (``_traced``) records the masked mixture's probability of the byte, its top entries
  and each member's own byte-level probabilities.

The chosen byte is the union entry of that one byte, so the sequence appends, stops (END, stop strings
trimmed, the length limit) and hands out text as for any method (``sequence.OpenSequence``).
``Generation.steps`` counts bytes. What cannot apply to byte steps (gating, speculative decoding, the
agreement skip) the combiner declares (``Combiner.lacks``); its scoring is on bytes (``engine/bytescore.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tokenfuse.alignment.bytemodel import END_SYMBOL, ByteModel
from tokenfuse.alignment.byteview import TokenBytes
from tokenfuse.alignment.space import VocabSpace
from tokenfuse.alignment.union import END
from tokenfuse.combiners.base import Combiner, Dist, StepView
from tokenfuse.combiners.mixers import Mixer
from tokenfuse.engine.decide import Decider
from tokenfuse.engine.flags import StepFlags
from tokenfuse.engine.options import EnsembleOptions
from tokenfuse.engine.pool import MemberOutput, MemberPool
from tokenfuse.engine.sampling import Sampling, sampled_probs
from tokenfuse.engine.sequence import Decision, OpenSequence
from tokenfuse.engine.sync import incomplete_tail
from tokenfuse.engine.timer import StageTimer
from tokenfuse.engine.trace import MemberStep, StepRecord, TopEntry, end_text
from tokenfuse.members.base import Member

NOTE = "byte"  # the key of a sequence's byte states in ``OpenSequence.notes``
_TOKENS: dict[str, TokenBytes] = {}  # by tokenizer (``ByteCodec.fingerprint``)


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
    """What one sequence of the ``byte`` method holds: a ``ByteModel`` per member computed (by member
    index), the member readers they read through (closed by ``ByteDecider.release``), and for a mixer
    with a state (``switch``, ``gate``) that mixer over the members ``mixed`` and their latest
    next-symbol distributions (``last``: what ``update`` reads after the choice)."""

    states: dict[int, ByteModel]
    readers: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    mixer: Mixer | None = None
    mixed: list[int] = field(default_factory=list)
    last: dict[int, np.ndarray] = field(default_factory=dict)


class ByteDecider(Decider):
    """The step decision of a combiner that ``needs`` the members' next-byte distributions: the
    ``Decider``'s loop, its members' outputs and choice those of bytes (module docstring)."""

    def __init__(self, members: Sequence[Member], space: VocabSpace, combiner: Combiner, pool: MemberPool,
                 timer: StageTimer, options: EnsembleOptions, *, primary: int, weights: Sequence[float]) -> None:
        super().__init__(members, space, combiner, pool, timer, options, primary=primary, weights=weights)
        self.tokens: dict[int, TokenBytes] = {}

    def table(self, i: int) -> TokenBytes:
        """Member ``i``'s ``TokenBytes``, built when a sequence first needs it (once per tokenizer: the
        server's per-request ensembles share it)."""
        if i not in self.tokens:
            codec = self.members[i].codec
            if codec.fingerprint not in _TOKENS:
                _TOKENS[codec.fingerprint] = TokenBytes(codec.token_bytes)
            self.tokens[i] = _TOKENS[codec.fingerprint]
        return self.tokens[i]

    def admit(self, s: OpenSequence) -> None:
        """The strategies' ``admit``, then the sequence's byte states (``byte_states``)."""
        super().admit(s)
        s.notes[NOTE] = self.byte_states(s)

    def byte_states(self, s: OpenSequence) -> ByteSequence:
        """A ``ByteModel`` per member computed, after the sequence's prompt ids, each on a reader of its own."""
        p = self.combiner.params
        seq = ByteSequence({})
        try:
            for i in self.computed():
                start = list(s.states[i].prompt_ids)
                take = seq.readers.enter_context(self.members[i].reader(start, shared=False))
                seq.states[i] = ByteModel(self.table(i), start, take, p.pruning)
            seq.mixed = [i for i in self.computed() if self.weights[i] > 0]
            seq.mixer = self.combiner.new_mixer([self.weights[i] for i in seq.mixed])
        except BaseException:
            seq.readers.close()
            raise
        return seq

    def release(self, s: OpenSequence) -> None:
        """Free a sequence's byte states and their member readers (safe to call twice)."""
        super().release(s)
        seq = s.notes.pop(NOTE, None)
        if seq is not None:
            seq.readers.close()

    def forward(self, which: list[int], seqs: list[OpenSequence], *, trace_k: int = 0) -> dict[int, MemberOutput]:
        """Members ``which``'s next-symbol distributions on ``seqs`` (``float64[R, 257]`` each; timed as
        ``forward``): those that read a row now in threads, the others here."""
        if not seqs:
            return {}
        self.prepare(seqs)
        states = [s.notes[NOTE].states for s in seqs]
        with self.timer.stage("forward"):
            dists = self.pool.run([i for i in which if any(st[i].pending for st in states)],
                                  lambda i: [st[i].next_distribution() for st in states])
            dists |= {i: [st[i].next_distribution() for st in states] for i in which if i not in dists}
        for r, s in enumerate(seqs):
            s.notes[NOTE].last = {i: dists[i][r] for i in which}
        return {i: MemberOutput(logprobs=torch.from_numpy(np.stack(dists[i]))) for i in which}

    def view(self, seqs: list[OpenSequence], members: list[int], outs: dict[int, MemberOutput],
             pick: torch.Tensor | None = None) -> StepView:
        """The combiner's view, with each row's outcomes that keep the output whole UTF-8 text (``allowed``)."""
        view = super().view(seqs, members, outs, pick)
        with self.timer.stage("combine"):
            view.allowed = torch.from_numpy(np.stack([_allowed(s) for s in seqs]))
            _mixer_factors(view, [s.notes[NOTE] for s in seqs])
        return view

    def distribution(self, view: StepView, members: list[int]) -> Dist:
        """The combiner's distribution over the 257 outcomes (a member alone is masked too)."""
        with self.timer.stage("combine"):
            return self.combiner.combine(view)

    def choose(self, dist: Dist, rows: list[int], seqs: list[OpenSequence]) -> list[int]:
        """The entry of the symbol chosen in each of ``dist``'s ``rows`` (``choose``, module docstring);
        each sequence's byte states advance by its byte."""
        got = []
        for row, s in zip(rows, seqs):
            sym = choose(dist.probs[row].numpy(), s.sampling, s.generator)
            seq = s.notes[NOTE]
            if sym != END_SYMBOL:
                for st in seq.states.values():
                    st.advance(sym)
                if seq.mixer is not None:
                    seq.mixer.update(np.exp([seq.last[i][sym] for i in seq.mixed]))
            got.append(dist.entry(row, sym))
        return got

    def _traced(self, d: Decision, dist: Dist, j: int, outs: dict[int, MemberOutput], r: int,
                s: OpenSequence) -> Decision:
        """A traced step: the masked mixture's probability of the byte and top entries, and each member's own."""
        sym = END_SYMBOL if d.entry == END else self.space.piece(d.entry)[0]
        q, dists = dist.probs[j].numpy(), {i: o.logprobs[r].numpy() for i, o in outs.items()}
        k, end = s.trace.options.k, end_text(self.members[self.primary])
        members: tuple[MemberStep, ...] = ()
        if s.trace.options.members:
            members = tuple(
                MemberStep(m.name, True, True, float(np.exp(dists[i][sym])), top_entries(np.exp(dists[i]), k, end))
                if i in dists else MemberStep(m.name, False, False) for i, m in enumerate(self.members))
        rec = StepRecord(token=_symbol_text(sym, end), end=sym == END_SYMBOL, prob=float(q[sym]), top=top_entries(q, k, end),
                         flags=StepFlags(ensembled=len(dists) > 1), members=members)
        return replace(d, trace=rec)


def _mixer_factors(view: StepView, seqs: list[ByteSequence]) -> None:
    """A mixer's weights on each row as log factors over the members' own weights (added to those of
    the strategies), so the combiner mixes at the mixer's weights; rows without a mixer: factor 1."""
    rows = [(r, dict(zip(q.mixed, q.mixer.weights()))) for r, q in enumerate(seqs) if q.mixer is not None]
    if not rows:
        return
    for i, w in zip(view.computed, view.weights):
        if w <= 0:
            continue
        f = torch.zeros(view.rows, dtype=torch.float64)
        for r, weights in rows:  # each row's mixer weights computed once per step
            f[r] = math.log(max(float(weights[i]), 1e-300)) - math.log(w)
        view.log_factors[i] = view.log_factors.get(i, 0) + f


def _allowed(s: OpenSequence) -> np.ndarray:
    """``utf8_allowed`` after the sequence's output, with the bytes its length limit leaves."""
    last = bytes(s.output[-4:])
    return utf8_allowed(last[len(last) - incomplete_tail(last):], s.max_new_tokens - s.steps)


def _symbol_text(sym: int, end: str) -> str:
    return end if sym == END_SYMBOL else bytes([sym]).decode("utf-8", errors="replace")


def top_entries(p: np.ndarray, k: int, end: str) -> tuple[TopEntry, ...]:
    """The ``k`` most likely of the 257 outcomes (mass 0 left out; ties to the smaller byte)."""
    order = np.argsort(-p, kind="stable")[:k].tolist()
    return tuple(TopEntry(_symbol_text(c, end), bytes([c]).hex() if c != END_SYMBOL else "", float(p[c]),
                          end=c == END_SYMBOL) for c in order if p[c] > 0)
