"""Map member distributions into the union space (GaC's ``p^i · M^i`` without a dense matrix)."""

from __future__ import annotations

import numpy as np
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
        self.representable = torch.from_numpy(union.representable)
        self.maps = [torch.from_numpy(m) for m in union.maps]
        # Entries a member holds under several ids (END ids, duplicate spellings): their mass is the
        # sum over ``group_ids`` (flat ids), ``group_entry`` names each id's entry.
        self.group_ids: list[torch.Tensor] = []
        self.group_entry: list[torch.Tensor] = []
        self.groups: list[dict[int, list[int]]] = []
        for m in union.maps:
            counts = np.bincount(m[m >= 0], minlength=self.size)
            ids = np.nonzero((m >= 0) & (counts[np.maximum(m, 0)] > 1))[0]
            self.group_ids.append(torch.from_numpy(ids.astype(np.int64)))
            self.group_entry.append(torch.from_numpy(m[ids].astype(np.int64)))
            groups: dict[int, list[int]] = {}
            for tid in ids.tolist():
                groups.setdefault(int(m[tid]), []).append(tid)
            self.groups.append(groups)
        # per member: (distinct multi-id entries, slot of each flat group id), numpy
        self.group_slots_np = [tuple(x.numpy() for x in torch.unique(ge, return_inverse=True))
                               for ge in self.group_entry]

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

    def entry_ids(self, member: int, entry: int) -> list[int]:
        """All of a member's ids for a union entry (usually one; END and duplicates may have more)."""
        ids = self.groups[member].get(entry)
        if ids is not None:
            return ids
        tid = int(self.union.inverse[member][entry])
        return [tid] if tid >= 0 else []

    def member_id(self, member: int, union_index: int) -> int:
        """The member's own id for a union entry (``-1`` when it has no single token for it)."""
        return int(self.union.inverse[member][union_index])


class SubtokenAligner:
    """UniTE's alignment of a union entry to a member that may not have it as one token.

    ``aligned_entry(i, e)`` is ``e`` itself when member ``i`` has those exact bytes as a token, else
    the entry of the first sub-token of ``e``'s bytes in the member's own mid-stream tokenization
    (the leading space stays on the word as the member's tokenizer attaches it: no dummy-prefix
    piece, no BOS). ``query_ids(i, e)`` are the member ids whose summed probability is the member's
    aligned probability of ``e``. Both are cached per member.
    """

    def __init__(self, projector: Projector, codecs) -> None:
        self.proj = projector
        self.codecs = list(codecs)
        self._first: list[dict[int, int]] = [{} for _ in self.codecs]
        self._ids: list[dict[int, list[int]]] = [{} for _ in self.codecs]

    def aligned_entry(self, member: int, entry: int) -> int:
        union = self.proj.union
        if entry == 0 or union.inverse[member][entry] >= 0 or entry in self.proj.groups[member]:
            return entry
        cache = self._first[member]
        if entry not in cache:
            from tokenfuse.errors import AlignmentError

            try:
                ids = self.codecs[member].encode_bytes(union.pieces[entry])
            except AlignmentError:
                ids = []
            cache[entry] = int(union.maps[member][ids[0]]) if ids else -1
        return cache[entry]

    def query_ids(self, member: int, entry: int) -> list[int]:
        cache = self._ids[member]
        ids = cache.get(entry)
        if ids is None:
            a = self.aligned_entry(member, entry)
            ids = cache[entry] = self.proj.entry_ids(member, a) if a >= 0 else []
        return ids
