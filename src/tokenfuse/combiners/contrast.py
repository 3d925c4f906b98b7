"""Contrastive decoding across tokenizers (``method: contrast``).

Li et al. 2023, "Contrastive Decoding: Open-ended Text Generation as Optimization" (ACL 2023,
arXiv 2210.15097); O'Brien & Lewis 2023, "Contrastive Decoding Improves Reasoning in Large Language
Models" (arXiv 2309.09117).

Rule, per step and sequence, on the union's exact byte strings::

    score(x) = log p_E(x) − β · Σ_i w_i · log p_i(x)   for x in  V_head = {x : p_E(x) ≥ α · max_y p_E(y)}

and every other entry is excluded. The step's distribution is ``softmax(score)`` over ``V_head``:
greedy takes the highest score, sampling draws from it (through the sampling options, as for every
method), and the trace, logprobs and likelihood scoring report it.

- The expert ``E`` is the primary member (``primary``); it must have a positive weight, so it runs
  at every step (``bind`` raises a ``ConfigError`` otherwise). Its own weight plays no other part.
- ``p_E(x)``: the expert's probability of ``x``'s exact bytes, its projection into the union as in
  GaC (renormalised over its text + END ids, ids spelling the same bytes summed, entries some
  member cannot hold zeroed). ``V_head`` therefore holds only entries the expert has as one token.
- The amateurs ``i`` are the other computed members; ``w_i`` their configured weights normalised
  over the amateurs (a member with weight 0 is not computed and has no term).
- ``p_i(x)``: amateur ``i``'s probability of ``x`` by the aligner's rule, as UniTE and
  ``Combiner.piece_probs`` read it: its own mass on ``x``'s bytes when it holds them as one token
  (summed over its ids for them), else its mass on the first sub-token of ``x``'s bytes in its own
  mid-stream tokenization; renormalised over its text + END ids. Floored at ``1e-30``, so every
  entry of ``V_head`` has a finite score: a probability of exactly 0 (a masked logit) or an entry
  the amateur cannot align at all (not expected for an entry every member can hold) counts as
  ``1e-30``.

Parameters: ``alpha`` (default 0.1, in (0, 1]) the plausibility cut; ``beta`` (default 0.5, ≥ 0)
the amateurs' strength.

Deviations from the papers: the candidates are exact byte strings, not one shared vocabulary's
tokens, and an amateur without ``x`` as one token contributes its first sub-token's probability
(entries that begin with the same sub-token share its term). Several amateurs enter as a weighted
sum of log-probabilities (the papers have one). The score is the issue's form on
log-probabilities: Li et al. is ``β = 1``; O'Brien & Lewis's ``(1 + β) · logit_E − β · logit_A``
ranks as ours with ``β / (1 + β)`` and is its softmax at temperature ``1 / (1 + β)`` (logits and
log-probabilities differ by a per-row constant, which the softmax drops — as it drops every
normalisation above; they change only the terms a trace reports). With no amateur computed (every
other member at weight 0) the step is the expert alone, its whole distribution without the
plausibility cut (the engine's one-member path; a step thresholded mode gives the gate alone is
the gate's own, as for every method); ``β = 0`` with amateurs is the expert
cut to ``V_head`` and renormalised (the same greedy choice as the expert alone, not the same draws).
Likelihood scoring: a piece outside ``V_head`` has probability 0.

Exactness: agreement skip is exact only for ``β = 0`` (the score is ``log p_E``, whose argmax is
the expert's most likely entry, the agreed one; up to exact float ties, as for GaC). For ``β > 0``
it is not: every member may rank ``x`` first and still ``y`` score higher (``p_E = 0.5, 0.4`` and
``p_A = 0.9, 0.01`` for ``x, y``: with ``β = 0.5``, ``−0.64 < 1.39``). So ``exact_agreement`` is
``β == 0``, and agreement skip is off by default otherwise. The result does not depend on the
members' order: candidates are sorted by bytes, amateurs summed in name order.

A traced step reports the chosen piece's terms (``Dist.terms``): ``score``, ``expert:<name>``
(``log p_E``) and ``amateur:<name>`` (``log p_i``) per amateur, natural logs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenfuse.combiners.base import Combiner, Dist, Setup, StepView, normalise, register
from tokenfuse.errors import AlignmentError, ConfigError

FLOOR = math.log(1e-30)  # an amateur's smallest log-probability


class ContrastParams(BaseModel):
    """``alpha``: the plausibility cut (relative to the expert's top probability); ``beta``: the
    amateurs' strength (0: the expert's plausible entries alone)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    alpha: float = Field(0.1, gt=0, le=1)
    beta: float = Field(0.5, ge=0)

    @field_validator("alpha", "beta", mode="before")
    @classmethod
    def _number(cls, v):
        if isinstance(v, bool):
            raise ValueError(f"expected a number, got {v!r}")
        return v


