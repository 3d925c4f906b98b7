"""Selective ensembling (SAFE-style): ensemble only where the primary member is unsure.

Thresholded mode with the primary member as the gate and ``select`` as the threshold: where its
top probability is above ``select`` its piece is taken and no other member runs; elsewhere every
member runs, a piece they all rank first is taken (agreement skip) and the combination decides only
where they disagree. ``0`` is the primary alone, ``1`` (with ``select_boundary: false``) plain
combination. With ``select_boundary`` (default) a word-boundary rule revises the combination's
choice: where its piece is a strict prefix of some computed member's most likely token (the member
holds a longer word as one token and would have to continue from a fragment of it), the primary's
most likely piece is taken instead (counted as a vetoed step).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from tokenfuse.alignment.union import END
from tokenfuse.engine.strategies.base import Strategy, param
from tokenfuse.errors import ConfigError


class SelectParams(BaseModel):
    """``select``: the primary member's confidence threshold (``None``: off); ``select_boundary``:
    the word-boundary rule on the rows the combination decides."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    select: float | None = Field(None, ge=0, le=1)
    select_boundary: bool = True


class Select(Strategy):
    name = "select"
    Params = SelectParams

    @classmethod
    def wanted(cls, options: Any) -> bool:
        return param(options, SelectParams, "select") is not None

    @classmethod
    def check(cls, options: Any) -> None:
        if cls.wanted(options) and options.gate is not None:
            raise ConfigError(f"params.select: selective ensembling gates on the primary member "
                              f"({options.primary_label}); drop `gate` and `threshold`, or drop `select` "
                              "(set `primary` to choose the member)")

    def gate(self) -> tuple[int, float]:
        return self.decider.primary, self.params.select

    def revise(self, seqs, members, outs, chosen: dict[int, int]) -> set[int]:
        """The boundary rule (module docstring) on the rows the combination chose (``chosen``)."""
        if not self.params.select_boundary or len(members) < 2 or not chosen:
            return set()
        d = self.decider
        space = d.space
        rows = list(chosen)
        pick = torch.tensor(rows)
        pieces = {r: space.piece(chosen[r]) if chosen[r] != END else b"" for r in rows}
        split = set()
        for i in members:
            ids, _ = outs[i].rows(pick).top_text(space.union.maps[i])
            token_bytes = space.codecs[i].token_bytes
            for r, tid in zip(rows, ids.tolist()):
                b = token_bytes[tid] or b""
                if pieces[r] and len(b) > len(pieces[r]) and b.startswith(pieces[r]):
                    split.add(r)
        if not split:
            return set()
        own = d.primary_top(seqs, outs)
        changed = set()
        for r in split:
            if own[r] >= 0 and own[r] != chosen[r]:
                chosen[r] = own[r]
                changed.add(r)
        return changed
