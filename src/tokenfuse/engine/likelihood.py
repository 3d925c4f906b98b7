"""Teacher forcing: the log-likelihood of a given continuation under the token-level ensemble.

Definition: the continuation's bytes are cut into pieces by the primary member's own mid-stream
tokenization. Piece by piece, every weighted member runs on the context plus the pieces so far
(the same lockstep engine and re-sync as generation), and the piece's probability is the
combiner's probability of that union entry (``Combiner.piece_probs``: for GaC the weighted average
of the members' probabilities, a member without the piece as one token contributing its first
sub-token's probability as in UniTE; for UniTE the piece joins the top-k candidates). The result
is the sum of the pieces' log-probabilities; a member alone (or copies of one member) gives
exactly that member's own likelihood of its tokens, each renormalised over its text + END ids.

Thresholded GaC (``gate``/``threshold``) gates each piece as in generation: where the gate
member's top probability is above the threshold, the piece's probability is the gate's alone;
elsewhere the group's combination. ``Likelihood.ensembled`` counts the latter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from tokenfuse.engine.decide import Decider
from tokenfuse.engine.sequence import Sequence


@dataclass(frozen=True)
class Likelihood:
    """``logprob``: natural-log likelihood of a continuation; ``pieces``/``bytes``: its length (for
    per-piece or per-byte normalisation)."""

    logprob: float
    pieces: int
    bytes: int
    ensembled: int = 0  # pieces scored by more than one member (fewer than ``pieces`` when gated)

    @property
    def per_byte(self) -> float:
        return self.logprob / max(self.bytes, 1)


def primary_pieces(decider: Decider, text: str) -> list[int]:
    """``text`` cut into union entries by the primary member's mid-stream tokenization."""
    i = decider.primary
    ids = decider.space.codecs[i].encode_text(text)
    return [int(decider.space.union.maps[i][t]) for t in ids]


def score(decider: Decider, seqs: list[Sequence], continuations: Seq[str]) -> list[Likelihood]:
    """The likelihood of each continuation after its sequence's context (``seqs``, freshly opened;
    the caller closes them)."""
    cuts = [primary_pieces(decider, c) for c in continuations]
    totals, ensembled = [0.0] * len(seqs), [0] * len(seqs)
    for j in range(max((len(c) for c in cuts), default=0)):
        rows = [k for k in range(len(seqs)) if j < len(cuts[k])]
        active = [seqs[k] for k in rows]
        entries = [cuts[k][j] for k in rows]
        probs: list[float] = [0.0] * len(active)
        for group, members in decider.groups(active):
            sub = [active[r] for r in group]
            view = decider.view(sub, members, decider.forward(members, sub))
            with decider.timer.stage("combine"):
                got = decider.combiner.piece_probs(view, [entries[r] for r in group]).tolist()
            for r, p in zip(group, got):
                probs[r] = p
                ensembled[rows[r]] += len(members) > 1
        with decider.timer.stage("resync"):
            for k, s, u, p in zip(rows, active, entries, probs):
                totals[k] += math.log(p) if p > 0 else float("-inf")
                s.force(u)
    return [Likelihood(lp, len(c), len(cont.encode("utf-8")), e)
            for lp, c, e, cont in zip(totals, cuts, ensembled, continuations)]