@register
class Contrast(Combiner):
    name = "contrast"
    Params = ContrastParams
    exact_agreement = False  # per instance: True for beta == 0 (module docstring)

    def __init__(self, params: ContrastParams | None = None) -> None:
        super().__init__(params)
        self.alpha, self.beta = self.params.alpha, self.params.beta
        self.exact_agreement = self.beta == 0

    def bind(self, setup: Setup) -> None:
        super().bind(setup)
        self.expert = setup.primary
        expert = setup.members[self.expert]
        if setup.weights[self.expert] <= 0:
            raise ConfigError(f"members.weight: contrast: the expert is the primary member {expert.name!r}, "
                              "which needs a positive weight (or set `primary` to a weighted member)")
        self.names = setup.space.names

    # ------------------------------------------------------------------ the rule
    def amateurs(self, view: StepView) -> list[tuple[int, float | torch.Tensor]]:
        """The computed amateurs and their normalised weights, in name order."""
        live = sorted(((i, w) for i, w in self.weights(view) if i != self.expert), key=lambda x: self.names[x[0]])
        return normalise(live) if live else []

    def plausible(self, pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``V_head`` of each row of the expert's union distribution ``pe``: union entries
        ``int64[R, C]`` in ascending order (padding: entry 0) and which columns are real ``bool[R, C]``,
        on ``pe``'s device."""
        cpu = pe.device.type == "cpu"  # numpy there: a row's max and nonzero are ~10x faster than torch's
        top = torch.from_numpy(pe.numpy().max(axis=-1)) if cpu else pe.max(dim=-1).values
        if bool((top <= 0).any()):
            raise AlignmentError("contrast: the expert gives no text entry any probability")
        count, cols = (head_columns_numpy if cpu else head_columns_torch)(pe, self.alpha * top)
        rows = torch.repeat_interleave(torch.arange(len(count), device=count.device), count)
        pos = torch.arange(len(rows), device=count.device) - (count.cumsum(0) - count)[rows]
        index = torch.zeros(len(count), int(count.max()), dtype=torch.int64, device=pe.device)
        valid = torch.zeros(index.shape, dtype=torch.bool, device=pe.device)
        index[rows, pos] = cols
        valid[rows, pos] = True
        return index, valid

    def amateur_logprobs(self, view: StepView, i: int, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Amateur ``i``'s aligned log-probabilities of the entries ``index`` ``float64[R, C]``, on its
        log-probabilities' device (module docstring; padding columns: the floor)."""
        lp = view.logprobs[i]
        space = self.space
        aligned = space.aligner.aligned(i, torch.where(valid, index, -1).to(lp.device))
        return space.projector.logprobs(i, lp, aligned).clamp_min(FLOOR)

    def scores(self, view: StepView) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Each row's ``V_head`` (``plausible``), the scores ``float64[R, C]`` (padding: ``-inf``) and
        the terms: ``score``, ``expert:<name>``, ``amateur:<name>`` (padding: NaN)."""
        if self.expert not in view.logprobs:
            raise ConfigError(f"contrast: the expert ({self.names[self.expert]!r}, the primary member) must run "
                              "at every ensembled step")
        pe = view.project(self.expert)
        index, valid = self.plausible(pe)
        nan = torch.full(index.shape, math.nan, dtype=torch.float64, device=index.device)
        expert = torch.where(valid, pe.gather(1, index).double().log(), nan)
        with view.stage("align"):
            amateurs = [(self.names[i], self.amateur_logprobs(view, i, index, valid).to(index.device), w)
                        for i, w in self.amateurs(view)]
        penalty = sum((w if isinstance(w, float) else w.to(la.device).unsqueeze(-1)) * la for _, la, w in amateurs)
        score = torch.where(valid, expert - self.beta * penalty, torch.full_like(nan, -math.inf))
        terms = {"score": torch.where(valid, score, nan), f"expert:{self.names[self.expert]}": expert}
        return index, score, terms | {f"amateur:{name}": torch.where(valid, la, nan) for name, la, _ in amateurs}

    # ------------------------------------------------------------------ the combiner
    def combine(self, view: StepView) -> Dist:
        if len(live := self.weights(view)) == 1:  # a member alone: its own (the engine's one-member path)
            return Dist(view.project(live[0][0]))
        index, score, terms = self.scores(view)
        return Dist(torch.softmax(score, -1).float(), index, terms=terms)

    def piece_probs(self, view: StepView, entries: Sequence[int]) -> torch.Tensor:
        """The contrastive distribution's probability of a given entry per row (0 outside ``V_head``);
        a member alone (no amateur computed, or a gated step) gives its own probability."""
        if len(self.weights(view)) == 1:
            return super().piece_probs(view, entries)
        index, score, _ = self.scores(view)
        hit = (index == torch.tensor(list(entries), device=index.device).unsqueeze(-1)) & torch.isfinite(score)
        return torch.where(hit, torch.softmax(score, -1), torch.zeros_like(score)).sum(-1)


def head_columns_numpy(pe: torch.Tensor, cut: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The columns of each row of ``pe`` (on a CPU) at or above its ``cut``: their number per row
    and all of them, row by row, each row ascending."""
    heads = [np.flatnonzero(row >= c) for row, c in zip(pe.numpy(), cut.numpy())]
    return torch.tensor([len(h) for h in heads]), torch.from_numpy(np.concatenate(heads))


def head_columns_torch(pe: torch.Tensor, cut: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``head_columns_numpy`` on ``pe``'s device."""
    mask = pe >= cut.unsqueeze(-1)
    return mask.sum(-1), mask.nonzero(as_tuple=True)[1]
