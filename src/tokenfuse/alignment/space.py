"""``VocabSpace``: everything the combiners know about the members' vocabularies, and nothing else.

The union of exact byte strings (``union``), each member's codec (id <-> bytes, bytes -> ids), the
projection of a member's distribution into the union (``projector``) and UniTE's sub-token alignment
(``aligner``). The engine builds one per ensemble and hands it to its combiner; a combiner never
sees the ensemble itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenfuse.alignment.project import Projector, SubtokenAligner
from tokenfuse.alignment.union import UnionVocab, build_union
from tokenfuse.members.codec import ByteCodec


@dataclass(frozen=True)
class VocabSpace:
    """The members' vocabularies aligned on exact bytes.

    Attributes:
        names: the members' names, in ensemble order (index ``i`` below is a position in it).
        codecs: each member's ``ByteCodec``.
        union: the union vocabulary and each member's index map.
        projector: the rule of a member's probability of union entries (``EntryProbs``): its whole
            distribution in the union, or given entries' probabilities; entries held under several ids.
        aligner: a union entry -> the member ids whose mass is the member's probability of it.
    """

    names: tuple[str, ...]
    codecs: tuple[ByteCodec, ...]
    union: UnionVocab
    projector: Projector = field(repr=False)
    aligner: SubtokenAligner = field(repr=False)

    @classmethod
    def build(cls, names: Sequence[str], codecs: Sequence[ByteCodec], *, union: UnionVocab | None = None,
              cache: Path | None = None) -> VocabSpace:
        """The space of these members: ``union`` reused if given, else built (or loaded from ``cache``)."""
        union = union or build_union(list(codecs), cache=cache)
        projector = Projector(union)
        return cls(tuple(names), tuple(codecs), union, projector, SubtokenAligner(projector, codecs))

    def __len__(self) -> int:
        return len(self.union)

    def piece(self, entry: int) -> bytes:
        """The bytes of a union entry (``b""`` for END)."""
        return self.union.pieces[entry]

    def member_id(self, member: int, entry: int) -> int:
        """Member ``member``'s own single id for ``entry`` (``-1`` when it has none)."""
        return self.projector.member_id(member, entry)

    def project(self, member: int, logprobs: torch.Tensor) -> torch.Tensor:
        """``float32[R, V_i]`` log-probs of member ``member`` -> ``float32[R, U]`` probabilities."""
        return self.projector.project(member, logprobs)
