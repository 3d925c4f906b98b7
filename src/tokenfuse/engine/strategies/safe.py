"""SAFE (Stable And Fast LLM Ensembling; Yun et al., arXiv 2510.15346, "When to Ensemble"): the
primary member drafts, the others verify, and the ensemble decides only where it is both needed and
safe.

*Rule*, per step (``safe: true``), with ``d`` the primary member's most likely piece (its draft):

1. **Consensus.** The members' combination (the method's own, GaC's average over the union) is
   formed and, where it is overly smooth, sharpened (3.). Where its choice is ``d`` the members
   agree with the draft: ``d`` is taken and the step is *not* ensembled. (Agreement skip, where
   every member ranks ``d`` first, is the same case reached without combining.)
2. **Clean boundary** (the paper's OOV-like tokens). Where the combination chooses another piece,
   it is taken only if the position is a token boundary for every computed member and the
   primary: each one's
   own tokenisation of the output followed by ``d`` has a token boundary where the output ends
   (``engine.sync.boundary_at_end``). Otherwise some member's state here is a fragment of one of its
   tokens (e.g. ``So`` of a member that writes ``Sofia`` as one token), its distribution is not to
   be trusted, and ``d`` is taken (``Generation.vetoed_steps``). Steps whose choice is not ``d``
   are the ensembled ones (``Generation.ensembled_steps``).
3. **Sharpening.** Where the combined distribution's top probability is below ``safe_sharpen``,
   the mass that sits on sub-word pieces of a longer candidate is moved onto it: among the
   ``SHARPEN_CANDIDATES`` most likely pieces, each one that is a strict byte prefix of another
   gives its probability to its most likely extension (followed to the longest), so a word spread
   over ``So``/``Sof``/``Sofia`` by members with different tokenisers counts as one choice.

Speculative decoding with the primary as drafter (``speculative.draft``) runs exactly this rule at
every drafted position (``Decider.decide_given``), with the verifiers in one forward per round.

*Source and deviations.* Only the paper's abstract, introduction and figure caption and three
independent summaries of it could be read here (the reference code, github.com/yoon6503/SAFE, was
not available), so the equations and default values are not the paper's: (1) consensus is judged by
whether the combination chooses the draft, not by a verifier-probability threshold; (2) the paper
has the verifiers re-tokenise the whole draft and checks every drafter position; here the check is
per step on the output and the next drafted piece, which the members' exact byte-level
re-synchronisation makes the same test at that position (and keeps plain and speculative decoding
identical); (3) sharpening consolidates sub-word mass as the summaries describe ("consolidates
probabilities spread across multiple sub-word tokens"), not a temperature (a temperature leaves the
greedy choice unchanged); the ``0.5`` smoothness threshold and the 16 candidates are ours.
Scoring (teacher forcing) is the plain combination: the rule chooses pieces, it does not change a
given piece's probability.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from tokenfuse.alignment.union import END
from tokenfuse.combiners.base import Dist
from tokenfuse.engine.strategies.base import Strategy, param
from tokenfuse.engine.sync import boundary_at_end
from tokenfuse.errors import ConfigError

SHARPEN_CANDIDATES = 16


class SafeParams(BaseModel):
    """``safe``: SAFE's rule (module docstring); ``safe_sharpen``: sharpen where the combined
    distribution's top probability is below it (``0``: never)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    safe: bool = False
    safe_sharpen: float = Field(0.5, ge=0, le=1)


class Safe(Strategy):
    name = "safe"
    Params = SafeParams
    drafting = True

    @classmethod
    def wanted(cls, options: Any) -> bool:
        return bool(param(options, SafeParams, "safe"))

    @classmethod
    def check(cls, options: Any) -> None:
        if not cls.wanted(options):
            if "safe_sharpen" in options.params:
                raise ConfigError("params.safe_sharpen: SAFE's sharpening needs `safe: true`")
            return
        if options.gate is not None:
            raise ConfigError(f"params.safe: SAFE has the primary member ({options.primary_label}) draft every "
                              "step; drop `gate` and `threshold`, or drop `safe`")
        if options.params.get("select") is not None:
            raise ConfigError("params.safe: SAFE and selective ensembling (`select`) both decide by the "
                              "primary member; drop one of them")

    def reshape(self, dist: Dist) -> Dist:
        """SAFE's sharpening (module docstring, 3.) on the rows whose top probability is below ``safe_sharpen``."""
        smooth = (dist.probs.max(-1).values < self.params.safe_sharpen).nonzero().flatten().tolist()
        if not smooth:
            return dist
        probs = dist.probs.clone()
        for j in smooth:
            sharpen_row(probs[j], lambda c, j=j: dist.entry(j, c), self.decider.space.piece)
        return replace(dist, probs=probs)

    def revise(self, seqs, members, outs, chosen: dict[int, int]) -> set[int]:
        """The clean-boundary rule (module docstring, 2.): where the choice is not the draft and the
        position is not a token boundary for every computed member, the draft is taken."""
        if not chosen:
            return set()
        d = self.decider
        own = d.primary_top(seqs, outs)
        check = sorted(set(members) | {d.primary})
        changed = set()
        for r, e in chosen.items():
            if own[r] < 0 or e == own[r]:
                continue
            s = seqs[r]
            piece = d.space.piece(own[r]) if own[r] != END else b""
            out = bytes(s.output)
            if not all(boundary_at_end(d.space.codecs[i], s.states[i], out, piece, window=s.window) for i in check):
                chosen[r] = own[r]
                changed.add(r)
        return changed


def sharpen_row(p: torch.Tensor, entry, piece) -> None:
    """Move, in place, the probability of each of the row's ``SHARPEN_CANDIDATES`` most likely
    pieces that is a strict byte prefix of another of them onto its most likely extension, followed
    to the longest (``entry(col)``: a column's union entry, ``piece(entry)``: its bytes)."""
    vals, cols = torch.topk(p, min(SHARPEN_CANDIDATES, p.numel()))
    cand = [(int(c), float(v), piece(e)) for c, v in zip(cols.tolist(), vals.tolist())
            if v > 0 and (e := entry(int(c))) != END]
    target: dict[int, int] = {}
    for c, _, b in cand:  # the most likely strict extension (topk order: the first is the most likely)
        ext = next((c2 for c2, _, b2 in cand if len(b2) > len(b) and b2.startswith(b)), None)
        if ext is not None:
            target[c] = ext
    for c, v, _ in cand:
        if c in target:
            t = target[c]
            while t in target:  # each step is a longer piece: the chain ends
                t = target[t]
            p[c] -= v
            p[t] += v
