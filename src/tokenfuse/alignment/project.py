"""Map member distributions into the union space (GaC's ``p^i · M^i`` without a dense matrix)."""

from __future__ import annotations

import torch

from tokenfuse.alignment.entry_probs import EntryProbs


class Projector(EntryProbs):
    """Each member's distribution in the union, and its probability of given entries.

    Every member's distribution is renormalised over its text + END ids (mass on special tokens
    such as ``<|im_start|>`` or padding rows is dropped), so each member's projection sums to 1.
    Union entries some member cannot hold are zeroed and never chosen. The rule and its tables are
    ``EntryProbs`` (``tokenfuse.alignment.entry_probs``); this adds the look-ups of one entry.
    """

    def entry_ids(self, member: int, entry: int) -> list[int]:
        """All of a member's ids for a union entry, ascending (usually one; END and duplicates may
        have more)."""
        spare = self.vocab(member)
        return [t for t in self.ids(member, torch.tensor([entry])).tolist()[0] if t != spare]

    def member_id(self, member: int, union_index: int) -> int:
        """The member's own id for a union entry (``-1`` when it has no single token for it)."""
        return int(self.union.inverse[member][union_index])


class SubtokenAligner:
    """UniTE's alignment of a union entry to a member that may not have it as one token.

    ``aligned_entry(i, e)`` is ``e`` itself when member ``i`` has those exact bytes as a token, else
    the entry of the first sub-token of ``e``'s bytes in the member's own mid-stream tokenization
    (the leading space stays on the word as the member's tokenizer attaches it: no dummy-prefix
    piece, no BOS), ``-1`` where there is none. ``aligned(i, entries)`` does the same for a tensor
    of entries, and the member's aligned probability of ``e`` is its probability of that entry
    (``Projector.probs`` of ``aligned``). ``query_ids(i, e)`` are the member ids whose summed
    probability it is. Both are cached per member.
    """

    def __init__(self, projector: Projector, codecs) -> None:
        self.proj = projector
        self.codecs = list(codecs)
        self._first: list[dict[int, int]] = [{} for _ in self.codecs]
        self._ids: list[dict[int, list[int]]] = [{} for _ in self.codecs]

    def aligned_entry(self, member: int, entry: int) -> int:
        if entry == 0 or self.proj.union.inverse[member][entry] >= 0:
            return entry
        cache = self._first[member]
        if entry not in cache:
            from tokenfuse.errors import AlignmentError

            try:
                ids = self.codecs[member].encode_bytes(self.proj.union.pieces[entry])
            except AlignmentError:
                ids = []
            cache[entry] = int(self.proj.union.maps[member][ids[0]]) if ids else -1
        return cache[entry]

    def aligned(self, member: int, entries: torch.Tensor) -> torch.Tensor:
        """``aligned_entry`` of every entry of ``entries`` (``int64``, any shape; ``-1`` stays ``-1``),
        on their device: only the entries the member lacks go through the host."""
        miss = (entries > 0) & ~self.proj.holds(member, entries)
        if not bool(miss.any()):
            return entries
        keys = torch.unique(entries[miss])  # ascending
        vals = torch.tensor([self.aligned_entry(member, e) for e in keys.tolist()], dtype=entries.dtype,
                            device=entries.device)
        out = entries.clone()
        out[miss] = vals[torch.searchsorted(keys, entries[miss])]
        return out

    def query_ids(self, member: int, entry: int) -> list[int]:
        cache = self._ids[member]
        ids = cache.get(entry)
        if ids is None:
            a = self.aligned_entry(member, entry)
            ids = cache[entry] = self.proj.entry_ids(member, a) if a >= 0 else []
        return ids
