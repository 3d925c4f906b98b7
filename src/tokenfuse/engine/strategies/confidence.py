"""Per-step confidence weights: each member's weight times its confidence on that step.

``confidence: top`` is its top probability, ``entropy`` ``exp(-H)`` of its next-token distribution
(top-k methods: of its top-k, renormalised), each to the power ``sharpness`` (``β``); ``none``: off.
Applied as per-row log factors ``β · log c_i`` to the members with a positive weight, where more
than one of them is computed.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from tokenfuse.combiners.base import StepView
from tokenfuse.engine.strategies.base import Strategy, param


class ConfidenceParams(BaseModel):
    """``confidence``: ``none`` (off), ``top`` or ``entropy``; ``sharpness``: the exponent ``β``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    confidence: Literal["none", "top", "entropy"] = "none"
    sharpness: float = Field(1.0, ge=0)


class Confidence(Strategy):
    name = "confidence"
    Params = ConfidenceParams

    @classmethod
    def wanted(cls, options: Any) -> bool:
        return (param(options, ConfidenceParams, "confidence") != "none"
                and param(options, ConfidenceParams, "sharpness") > 0)

    def factors(self, view: StepView, seqs) -> dict[int, torch.Tensor]:
        live = [i for i, w in zip(view.computed, view.weights) if w > 0]
        if len(live) < 2:
            return {}
        p = self.params
        return {i: p.sharpness * log_confidence(view, i, p.confidence) for i in live}


def log_confidence(view: StepView, i: int, kind: str) -> torch.Tensor:
    """Member ``i``'s log-confidence on each row, ``float64[R]``: ``top`` its highest log-probability,
    ``entropy`` minus the entropy of its next-token distribution (top-k: of its top-k, renormalised)."""
    if kind == "top":
        top = view.logprobs[i].max(-1).values if i in view.logprobs else view.topk[i][0][:, 0]
        return top.double()
    lp = view.logprobs[i].double() if i in view.logprobs else view.topk[i][0].double()
    lp = lp - lp.logsumexp(-1, keepdim=True)  # (full distributions already sum to 1)
    return (lp.exp() * lp).nan_to_num().sum(-1)  # -H; 0 * -inf counts 0
