"""UniTE — union top-k ensembling (Yao et al., ICLR 2025, arXiv 2410.03777), §4.2, Algorithm 1.

Each step, per sequence:

1. Candidates: the union of every computed member's top-``k`` tokens, as union entries (exact
   bytes; a member's end-of-sequence / end-of-turn ids are the one END entry; special tokens are
   not text and are dropped). Candidates some member could not hold (``representable``) are
   dropped too. Order: ascending union index, i.e. by bytes — independent of member order.
2. Alignment: for each candidate and each member, the member's probability of
   - the candidate itself when the member has those exact bytes as a token (whether or not it is
     in the member's top-k; a member holding the bytes under several ids gets their sum), else
   - the first sub-token of the candidate's bytes in the member's own tokenization (UniTE's
     "James" rule). The bytes are encoded as mid-stream text, exactly as they would follow the
     output: a leading space stays attached to the word as the member's tokenizer attaches it (no
     SentencePiece dummy-prefix "▁" piece, no BOS). A lone-space first piece therefore appears only
     where the member really tokenises that way (e.g. a space before digits in Qwen's
     pre-tokenizer) — it is the member's honest probability of starting the candidate.
3. Normalisation: each member's aligned probabilities are renormalised to sum to 1 over the
   candidates, ``p̂_i(c) = p_i(c) / Σ_c' p_i(c')``. This is what the reference code does (softmax of
   the raw logits restricted to the union = the same ratio). The paper writes ``softmax(P̂)`` on
   probabilities; read literally that maps values in ``[0, 1]`` to ``[1, e]`` before normalising and
   flattens every distribution towards uniform (a member with 0.9 on one candidate and 0.01 on
   nine others would give it only 0.2), which discards the confidence the average relies on.
4. Weighted average with the member weights (uniform weights as in the paper), then the engine
   chooses (greedy by default, or sampling over the candidates).

Adaptive options (``adaptive = True``: ``confidence`` from each member's top-k, ``prompt_weights``,
``boundary``) as for GaC (``combiners/gac.py``); the average in step 4 then has per-row weights.

A member is asked only for its top-``k`` and for the log-probabilities of a few named ids
(``Member.next_topk`` and ``Member.token_logprobs``), so members that expose nothing else can take
part.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, field_validator

from tokenfuse.combiners.base import Combiner, Dist, Setup, StepView, normalise, register
from tokenfuse.errors import AlignmentError


class UniTEParams(BaseModel):
    """``k``: each member's top-k tokens that become candidates (the paper's default: 10)."""

    model_config = ConfigDict(extra="forbid")
    k: int = 10

    @field_validator("k", mode="before")
    @classmethod
    def _positive(cls, k):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        return k


@register
class UniTE(Combiner):
    name = "unite"
    Params = UniTEParams
    needs = "topk"
    adaptive = True

    def __init__(self, params: UniTEParams | None = None) -> None:
        super().__init__(params)
        self.k = self.params.k

    def describe(self) -> dict:
        return {**super().describe(), "k": self.k}

    def bind(self, setup: Setup) -> None:
        super().bind(setup)
        self.proj = setup.space.projector
        self.union = setup.space.union
        self.aligner = setup.space.aligner

    # ------------------------------------------------------------------ alignment
    def candidates(self, view: StepView) -> list[list[int]]:
        """Each row's candidate union entries (sorted)."""
        rows: list[set[int]] = [set() for _ in range(view.rows)]
        rep = self.union.representable
        for i in view.computed:
            entries = self.union.maps[i][view.topk[i][1].cpu().numpy()]  # (only the top-k ids cross)
            for r, row in enumerate(entries.tolist()):
                rows[r].update(e for e in row if e >= 0 and rep[e])
        return [sorted(c) for c in rows]

    def member_probs(self, view: StepView, i: int, cands: list[list[int]]) -> torch.Tensor:
        """Member ``i``'s aligned, renormalised probabilities ``float64[R, C]`` (C = longest row;
        padding columns 0), on the device of its ``token_logprobs``."""
        aligned = self.aligner.aligned(i, _table(cands))
        ids = self.proj.ids(i, aligned)  # [R, C, K]
        lp = view.token_logprobs(i, torch.where(ids == self.proj.vocab(i), 0, ids).flatten(1))
        p = self.proj.total(i, ids.to(lp.device), lp.view(ids.shape).double().exp())
        return p / p.sum(-1, keepdim=True).clamp_min(1e-300)

    def combine(self, view: StepView) -> Dist:
        cands = self.candidates(view)
        if any(not c for c in cands):
            raise AlignmentError("unite: a sequence has no text candidate in any member's top-k (raise k)")
        probs = self.average(view, cands)
        return Dist(probs.float(), _table(cands, pad=0).to(probs.device))

    def average(self, view: StepView, cands: list[list[int]]) -> torch.Tensor:
        """The weighted average of the members' aligned, renormalised probabilities ``float64[R, C]``."""
        probs = None
        for i, w in normalise(self.weights(view)):
            p = self.member_probs(view, i, cands)
            term = p * (w if isinstance(w, float) else w.to(p.device).unsqueeze(-1))
            probs = term if probs is None else probs + term.to(probs.device)
        return probs

    def piece_probs(self, view: StepView, entries) -> torch.Tensor:
        """A given entry's probability: it joins each row's candidates, then as in ``combine``."""
        cands = [sorted(set(c) | {e}) for c, e in zip(self.candidates(view), entries)]
        col = torch.tensor([c.index(e) for c, e in zip(cands, entries)])
        probs = self.average(view, cands)
        return probs.gather(1, col.to(probs.device).unsqueeze(-1))[:, 0]


def _table(rows: list[list[int]], pad: int = -1) -> torch.Tensor:
    """``int64[R, C]`` of ragged rows (C = the longest), padded with ``pad``."""
    out = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.int64)
    for r, row in enumerate(rows):
        out[r, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out
