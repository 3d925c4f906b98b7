"""Map member distributions into the union space (GaC's ``p^i · M^i`` without a dense matrix)."""

from __future__ import annotations

import torch

from tokenfuse.alignment.union import UnionVocab


class Projector:
    """Scatter each member's probabilities into the union with its index map.

    Every member's distribution is renormalised over its text + END ids (mass on special tokens
    such as ``<|im_start|>`` or padding rows is dropped), so each member's projection sums to 1.
    Union entries some member cannot hold are zeroed and never chosen.

    Hot path: ids that are not text are sent to one spare column past the union (so a single
    ``index_add_`` over the whole vocabulary does the mapping, with no gather first); the spare
    column's mass is what the renormalisation removes.
    """

    def __init__(self, union: UnionVocab) -> None:
        self.union = union
        self.size = len(union)
        self._dst: list[torch.Tensor] = []
        for m in union.maps:
            mt = torch.from_numpy(m).clone()
            mt[mt < 0] = self.size  # the spare column
            self._dst.append(mt)
        self.blocked = torch.nonzero(torch.from_numpy(~union.representable)).squeeze(1)

    def project(self, member: int, logprobs: torch.Tensor) -> torch.Tensor:
        """``float32[B, V_i]`` log-probs -> ``float32[B, U]`` probabilities summing to 1 per row."""
        dst = self._dst[member]
        v = min(logprobs.shape[-1], dst.numel())  # padding rows beyond the logits, if any
        p = logprobs[:, :v].exp()
        out = torch.zeros(logprobs.shape[0], self.size + 1, dtype=torch.float32)
        out.index_add_(1, dst[:v], p)
        mass = out[:, : self.size].sum(-1, keepdim=True).clamp_min(1e-30)
        out = out[:, : self.size]
        out.div_(mass)
        out[:, self.blocked] = 0.0
        return out

    def member_id(self, member: int, union_index: int) -> int:
        """The member's own id for a union entry (``-1`` when it has no single token for it)."""
        return int(self.union.inverse[member][union_index])
