"""Map member distributions into the union space (GaC's ``p^i · M^i`` without a dense matrix)."""

from __future__ import annotations

import torch

from tokenfuse.alignment.union import UnionVocab


class Projector:
    """Scatter each member's probabilities into the union with its index map.

    Every member's distribution is renormalised over its text + END ids (mass on special tokens
    such as ``<|im_start|>`` or padding rows is dropped), so each member's projection sums to 1.
    Union entries some member cannot hold are zeroed and never chosen.
    """

    def __init__(self, union: UnionVocab) -> None:
        self.union = union
        self.size = len(union)
        self._src: list[torch.Tensor] = []
        self._dst: list[torch.Tensor] = []
        for m in union.maps:
            mt = torch.from_numpy(m)
            src = torch.nonzero(mt >= 0).squeeze(1)
            self._src.append(src)
            self._dst.append(mt[src])
        self.blocked = torch.from_numpy(~union.representable)

    def project(self, member: int, logprobs: torch.Tensor) -> torch.Tensor:
        """``float32[B, V_i]`` log-probs -> ``float32[B, U]`` probabilities summing to 1 per row."""
        src = self._src[member]
        src = src[src < logprobs.shape[-1]]  # padding rows beyond the logits, if any
        p = logprobs.index_select(-1, src).exp()
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
        out = torch.zeros(logprobs.shape[0], self.size, dtype=torch.float32)
        out.index_add_(1, self._dst[member][: src.numel()], p)
        out[:, self.blocked] = 0.0
        return out

    def member_id(self, member: int, union_index: int) -> int:
        """The member's own id for a union entry (``-1`` when it has no single token for it)."""
        return int(self.union.inverse[member][union_index])
