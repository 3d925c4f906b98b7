"""``byte``: the members' byte-level models (``tokenfuse.alignment.bytestate``) combined one byte at a time.

Not a token-level combiner: a step chooses one byte (or the end), so the engine generates this method
byte by byte (``tokenfuse.engine.bytegen``; ``unit = "byte"``) and never calls ``combine``. This class
declares the method and its parameters (checked like every method's: ``params.<key>: ...``) and
owns the combination, ``mix``, of the members' 257-way next-symbol distributions:

- ``mixture`` (the default): ``Σ_m w_m p_m`` with the members' weights normalised over those with a
  positive weight — the exact mixture of the members' byte-level models;
- ``product``: ``Π_m p_m^{w_m}`` (the same normalised weights as exponents: for equal weights the
  geometric mean), renormalised over the 257 outcomes; where no outcome has mass under every member,
  the mixture.

Parameters ``keep``, ``width``, ``smooth`` and ``reserve``: each member's byte view's pruning, smoothing
and rule for the pruned mass (``tokenfuse.alignment.byteview``). ``reserve`` is on by default here: a
member reads a row only where a history holds ``keep`` of its boundary's mass (0.82 rows per byte for
the three bundled members against 3.00 with the top rule, the text-bytes evaluation's; 1.26× GaC's time
per byte against 4.03×: docs/methods.md, "The ``byte`` method"), at 0.4–1.8 % more bits per byte of the
views on dev text (docs/benchmarks.md, "Two rules for the pruned mass").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from tokenfuse.alignment.byteview import KEEP, SMOOTH, WIDTH
from tokenfuse.combiners.base import Combiner, Dist, StepView, register
from tokenfuse.errors import ConfigError


class ByteParams(BaseModel):
    """``mix``: ``mixture`` or ``product`` (module docstring); ``keep``, ``width``, ``smooth``: the byte
    views' pruning (a history below ``keep`` times its boundary's mass, or past the ``width`` most
    probable there, is dropped; ``keep = 0`` and ``width = None``: exact) and smoothing; ``reserve``:
    the dropped mass kept as a uniform reserve (``true``, the default) or left out with a boundary's
    most probable history always kept (``false``, the top rule)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    mix: Literal["mixture", "product"] = "mixture"
    keep: float = Field(KEEP, ge=0, lt=1)
    width: int | None = Field(WIDTH, ge=1)
    smooth: float = Field(SMOOTH, ge=0, lt=1)
    reserve: bool = True


@register
class ByteMix(Combiner):
    name = "byte"
    Params = ByteParams
    unit = "byte"
    exact_agreement = False

    def combine(self, view: StepView) -> Dist:
        raise ConfigError("method: byte chooses bytes, not pieces: it has no token-level distribution "
                          "(it generates through tokenfuse.engine.bytegen; use method gac for pieces)")

    def mix(self, logps: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
        """The combined next-symbol probabilities (``float64[257]``, summing to 1) of the members'
        natural-log distributions ``logps`` with their ``weights`` (those ``≤ 0`` left out)."""
        live = [(lp, w) for lp, w in zip(logps, weights) if w > 0]
        if not live:
            raise ConfigError("members.weight: at least one member needs a positive weight")
        total = sum(w for _, w in live)
        if self.params.mix == "product":
            logq = sum(w / total * lp for lp, w in live)
            top = float(np.max(logq))
            if np.isfinite(top):
                q = np.exp(logq - top)
                return q / q.sum()
        q = sum(w / total * np.exp(lp) for lp, w in live)
        mass = float(q.sum())
        return q / mass if mass > 0 else np.full(257, 1 / 257)  # (unsmoothed members past a prefix of mass 0)
