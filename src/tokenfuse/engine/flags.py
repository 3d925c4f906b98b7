"""How a step was decided (``StepFlags``) and a sequence's steps counted by it (``StepCounts``).

One value each, carried whole: a step's ``Decision``, its ``StepEvent`` and its trace record
(``StepRecord``, ``TraceStep``) hold one ``StepFlags`` (``Flagged`` lets a reader ask them
``x.gated`` for ``x.flags.gated``); an ``OpenSequence`` and its ``Generation`` hold one ``StepCounts``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter


@dataclass(frozen=True)
class StepFlags:
    """How one step was decided.

    Attributes:
        ensembled: more than one member was computed for the step (in SAFE's drafted rounds: the
            strategy triggered the ensemble's decision here).
        skipped: ensembled, but every computed member ranked the chosen entry first, so alignment
            and combination were skipped (agreement skip).
        gated: thresholded mode: the gate member alone decided (its top probability was above the
            threshold).
        vetoed: a strategy revised the combination's choice (selective ensembling's boundary rule
            took the primary's piece).
        speculative: the piece was taken as drafted by speculative decoding (traced sequences are
            decoded plainly: always false so far).
    """

    ensembled: bool = False
    skipped: bool = False
    gated: bool = False
    vetoed: bool = False
    speculative: bool = False


class Flagged:
    """A value that carries a step's ``flags``, read directly: ``x.gated`` is ``x.flags.gated``."""

    flags: StepFlags
    ensembled = property(attrgetter("flags.ensembled"))
    skipped = property(attrgetter("flags.skipped"))
    gated = property(attrgetter("flags.gated"))
    vetoed = property(attrgetter("flags.vetoed"))
    speculative = property(attrgetter("flags.speculative"))


@dataclass(frozen=True)
class StepCounts:
    """A sequence's steps counted by how they were decided (``StepFlags``), and its speculative rounds.

    Attributes:
        ensembled: chosen pieces (END not counted) whose step was ensembled.
        skipped: chosen pieces decided by agreement skip.
        vetoed: steps (END included) whose choice a strategy revised.
        drafted, accepted: speculative decoding (``tokenfuse.engine.speculative``): pieces the drafter
            proposed and how many of them the ensemble chose.
    """

    ensembled: int = 0
    skipped: int = 0
    vetoed: int = 0
    drafted: int = 0
    accepted: int = 0

    def step(self, flags: StepFlags, *, piece: bool) -> StepCounts:
        """The counts after one more step decided as ``flags``; ``piece``: it chose a piece (not END,
        which ``ensembled`` and ``skipped`` leave out, like ``OpenSequence.steps``)."""
        return replace(self, ensembled=self.ensembled + (piece and flags.ensembled),
                       skipped=self.skipped + (piece and flags.skipped), vetoed=self.vetoed + flags.vetoed)

    def round(self, drafted: int, accepted: int) -> StepCounts:
        """The counts after a speculative round that drafted ``drafted`` pieces and accepted ``accepted``."""
        return replace(self, drafted=self.drafted + drafted, accepted=self.accepted + accepted)
