"""GaC — Generation as Classification (Yu et al. 2024, arXiv 2406.12585), §3.2–3.4.

Rule: map every member's next-token distribution into the union vocabulary (Eq. 1, 3) and take
the weighted average ``q = Σ w_i p_i M_i / Σ w_i`` (§4.3's weighted form; uniform weights give
Eq. 3). Thresholded mode (Eq. 5) is not a separate combiner: the engine runs only the gate
member when its top probability exceeds ``t`` and combines whoever ran.

Deviations from the paper: the union is over exact bytes, not token strings; each member's
distribution is renormalised over its text + END tokens (special-token mass is dropped) before
averaging; all end-of-sequence / end-of-turn tokens share one END entry.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenfuse.combiners.base import Combiner, register


@register
class GaC(Combiner):
    name = "gac"

    def combine(self, probs: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        total = float(sum(weights))
        if total <= 0:
            raise ValueError("at least one computed member needs a positive weight")
        if len(probs) == 1:  # one member: its own (already normalised) distribution
            return probs[0]
        out = torch.zeros_like(probs[0])
        for p, w in zip(probs, weights):
            if w > 0:
                out.add_(p, alpha=w / total)
        return out
