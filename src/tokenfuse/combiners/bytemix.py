"""``byte``: the members' byte-level models (``tokenfuse.alignment.bytemodel``) combined one byte at a time.

A step chooses one byte (or the end), not a member's piece: the combiner ``needs`` each member's
next-byte distribution (257 natural-log probabilities, bytes 0..255 and the end, which the engine's
``bytegen.ByteDecider`` reads from each sequence's byte states) and ``combine`` returns a ``Dist``
over those 257 outcomes, column ``b`` the union entry of the one byte ``b`` and column 256 END. It
combines them (``mix``, ``params.mix``):

- ``mixture`` (the default): ``Σ_m w_m p_m`` with the members' weights normalised over those with a
  positive weight — the exact mixture of the members' byte-level models;
- ``product``: ``Π_m p_m^{w_m}`` (the same normalised weights as exponents: for equal weights the
  geometric mean), renormalised over the 257 outcomes; where no outcome has mass under every member,
  the mixture;

then gives probability 0 to the outcomes the step may not choose (``StepView.allowed``: those that
would not keep the output whole UTF-8 text; and a byte that is no union entry) and renormalises
(all of them impossible: uniform over the allowed). What cannot apply to byte steps is declared in
``lacks``: gating, speculative decoding, the agreement skip and scoring pieces.

Parameters ``keep``, ``width``, ``rule`` and ``smooth``: each member's byte model's pruning
(``tokenfuse.alignment.bytemodel.Pruning``, the names ``tokenfuse score --bytes`` takes as flags). The
rule is ``reserve`` by default here: a member reads a row only where a history holds ``keep`` of its
boundary's mass (0.82 rows per byte for the three bundled members against 3.00 with the top rule;
1.26× GaC's time per byte against 4.03×: docs/methods.md, "The ``byte`` method"), at 0.4–1.8 % more
bits per byte on dev text (docs/benchmarks.md, "Two rules for the pruned mass"). The ``defer`` rule
scores as well as the top rule with a row about once per own token, but its next-symbol distribution
reads the deferred history's row at almost every step, so in generation it reads about as many rows
as the top rule.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenfuse.alignment.bytemodel import RULES, SMOOTH, WIDTH, Pruning
from tokenfuse.alignment.space import VocabSpace
from tokenfuse.alignment.union import END
from tokenfuse.combiners.base import Combiner, Dist, Setup, StepView, register
from tokenfuse.combiners.mixers import Fitted, Mixer
from tokenfuse.errors import ConfigError

RESERVE_KEEP = 1e-2  # the reserve rule's keep, chosen on dev text with it (docs/benchmarks.md, "Two rules for the pruned mass")
_NO_PIECES = "not available with method byte (it chooses bytes, not pieces)"


class ByteParams(BaseModel):
    """``mix``: ``mixture`` or ``product`` (module docstring); ``keep``, ``width``, ``rule``, ``smooth``:
    each member's byte model's pruning (``alignment.bytemodel.Pruning``: a history below ``keep`` times
    the prefix mass, or past the ``width`` most probable at its boundary, is pruned; ``keep = 0`` and
    ``width = None``: exact; ``rule``: where the pruned mass goes, ``reserve`` by default here). The old
    spelling ``reserve: true|false`` is read as ``rule: reserve|top``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    mix: Literal["mixture", "product"] = "mixture"
    keep: float = Field(RESERVE_KEEP, ge=0, lt=1)
    width: int | None = Field(WIDTH, ge=1)
    rule: Literal[RULES] = "reserve"  # type: ignore[valid-type]
    smooth: float = Field(SMOOTH, ge=0, lt=1)

    @model_validator(mode="before")
    @classmethod
    def _old_reserve(cls, data):
        if isinstance(data, dict) and "reserve" in data:
            data = dict(data)
            old = data.pop("reserve")
            if "rule" in data:
                raise ValueError("reserve: the old spelling of rule; give rule alone")
            if not isinstance(old, bool):
                raise ValueError(f"reserve: expected true or false (the old spelling of rule), got {old!r}")
            warnings.warn(f"params.reserve: {str(old).lower()} is now rule: {'reserve' if old else 'top'}",
                          FutureWarning, stacklevel=2)
            data["rule"] = "reserve" if old else "top"
        return data

    @property
    def pruning(self) -> Pruning:
        return Pruning(keep=self.keep, width=self.width, rule=self.rule, smooth=self.smooth)


@register
class ByteMix(Combiner):
    name = "byte"
    Params = ByteParams
    needs = "bytes"
    exact_agreement = False
    lacks = {
        "gate": f"gate: {_NO_PIECES}; drop gate or use method gac",
        "speculative": f"speculative: {_NO_PIECES}; drop speculative or use method gac",
        "agreement_skip": f"agreement_skip: {_NO_PIECES}",
        "scoring": "method: byte generates byte by byte and scores no pieces (loglikelihood, prompt logprobs "
                   "with echo); use method gac for them, or tokenfuse score for bytes",
    }

    def bind(self, setup: Setup) -> None:
        """Each outcome's union entry: byte ``b``'s one-byte entry (``-1`` where no member has it as a
        token: never chosen), END for the end."""
        super().bind(setup)
        self.entries = torch.tensor([_entry(setup.space, b) for b in range(256)] + [END], dtype=torch.int64)
        self.known = (self.entries >= 0).numpy()

    def combine(self, view: StepView) -> Dist:
        """The members' next-symbol distributions (``view.logprobs``: ``float64[R, 257]`` each) mixed
        (``mix``) and restricted to the outcomes allowed (module docstring), ``float64[R, 257]``."""
        rows = []
        for r in range(view.rows):
            q = self.mix([view.logprobs[i][r].numpy() for i in view.computed], view.weights)
            ok = self.known if view.allowed is None else view.allowed[r].numpy() & self.known
            q = np.where(ok, q, 0.0)
            mass = q.sum()
            rows.append(q / mass if mass > 0 else ok / ok.sum())
        return Dist(torch.from_numpy(np.stack(rows)), index=self.entries.expand(len(rows), -1))

    def mix(self, logps: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
        """The combined next-symbol probabilities (``float64[257]``, summing to 1) of the members'
        natural-log distributions ``logps`` with their ``weights`` (those ``≤ 0`` left out): the
        ``combiners.mixers`` mixer ``params.mix``, the one the text scores' rows use."""
        w = np.asarray(weights, dtype=np.float64)
        if not (w > 0).any():
            raise ConfigError("members.weight: at least one member needs a positive weight")
        return Mixer(self.params.mix, Fitted(weights=w), len(w)).combine(logps)


def _entry(space: VocabSpace, b: int) -> int:
    """The union entry of the one byte ``b`` (``-1`` when no member has it as a token)."""
    pieces, one = space.union.pieces, bytes([b])
    at = bisect.bisect_left(pieces, one, 1)  # entries after END are sorted by their bytes
    return at if at < len(pieces) and pieces[at] == one else -1
