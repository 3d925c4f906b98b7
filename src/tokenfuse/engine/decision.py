"""What one step decided for one sequence."""

from __future__ import annotations

from dataclasses import dataclass

from tokenfuse.engine.trace import StepRecord


@dataclass(frozen=True)
class Decision:
    """The chosen union entry of one step and how it was reached.

    Attributes:
        entry: the chosen union entry (``END`` = 0, else a piece of bytes).
        ensembled: more than one member was computed for the step.
        skipped: ensembled, but every computed member ranked ``entry`` first, so alignment and
            combination were skipped (agreement skip).
        gated: thresholded mode: the gate member alone decided (its top probability was above the
            threshold).
        vetoed: a strategy revised the combination's choice (selective ensembling's boundary rule).
        trace: what the step looked like, for a traced sequence only (``None`` otherwise).
    """

    entry: int
    ensembled: bool
    skipped: bool = False
    gated: bool = False
    vetoed: bool = False
    trace: StepRecord | None = None
