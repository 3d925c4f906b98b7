"""Combiner base class and registry: one small file per method, registered by name.

A combiner sees one step through a ``StepView``: which members were computed for which rows
(sequences), their outputs (full log-probabilities, or only top-k for top-k combiners) and the
ensemble's alignment tables. It returns a ``Dist``: probabilities over union entries, either dense
(every union entry) or over a few candidate entries per row. The engine chooses from it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from difflib import get_close_matches
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from tokenfuse.errors import ConfigError

if TYPE_CHECKING:
    from tokenfuse.engine.generate import Ensemble
    from tokenfuse.members.base import SeqState


@dataclass
class Dist:
    """A combined next-piece distribution for ``R`` rows.

    ``probs`` is ``float32[R, C]``. ``index`` is ``int64[R, C]``: the union entry of each column, or
    ``None`` when the columns are the union itself (``C == len(union)``). Padding columns have
    probability 0.
    """

    probs: torch.Tensor
    index: torch.Tensor | None = None

    def entry(self, row: int, col: int) -> int:
        return col if self.index is None else int(self.index[row, col])


@dataclass
class StepView:
    """One step as a combiner sees it.

    Attributes:
        ens: the ensemble (``union``, ``projector``, ``members`` with their codecs).
        states: per computed member, its ``SeqState`` of every row.
        members: the computed members (indices into ``ens.members``), in ensemble order.
        weights: their raw weights.
        logprobs: full ``float32[R, V_i]`` log-probabilities per member (``needs == "full"``).
        topk: ``(logprobs float32[R, k], ids int64[R, k])`` per member (``needs == "topk"``).
    """

    ens: Ensemble
    states: dict[int, list[SeqState]]
    members: list[int]
    weights: list[float]
    logprobs: dict[int, torch.Tensor] = field(default_factory=dict)
    topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return len(next(iter(self.states.values())))

    def project(self, i: int) -> torch.Tensor:
        """Member ``i``'s distribution mapped into the union (``float32[R, U]``), timed as alignment."""
        return self.ens.project(i, self.logprobs[i])

    def live_weights(self) -> list[tuple[int, float]]:
        """The computed members with a positive weight and their normalised weights."""
        live = [(i, w) for i, w in zip(self.members, self.weights) if w > 0]
        total = sum(w for _, w in live)
        return [(i, w / total) for i, w in live]

    def token_logprobs(self, i: int, ids: torch.Tensor) -> torch.Tensor:
        """Member ``i``'s log-probabilities of named ids ``int64[R, n]`` (the member contract)."""
        return self.ens.members[i].token_logprobs(self.states[i], ids)


class Combiner(ABC):
    """Turns the computed members' outputs into one distribution over union entries.

    Class attributes:
        needs: ``"full"`` (every member's whole distribution) or ``"topk"`` (only ``self.k`` most
            likely tokens per member plus log-probabilities of named ids: members that expose only
            top-k log-probabilities, such as remote servers, can take part).
        exact_agreement: with greedy decoding, when every computed member's most likely union
            entry is the same, the combined distribution's argmax is that entry, so the engine may
            skip alignment and combination for the step (agreement skip) without changing output.
    """

    name: ClassVar[str]
    needs: ClassVar[str] = "full"
    exact_agreement: ClassVar[bool] = True
    k: int = 0

    def bind(self, ens: Ensemble) -> None:  # noqa: B027 - optional hook
        """Called once by the ensemble that uses the combiner (precompute tables here)."""

    def prepare(self, *, progress: bool = True) -> float:
        """Build or load what the combiner needs before the first step; returns seconds."""
        return 0.0

    @abstractmethod
    def combine(self, view: StepView) -> Dist:
        """The combined distribution for every row of ``view``."""

    def piece_probs(self, view: StepView, entries: Sequence[int]) -> torch.Tensor:
        """Probability of a *given* union entry per row (teacher forcing, likelihood scoring).

        Default, for full-distribution combiners: the weighted average of each member's aligned
        probability of the entry (its own mass on those bytes, or on the first sub-token of them
        when it has no such token, as in UniTE), each member normalised over its text + END ids.
        """
        ens = view.ens
        out = torch.zeros(view.rows, dtype=torch.float64)
        for i, w in view.live_weights():
            lp = view.logprobs[i]
            text = ens.projector.maps[i][: lp.shape[-1]] >= 0
            norm = torch.where(text, lp, torch.full_like(lp, float("-inf"))).logsumexp(-1)
            for r, e in enumerate(entries):
                ids = ens.aligner.query_ids(i, e)
                if ids:
                    out[r] += w * float((lp[r, ids] - norm[r]).exp().sum())
        return out

    def describe(self) -> dict[str, Any]:
        return {"method": self.name}


def weighted_average(probs: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``Σ w_i p_i / Σ w_i`` over members with positive weight (``p_i`` already normalised)."""
    total = float(sum(w for w in weights if w > 0))
    if total <= 0:
        raise ValueError("at least one computed member needs a positive weight")
    live = [(p, w) for p, w in zip(probs, weights) if w > 0]
    if len(live) == 1:
        return live[0][0]
    out = torch.zeros_like(live[0][0])
    for p, w in live:
        out.add_(p, alpha=w / total)
    return out


REGISTRY: dict[str, type[Combiner]] = {}


def register(cls: type[Combiner]) -> type[Combiner]:
    REGISTRY[cls.name] = cls
    return cls


def get_combiner(name: str, **params) -> Combiner:
    if name not in REGISTRY:
        hint = get_close_matches(name, REGISTRY, n=1)
        raise ConfigError(
            f"method: unknown combiner {name!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
            + f" (available: {', '.join(sorted(REGISTRY))})"
        )
    try:
        return REGISTRY[name](**params)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"params: {name}: {err}") from None
