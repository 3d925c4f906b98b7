"""One running sequence: its members' states, its output bytes, its stops and how it finished.

The output is the one truth: a step appends a chosen piece of bytes (``apply``), checks END, the
stop strings and the length limit, and re-synchronises every member's ids on the new output.
``take_text`` is the one place output becomes text for a reader: never a split UTF-8 character,
never part of a stop string that may still complete. A traced sequence (``trace``) hands its text
out as trace steps instead (``take_steps``), under the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch

from tokenfuse.alignment.space import VocabSpace
from tokenfuse.alignment.union import END
from tokenfuse.engine.flags import Flagged, StepCounts, StepFlags
from tokenfuse.engine.sampling import Sampling
from tokenfuse.engine.sync import append_token, in_step, incomplete_tail, resync
from tokenfuse.engine.trace import StepRecord, Trace, TraceStep
from tokenfuse.members.base import SeqState, StateSnapshot


@dataclass(frozen=True)
class Decision(Flagged):
    """The chosen union entry of one step and how it was reached.

    Attributes:
        entry: the chosen union entry (``END`` = 0, else a piece of bytes).
        flags: how it was decided (``StepFlags``: ensembled, agreement skip, gated, vetoed; also read
            as ``d.ensembled``, ...); none set: a member alone, e.g. a drafted piece taken as it is.
        trace: what the step looked like, for a traced sequence only (``None`` otherwise).
    """

    entry: int
    flags: StepFlags = field(default_factory=StepFlags)
    trace: StepRecord | None = None


@dataclass(frozen=True)
class StepEvent(Flagged):
    """What one step did to one sequence: ``piece`` was appended (empty for END), decided as ``flags``
    (the decision's ``StepFlags``; ``ev.ensembled``, ``ev.skipped``, ``ev.gated``, ... read them)."""

    index: int
    piece: bytes
    flags: StepFlags
    finished: str | None  # None while running, else "end" | "stop" | "length"


@dataclass(frozen=True)
class Generation:
    """The result for one prompt.

    Attributes:
        text: the output decoded as UTF-8 (invalid bytes, if a model produced any, replaced).
        output: the exact output bytes.
        steps: chosen pieces (END not counted).
        finish_reason: ``end`` (END chosen), ``stop`` (a stop string, trimmed) or ``length``.
        member_ids: each member's output ids at the end (they decode to ``output``).
        timings: seconds per stage for the whole call (shared by a batch).
        counts: the steps counted by how they were decided, and the speculative rounds' pieces
            (``StepCounts``), also read one by one:
        ensembled_steps: steps where more than one member was computed (not the gate alone; with
            ``params.safe``: the positions SAFE triggered, the ensemble deciding them).
        skipped_steps: ensembled steps decided by agreement skip (every computed member's most
            likely piece was the same).
        vetoed_steps: ensembled steps where selective ensembling's boundary rule took the primary's
            piece instead of the combination's (``params.select``).
        drafted, accepted: speculative decoding (``tokenfuse.engine.speculative``): pieces the
            drafter proposed and how many of them the ensemble chose (0 and 0 without it).
        trace: with ``trace=True``, every step (``tokenfuse.engine.trace``); their texts
            concatenate to ``text``. ``None`` otherwise.
    """

    text: str
    output: bytes
    steps: int
    finish_reason: str
    member_ids: dict[str, list[int]]
    timings: dict[str, float] = field(default_factory=dict)
    counts: StepCounts = field(default_factory=StepCounts)
    trace: tuple[TraceStep, ...] | None = None
    ensembled_steps = property(attrgetter("counts.ensembled"))
    skipped_steps = property(attrgetter("counts.skipped"))
    vetoed_steps = property(attrgetter("counts.vetoed"))
    drafted = property(attrgetter("counts.drafted"))
    accepted = property(attrgetter("counts.accepted"))


@dataclass(frozen=True)
class SequenceSnapshot:
    """An ``OpenSequence`` at one moment (``OpenSequence.snapshot``): its output length, steps and member states."""

    output_len: int
    steps: int
    states: tuple[StateSnapshot, ...]


@dataclass(eq=False)
class OpenSequence:
    """One sequence, open from ``Ensemble.open`` until ``Ensemble.close``: every member's state, the
    options and the output so far. (Not ``Sequence``: that name is ``collections.abc``'s.)

    Attributes:
        index: the caller's index for it (echoed in ``StepEvent.index``).
        states: per member (ensemble order) its ``SeqState``.
        space: the ensemble's vocabulary space (pieces, codecs, member ids).
        window: re-sync look-behind, in member tokens.
        sampling, stops, max_new_tokens: its decoding options (stops as UTF-8 bytes).
        generator: its own seeded random generator (``None`` for greedy decoding).
        output: the output bytes so far; ``steps`` chosen pieces.
        counts: its steps counted by how they were decided (``StepCounts``: ensembled, agreement
            skip, vetoed by a strategy) and speculative decoding's pieces drafted and accepted
            (``record_round``); ``result`` hands them on.
        finished: ``None`` while running, else ``end``, ``stop``, ``length`` or ``cancelled``.
        trace: the step trace of a traced sequence (``None``: not traced, nothing recorded).
        notes: what the step decision keeps per sequence: its strategies' by strategy name (e.g. PackLLM's
            prompt scores, ``tokenfuse.engine.strategies.prompt``), the ``byte`` method's byte states
            (``tokenfuse.engine.bytegen.NOTE``).
        draft_k: the number of pieces speculative decoding's next round drafts (0: the configured
            ``k``); ``record_round`` updates it.

    ``ensembled``, ``skipped``, ``vetoed``, ``drafted`` and ``accepted`` read ``counts`` (the sequence's
    attributes of those names before they were one value, kept for readers).
    """

    index: int
    states: list[SeqState]
    space: VocabSpace
    window: int
    sampling: Sampling
    stops: list[bytes]
    max_new_tokens: int
    generator: torch.Generator | None
    output: bytearray = field(default_factory=bytearray)
    steps: int = 0
    counts: StepCounts = field(default_factory=StepCounts)
    finished: str | None = None
    trace: Trace | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    draft_k: int = 0
    _emitted: int = 0
    ensembled = property(attrgetter("counts.ensembled"))
    skipped = property(attrgetter("counts.skipped"))
    vetoed = property(attrgetter("counts.vetoed"))
    drafted = property(attrgetter("counts.drafted"))
    accepted = property(attrgetter("counts.accepted"))

    # ------------------------------------------------------------------ a step
    def apply(self, d: Decision) -> StepEvent:
        """Append ``d``'s piece (or finish on END), check stops and the limit, re-sync the members."""
        before = len(self.output)
        piece = self.space.piece(d.entry) if d.entry != END else b""
        self.counts = self.counts.step(d.flags, piece=d.entry != END)
        if self.trace is not None and d.trace is not None:
            self.trace.add(d.trace, before, before + len(piece))
        if d.entry == END:
            self.finished = "end"
        else:
            self.output += piece
            self.steps += 1
            if (cut := find_stop(self.output, self.stops, before)) is not None:
                del self.output[cut:]
                self.finished = "stop"
                if self.trace is not None:
                    self.trace.cut(cut)
            elif self.steps >= self.max_new_tokens:
                self.finished = "length"
        if self.finished in (None, "length"):
            self._resync(d.entry, before)
        elif self.finished == "stop":
            self._resync_trimmed()
        out_piece = piece if self.finished != "stop" else bytes(self.output[before:])
        return StepEvent(self.index, out_piece, d.flags, self.finished)

    def force(self, entry: int) -> None:
        """Append a *given* piece (teacher forcing) and re-sync; no stop or limit applies."""
        before = len(self.output)
        self.output += self.space.piece(entry)
        self.steps += 1
        self._resync(entry, before)

    def record_round(self, drafted: int, accepted: int, next_k: int | None) -> None:
        """A speculative round's counts: pieces drafted and accepted, and what the next round drafts
        (``None``: unchanged)."""
        self.counts = self.counts.round(drafted, accepted)
        if next_k is not None:
            self.draft_k = next_k

    def finish(self, reason: str) -> None:
        """End the sequence now (e.g. ``length`` when a member's context is full)."""
        if self.finished is None:
            self.finished = reason

    def snapshot(self) -> SequenceSnapshot:
        """Its output length, steps and every member's ids, for ``restore`` (a speculative round's draft)."""
        return SequenceSnapshot(len(self.output), self.steps, tuple(st.snapshot() for st in self.states))

    def restore(self, snap: SequenceSnapshot) -> None:
        """Back to ``snap`` after ``force`` appended pieces: the output cut back, every member's ids as they
        were (their caches' validity unchanged: ``SeqState.reuse_cache``)."""
        del self.output[snap.output_len:]
        self.steps = snap.steps
        for st, saved in zip(self.states, snap.states):
            st.restore(saved)

    # ------------------------------------------------------------------ text out
    def take_text(self) -> str:
        """The output text that became final since the last call ("" if none): everything once the
        sequence has finished, else up to the last complete character that no stop string may still
        claim."""
        out = bytes(self.output)
        end = len(out) if self.finished else safe_end(out, self.stops)
        if end <= self._emitted:
            return ""
        text = out[self._emitted:end].decode("utf-8", errors="replace")
        self._emitted = end
        return text

    def take_steps(self) -> list[TraceStep]:
        """A traced sequence's steps whose bytes became final since the last call, each with its
        text (the same rules as ``take_text``; their texts are the text it would have given)."""
        out = bytes(self.output)
        steps = self.trace.release(out, None if self.finished else stop_safe_end(out, self.stops))
        self._emitted = sum(len(s.raw) for s in self.trace.steps)
        return steps

    def result(self, timings: dict[str, float] | None = None) -> Generation:
        out = bytes(self.output)
        if self.trace is not None:
            self.trace.release(out, None)
        return Generation(
            text=out.decode("utf-8", errors="replace"),
            output=out,
            steps=self.steps,
            finish_reason=self.finished or "length",
            member_ids={name: list(st.ids) for name, st in zip(self.space.names, self.states)},
            timings=timings or {},
            counts=self.counts,
            trace=tuple(self.trace.steps) if self.trace is not None else None,
        )

    # ------------------------------------------------------------------ members
    def _resync(self, entry: int, before: int) -> None:
        out = bytes(self.output)
        n = len(out) - before
        for i, (codec, st) in enumerate(zip(self.space.codecs, self.states)):
            tid = self.space.member_id(i, entry)
            if tid >= 0 and in_step(st, before):
                append_token(st, tid, n)  # the member has this exact piece as one token
            else:
                resync(codec, st, out, window=self.window)

    def _resync_trimmed(self) -> None:
        """After a stop string was cut off (possibly reaching into earlier pieces), make every
        member's ids decode to the trimmed output again, so ``member_ids`` keeps its contract."""
        out = bytes(self.output)
        for codec, st in zip(self.space.codecs, self.states):
            rollback(st, len(out))
            resync(codec, st, out, window=self.window)


def find_stop(output: bytearray, stops: list[bytes], before: int) -> int | None:
    """Start of the earliest stop string that the last piece completed, or ``None``."""
    best = None
    for st in stops:
        pos = output.find(st, max(0, before - len(st) + 1))
        if pos >= 0 and (best is None or pos < best):
            best = pos
    return best


def rollback(st: SeqState, n: int) -> None:
    """Drop a member's ids that reach past output byte ``n`` (the output was trimmed to ``n``)."""
    ends = st.starts[1:] + [st.covered]
    keep = sum(1 for e in ends[: len(st.ids)] if e <= n)  # token ends never decrease
    if keep == len(st.ids) and st.covered <= n:
        return
    st.ids = st.ids[:keep]
    st.starts = st.starts[:keep]
    st.covered = ends[keep - 1] if keep else 0
    st.provisional = False
    st.drop_cache_after(len(st.prompt_ids) + keep)
    st.logprobs = None


def stop_safe_end(out: bytes, stops: list[bytes]) -> int:
    """How much of ``out`` no stop string can claim any more (a partial stop string at the end may)."""
    end = len(out)
    for st in stops:
        for n in range(min(len(st) - 1, len(out)), 0, -1):
            if out.endswith(st[:n]):
                end = min(end, len(out) - n)
                break
    return end


def safe_end(out: bytes, stops: list[bytes]) -> int:
    """How much of ``out`` can be shown now: no unfinished character, no partial stop string."""
    end = stop_safe_end(out, stops)
    return end - incomplete_tail(out[:end])
