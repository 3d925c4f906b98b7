"""Thresholded mode (GaC Eq. 5): a gate member runs every step; the others only where its top
probability is at or below ``threshold``.

The options' ``threshold`` turns it on; ``gate`` names the gate member (default: the primary member,
SAFE-style selective ensembling: ``0`` is the gate alone, ``1`` plain combination). Where the gate is
unsure every member runs, a piece they all rank first is taken (agreement skip) and the combination
decides only where they disagree. ``params.boundary`` adds a word-boundary rule on the rows the
combination decides: where its piece is a strict prefix of some computed member's most likely token
(the member holds a longer word as one token and would have to continue from a fragment of it), the
primary member's most likely piece is taken instead (counted as a vetoed step).

The old spelling ``params.select: t`` (with ``select_boundary``) is ``threshold: t`` with the primary as
the gate and ``params.boundary`` (default on there): ``EnsembleOptions`` reads it with a one-line warning.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from tokenfuse.alignment.union import END
from tokenfuse.engine.strategies.base import Strategy, param
from tokenfuse.errors import ConfigError


class GateParams(BaseModel):
    """``boundary``: the word-boundary rule on the rows the combination decides (module docstring)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    boundary: bool = False


class Gate(Strategy):
    name = "gate"
    Params = GateParams

    @classmethod
    def wanted(cls, options: Any) -> bool:
        return options.threshold is not None

    @classmethod
    def check(cls, options: Any) -> None:
        if options.gate is not None and options.threshold is None:
            raise ConfigError(f"threshold: gate {options.gate!r} needs a threshold (ensemble where its top "
                              "probability is at or below it), e.g. threshold: 0.5")
        if param(options, GateParams, "boundary") and options.threshold is None:
            raise ConfigError("params.boundary: the word-boundary rule of thresholded mode; it needs `threshold` "
                              "(the gate: `gate`, default the primary member)")

    def gate(self) -> tuple[int, float]:
        d = self.decider
        which = d.space.names.index(self.options.gate) if self.options.gate is not None else d.primary
        return which, self.options.threshold

    def revise(self, seqs, members, outs, chosen: dict[int, int]) -> set[int]:
        """The boundary rule (module docstring) on the rows the combination chose (``chosen``)."""
        if not self.params.boundary or len(members) < 2 or not chosen:
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
