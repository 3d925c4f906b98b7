"""GaC — Generation as Classification (Yu et al. 2024, arXiv 2406.12585), §3.2–3.4.

Rule: map every member's next-token distribution into the union vocabulary (Eq. 1, 3) and take
the weighted average ``q = Σ w_i p_i M_i / Σ w_i`` (§4.3's weighted form; uniform weights give
Eq. 3). Thresholded mode (Eq. 5) is not a separate combiner: the engine runs only the gate
member when its top probability exceeds ``t`` and combines whoever ran.

Adaptive (``adaptive = True``; the step decision's strategies, ``tokenfuse.engine.strategies``):
``confidence`` scales each member's weight per step by its confidence; ``prompt_weights`` per prompt
by its likelihood of the prompt (PackLLM-sim); ``boundary`` revises a thresholded step's choice at a
split word (``tokenfuse.engine.strategies.gate``). The average stays ``Σ w_i p_i / Σ w_i``, with per-row
``w``.

Deviations from the paper: the union is over exact bytes, not token strings; each member's
distribution is renormalised over its text + END tokens (special-token mass is dropped) before
averaging; all end-of-sequence / end-of-turn tokens share one END entry.
"""

from __future__ import annotations

from tokenfuse.combiners.base import Combiner, Dist, StepView, register, sparse_average, weighted_average


@register
class GaC(Combiner):
    name = "gac"
    adaptive = True

    def combine(self, view: StepView) -> Dist:
        live = self.weights(view)
        if view.argmax_only and (few := sparse_average(view, live)) is not None:
            return few  # the few candidate entries that hold each row's argmax
        return Dist(weighted_average([view.project(i) for i, _ in live], [w for _, w in live]))
