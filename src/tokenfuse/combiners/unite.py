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
``select``) as for GaC (``combiners/gac.py``); the average in step 4 then has per-row weights.

A member is asked only for its top-``k`` and for the log-probabilities of a few named ids
(``Member.next_topk`` and ``Member.token_logprobs``), so members that expose nothing else can take
part.
"""

from __future__ import annotations

import numpy as np
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
            entries = self.proj.maps[i][view.topk[i][1]]
            for r, row in enumerate(entries.tolist()):
                rows[r].update(e for e in row if e >= 0 and rep[e])
        return [sorted(c) for c in rows]

    def member_probs(self, view: StepView, i: int, cands: list[list[int]]) -> np.ndarray:
        """Member ``i``'s aligned, renormalised probabilities ``float64[R, C]`` (C = longest row)."""
        width = max(len(c) for c in cands)
        queries = [[(col, tid) for col, e in enumerate(row) for tid in self.aligner.query_ids(i, e)] for row in cands]
        n = max(1, max(len(q) for q in queries))
        ids = np.zeros((len(cands), n), dtype=np.int64)
        cols = np.full((len(cands), n), width, dtype=np.int64)  # padding goes to a spare column
        for r, q in enumerate(queries):
            if q:
                cols[r, : len(q)], ids[r, : len(q)] = zip(*q)
        p = np.exp(view.token_logprobs(i, torch.from_numpy(ids)).numpy().astype(np.float64))
        out = np.stack([np.bincount(c, weights=w, minlength=width + 1)[:width] for c, w in zip(cols, p)])
        return out / np.maximum(out.sum(-1, keepdims=True), 1e-300)

    def combine(self, view: StepView) -> Dist:
        cands = self.candidates(view)
        if any(not c for c in cands):
            raise AlignmentError("unite: a sequence has no text candidate in any member's top-k (raise k)")
        width = max(len(c) for c in cands)
        index = torch.zeros(len(cands), width, dtype=torch.int64)
        for r, c in enumerate(cands):
            index[r, : len(c)] = torch.tensor(c)
        return Dist(torch.from_numpy(self.average(view, cands).astype(np.float32)), index)

    def average(self, view: StepView, cands: list[list[int]]) -> np.ndarray:
        """The weighted average of the members' aligned, renormalised probabilities ``[R, C]``."""
        probs = np.zeros((len(cands), max(len(c) for c in cands)))
        for i, w in normalise(self.weights(view)):
            probs += (w if isinstance(w, float) else w.numpy()[:, None]) * self.member_probs(view, i, cands)
        return probs

    def piece_probs(self, view: StepView, entries) -> torch.Tensor:
        """A given entry's probability: it joins each row's candidates, then as in ``combine``."""
        cands = [sorted(set(c) | {e}) for c, e in zip(self.candidates(view), entries)]
        probs = self.average(view, cands)
        return torch.from_numpy(np.array([probs[r, c.index(e)] for r, (c, e) in enumerate(zip(cands, entries))]))
