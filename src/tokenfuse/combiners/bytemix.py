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
- ``switch``: the mixture with weights that follow the output: after each byte they become the
  posterior, then a share ``alpha`` goes back to the members' weights (the ``byte-switch`` row);
- ``gate``: the mixture with weights ``softmax(b + A f)``, ``f`` each member's running averages of its
  own log-probabilities of the output's bytes so far (the ``byte-gate`` row; ``b``, ``A`` from a fit);
- ``online``: the gate whose bias also takes a step on the log loss after each byte (the ``byte-online``
  row; its ``rate`` from the fit);

(``combiners.mixers``, the code of the text scores' rows too; for ``switch``, ``gate`` and ``online`` the engine
keeps each sequence's ``Mixer`` and gives its weights as per-row factors, ``StepView.log_factors``).
With ``params.fit``, ``mixture`` mixes at the fit's ``byte-mix`` weights instead of the members'. The
numbers of ``switch`` (``alpha``), ``gate`` and ``online`` come from ``params.fit``, a text-bytes fit file (a
``tokenfuse eval --tasks text-bytes`` run's results.json, or a file of its shape): by default the one
shipped for the bundled three members (``fits/bundled-bytes.json``, built from the shared dev text by
``scripts/results/fit_bytes.py``); ``params.alpha`` sets ``switch``'s share without a fit;

then gives probability 0 to the outcomes the step may not choose (``StepView.allowed``: those that
would not keep the output whole UTF-8 text; and a byte that is no union entry) and renormalises
(all of them impossible: uniform over the allowed). What cannot apply to byte steps is declared in
``lacks``: gating, speculative decoding and the agreement skip. It scores bytes (``loglikelihood``, prompt
logprobs): ``engine/bytescore.py``.

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
import json
import warnings
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenfuse.alignment.bytemodel import RULES, SMOOTH, WIDTH, Pruning
from tokenfuse.alignment.space import VocabSpace
from tokenfuse.alignment.union import END
from tokenfuse.combiners.base import Combiner, Dist, Setup, StepView, register
from tokenfuse.combiners.mixers import MIXERS, RATES, Fitted, Mixer
from tokenfuse.errors import ConfigError

RESERVE_KEEP = 1e-2  # the reserve rule's keep, chosen on dev text with it (docs/benchmarks.md, "Two rules for the pruned mass")
_NO_PIECES = "not available with method byte (it chooses bytes, not pieces)"


class ByteParams(BaseModel):
    """``mix``: ``mixture``, ``product``, ``switch``, ``gate`` or ``online``; ``alpha``: ``switch``'s share (default:
    the fit's); ``fit``: a text-bytes fit file for ``switch`` and ``gate`` (module docstring); ``keep``, ``width``, ``rule``, ``smooth``:
    each member's byte model's pruning (``alignment.bytemodel.Pruning``: a history below ``keep`` times
    the prefix mass, or past the ``width`` most probable at its boundary, is pruned; ``keep = 0`` and
    ``width = None``: exact; ``rule``: where the pruned mass goes, ``reserve`` by default here). The old
    spelling ``reserve: true|false`` is read as ``rule: reserve|top``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    mix: Literal[MIXERS] = "mixture"  # type: ignore[valid-type]
    alpha: float | None = Field(None, ge=0, le=1)
    fit: str | None = None
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
    steps_per_token = 4  # a limit in tokens (eval's per-task limits) stands for about 4 bytes
    lacks = {
        "gate": f"gate: {_NO_PIECES}; drop gate or use method gac",
        "speculative": f"speculative: {_NO_PIECES}; drop speculative or use method gac",
        "agreement_skip": f"agreement_skip: {_NO_PIECES}",
    }

    def bind(self, setup: Setup) -> None:
        """Each outcome's union entry: byte ``b``'s one-byte entry (``-1`` where no member has it as a
        token: never chosen), END for the end."""
        super().bind(setup)
        self.entries = torch.tensor([_entry(setup.space, b) for b in range(256)] + [END], dtype=torch.int64)
        self.known = (self.entries >= 0).numpy()
        self.fitted = self._fitted([m.name for m in setup.members])

    def _fitted(self, names: list[str]) -> Fitted | None:
        """``switch``'s share or ``gate``'s numbers, from ``params`` and the fit file (``None``: no mixer
        with a state)."""
        p = self.params
        if p.mix == "product" or (p.mix == "mixture" and p.fit is None):
            return None  # the ensemble's weights of the members
        if p.mix == "switch" and p.alpha is not None:
            return Fitted(alpha=p.alpha)
        fit = load_fit(p.fit, names)
        row = fit["fitted"].get(self._row)
        if row is None:
            raise ConfigError(f"params.fit: {p.fit or DEFAULT_FIT} has no {self._row} numbers")
        got = Fitted.from_dict(row)
        return Fitted(alpha=got.alpha if p.alpha is None else p.alpha) if p.mix == "switch" else got

    @property
    def _row(self) -> str:
        return f"byte-{'mix' if self.params.mix == 'mixture' else self.params.mix}"

    def new_mixer(self, weights: Sequence[float]) -> Mixer | None:
        """A sequence's mixer of the members with these (positive) weights, for ``switch``, ``gate`` and ``online``,
        and ``mixture`` at a fit's weights (``None`` for ``mixture`` without a fit and ``product``, whose
        weights are the ensemble's)."""
        if self.fitted is None:
            return None
        w = np.asarray(weights, dtype=np.float64)
        if self.params.mix == "mixture":
            if len(self.fitted.weights) != len(w):
                raise ConfigError("params.fit: its byte-mix weights are for every member of the fit; give each a "
                                  "positive weight")
            return Mixer("mixture", self.fitted, len(w))
        if self.params.mix == "switch":
            return Mixer("switch", Fitted(weights=w / w.sum(), alpha=self.fitted.alpha), len(w))
        if len(self.fitted.gate) != len(w) * (1 + len(w) * len(RATES)):
            raise ConfigError(f"params.mix: {self.params.mix} mixes every member of its fit; give each a positive weight")
        return Mixer(self.params.mix, self.fitted, len(w))

    def combine(self, view: StepView) -> Dist:
        """The members' next-symbol distributions (``view.logprobs``: ``float64[R, 257]`` each) mixed
        (``mix``) and restricted to the outcomes allowed (module docstring), ``float64[R, 257]``."""
        rows = []
        live = self.weights(view)  # the members' weights times the per-row factors (a mixer's weights)
        for r in range(view.rows):
            w = [float(x) if isinstance(x, float) else float(x[r]) for _, x in live]
            q = self.mix([view.logprobs[i][r].numpy() for i, _ in live], w)
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
        kind = "product" if self.params.mix == "product" else "mixture"  # switch, gate, online: the mixture at their weights
        return Mixer(kind, Fitted(weights=w), len(w)).combine(logps)


DEFAULT_FIT = "fits/bundled-bytes.json"  # in this package: the bundled members' text fit


def load_fit(path: str | None, names: list[str]) -> dict:
    """A text-bytes fit file (``path``; ``None``: the bundled members' one), checked against the
    members ``names`` (the same, in the same order)."""
    try:
        text = (Path(path).read_text(encoding="utf-8") if path is not None
                else resources.files("tokenfuse.combiners").joinpath(DEFAULT_FIT).read_text(encoding="utf-8"))
        fit = json.loads(text)
    except (OSError, ValueError) as e:
        raise ConfigError(f"params.fit: cannot read {path or DEFAULT_FIT} ({e}); give a text-bytes run's "
                          "results.json") from None
    if not isinstance(fit, dict) or not isinstance(fit.get("fitted"), dict) or "members" not in fit:
        raise ConfigError(f"params.fit: {path or DEFAULT_FIT} is no text-bytes fit (no 'members' and 'fitted'); "
                          "give a text-bytes run's results.json")
    if list(fit["members"]) != list(names):
        where = "the bundled members' fit" if path is None else path
        raise ConfigError(f"params.fit: {where} is for members {', '.join(fit['members'])}; this ensemble is "
                          f"{', '.join(names)}; give params.fit for these members (a tokenfuse eval --tasks "
                          "text-bytes run's results.json), or params.alpha for switch")
    return fit


def _entry(space: VocabSpace, b: int) -> int:
    """The union entry of the one byte ``b`` (``-1`` when no member has it as a token)."""
    pieces, one = space.union.pieces, bytes([b])
    at = bisect.bisect_left(pieces, one, 1)  # entries after END are sorted by their bytes
    return at if at < len(pieces) and pieces[at] == one else -1
