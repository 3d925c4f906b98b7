"""SAFE (Stable And Fast LLM Ensembling; Yun et al., "When to Ensemble", arXiv 2510.15346v2, Sec. 3,
Algorithm 1): the primary member drafts, the others verify, and the ensemble decides only at the
first drafted position that is both safe and needed.

*Rounds* (``safe: true``; ``chunk``/``trigger``, run by ``engine.speculative.Speculator``): the
primary member (the drafter) greedily drafts ``safe_n`` pieces; the other computed members (the
verifiers) get their rows at every drafted position in one chunked forward. Positions ``j`` are
examined in order, the rest of the chunk ``r_j`` (the drafted bytes from ``j`` on) as lookahead,
with ``o`` the output before ``j``:

1. **Clean** (Eq. 1, the paper's OOV-like tokens): every computed member's own tokenisation of
   ``o + r_j`` has a token boundary where ``o`` ends (``engine.sync.token_at_end``), so no member's
   state there is a fragment of one of its tokens.
2. **Consensus** (skip): with ``o_v`` the token of that tokenisation that starts at the boundary,
   the draft is taken if every verifier's most likely text token in its row at ``j`` is its
   ``o_v``, or if the mean over all computed members (the drafter with its drafted token, each
   verifier with ``o_v``) of their probabilities is above 1/2.

The first clean position without consensus *triggers*: the ensemble decides it as a plain step
would (``Decider.decide_given``: the gate, if one is set (it must be the primary: "GaC + SAFE"),
the combination, sharpening, the choice), and the round ends; the next round drafts after it. The
other positions take the drafted piece, not ensembled. ``Generation.ensembled_steps`` counts the
triggered positions where the members' combination decided (with a gate, not those where the
drafter alone was confident enough): the paper's E/T numerator.

**Sharpening** (``reshape``, Sec. 3): where the combined top probability is below
``safe_sharpen``, each piece the drafter holds as one token whose probability is above
``safe_lambda`` gains the probability of every strict extension of it (pieces that start with its
bytes), all sums from the unsharpened row; the choice is the argmax after. ``PrefixIndex`` finds a
piece's extensions by bisection over the union's pieces in byte order.

*Defaults* are the paper's (Sec. 4.2): ``safe_n`` 5, ``safe_lambda`` 0.1, sharpening below 0.5.
*Mapping and deviations*: a verifier's ids at a clean position are its re-synchronised ids of the
output there (``engine.sync``), not a re-tokenisation of the whole draft (the same ids wherever the
re-sync window agrees with a full tokenisation); the clean check covers the drafter too; a draft cut
short (the drafter's END, a piece the union cannot hold, a context's end) has the ensemble decide
the position it stopped at. SAFE decodes greedily (a sampled sequence is refused) and needs every
deciding member in this process (one chunked forward each). Likelihood scoring is the plain
combination: the rule chooses pieces, it does not change a given piece's probability.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from tokenfuse.alignment.union import END
from tokenfuse.combiners.base import Dist
from tokenfuse.engine.pool import MemberOutput
from tokenfuse.engine.strategies.base import Strategy, param
from tokenfuse.engine.sync import token_at_end
from tokenfuse.errors import ConfigError

OWN_KEYS = ("safe_n", "safe_sharpen", "safe_lambda")


class SafeParams(BaseModel):
    """``safe``: SAFE's rounds (module docstring); ``safe_n``: pieces drafted per round;
    ``safe_sharpen``: sharpen where the combined top probability is below it (``0``: never);
    ``safe_lambda``: the probability a drafter token needs to gain its extensions' mass."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    safe: bool = False
    safe_n: int = Field(5, ge=1, le=32)
    safe_sharpen: float = Field(0.5, ge=0, le=1)
    safe_lambda: float = Field(0.1, ge=0, le=1)


class Safe(Strategy):
    name = "safe"
    Params = SafeParams

    @property
    def exact_agreement(self) -> bool:  # type: ignore[override]
        """Sharpening can move the argmax off the entry every member ranks first."""
        return self.params.safe_sharpen <= 0

    @classmethod
    def wanted(cls, options: Any) -> bool:
        return bool(param(options, SafeParams, "safe"))

    @classmethod
    def check(cls, options: Any) -> None:
        if not cls.wanted(options):
            for key in OWN_KEYS:
                if key in options.params:
                    raise ConfigError(f"params.{key}: a parameter of SAFE; it needs `safe: true`")
            return
        if options.params.get("boundary"):
            raise ConfigError("params.safe: SAFE decides its drafted positions itself; the word-boundary "
                              "rule (`boundary`) would revise them: drop one of them")
        if options.primary is not None:
            _check_drafter(options, options.primary)

    def bind(self, decider: Any) -> None:
        """The rules that need the members: the gate and ``speculative.draft`` are the primary, every
        member that decides runs in this process, the other strategies allow rounds."""
        super().bind(decider)
        names = decider.space.names
        _check_drafter(self.options, names[decider.primary])
        gate = [names.index(self.options.gate)] if self.options.gate is not None else []
        deciding = {i for i, w in enumerate(decider.weights) if w > 0} | {decider.primary, *gate}
        away = [names[i] for i in sorted(deciding) if not decider.members[i].in_process]
        if away:
            raise ConfigError(f"params.safe: SAFE verifies each drafted chunk in one forward per member; "
                              f"{', '.join(away)} does not run in this process")
        plain = [st.name for st in decider.strategies if not st.speculative]
        if plain:
            raise ConfigError(f"params.safe: SAFE decodes in drafted rounds, which {', '.join(plain)} does not allow")

    def admit(self, s: Any) -> None:
        if not s.sampling.greedy:
            raise ConfigError("params.safe: SAFE decodes greedily; set temperature 0 or drop `safe`")

    def chunk(self) -> int:
        return self.params.safe_n

    def trigger(self, s: Any, draft: list[int], rows: dict[int, torch.Tensor]) -> bool:
        """Whether the ensemble decides the position of ``draft[0]``: clean and no consensus (module docstring)."""
        d = self.decider
        own = clean_tokens(d.space, s, draft, sorted(rows))
        if own is None:
            return False
        return not consensus(d.space, d.primary, rows, own)

    def reshape(self, dist: Dist) -> Dist:
        """SAFE's sharpening (module docstring) on the rows whose top probability is below ``safe_sharpen``."""
        smooth = (dist.probs.max(-1).values < self.params.safe_sharpen).nonzero().flatten().tolist()
        if not smooth:
            return dist
        index, held = self._prefixes()
        probs = dist.probs.clone()
        for r in smooth:
            probs[r] = index.sharpen(dist.probs[r], None if dist.index is None else dist.index[r], held,
                                     self.params.safe_lambda)
        return replace(dist, probs=probs)

    def _prefixes(self) -> tuple[PrefixIndex, torch.Tensor]:
        """The union's ``PrefixIndex`` and which entries the drafter holds as one id (built once)."""
        if not hasattr(self, "_index"):
            union = self.decider.space.union
            self._index = PrefixIndex.of(union.pieces)
            umap = np.asarray(union.maps[self.decider.primary])
            held = torch.zeros(len(union.pieces), dtype=torch.bool)
            held[torch.from_numpy(umap[umap >= 0].astype(np.int64))] = True
            held[END] = False
            self._held = held
        return self._index, self._held


def _check_drafter(options: Any, primary: str) -> None:
    """The gate and ``speculative.draft``, if set, must be ``primary`` (SAFE's drafter)."""
    if options.gate is not None and options.gate != primary:
        raise ConfigError(f"gate: with `safe` the gate is the primary member ({primary}), SAFE's drafter "
                          "(GaC + SAFE); set `gate` to it or set `primary`")
    spec = options.speculative
    if spec is not None and spec.draft is not None and spec.draft != primary:
        raise ConfigError(f"speculative.draft: SAFE drafts with the primary member ({primary}); drop "
                          "`speculative.draft` or set `primary` (`params.safe_n` sets the chunk)")


def clean_tokens(space: Any, s: Any, draft: list[int], members: list[int]) -> dict[int, int] | None:
    """The clean check (module docstring, 1.) at ``s``'s output: per member the id of the token its
    own tokenisation of the output and ``draft``'s bytes has at the output's end (``o_v``), or
    ``None`` where some member has no token boundary there."""
    out = bytes(s.output)
    rest = b"".join(space.piece(e) for e in draft if e != END)
    own = {}
    for i in members:
        t = token_at_end(space.codecs[i], s.states[i], out, rest, window=s.window)
        if t is None:
            return None
        own[i] = t
    return own


def consensus(space: Any, drafter: int, rows: dict[int, torch.Tensor], own: dict[int, int]) -> bool:
    """The consensus rule (module docstring, 2.): every verifier's most likely text token is its
    ``own`` token, or the members' mean probability of their tokens (the drafter's: its drafted one,
    its most likely text token) is above 1/2."""
    tops = {i: MemberOutput(logprobs=row[None]).top_text(space.union.maps[i]) for i, row in rows.items()}
    verifiers = [i for i in rows if i != drafter]
    if all(int(tops[v][0][0]) == own[v] for v in verifiers):
        return True
    probs = [float(np.exp(tops[drafter][1][0]))] + [float(rows[v][own[v]].exp()) if own[v] >= 0 else 0.0
                                                    for v in verifiers]
    return sum(probs) / len(probs) > 0.5


class PrefixIndex:
    """Union pieces in byte order: the pieces that start with a given piece are one run of it
    (``span``), so a row's mass on a piece's extensions is a difference of cumulative sums."""

    _last: tuple[Sequence[bytes], PrefixIndex] | None = None  # the pieces indexed last (one union)

    def __init__(self, pieces: Sequence[bytes]) -> None:
        order = sorted(range(len(pieces)), key=pieces.__getitem__)
        self.pieces = pieces
        self.sorted = [pieces[e] for e in order]
        self.order = torch.tensor(order, dtype=torch.long)
        self.rank = torch.empty(len(order), dtype=torch.long)
        self.rank[self.order] = torch.arange(len(order))
        self._end: dict[int, int] = {}

    @classmethod
    def of(cls, pieces: Sequence[bytes]) -> PrefixIndex:
        """The index of ``pieces``, reused while the same pieces are asked for (ensembles share a union)."""
        if cls._last is None or cls._last[0] is not pieces:
            cls._last = (pieces, cls(pieces))
        return cls._last[1]

    def span(self, entry: int) -> tuple[int, int]:
        """Ranks ``[lo, hi)`` of the pieces that start with ``entry``'s piece (``lo``: itself)."""
        lo = int(self.rank[entry])
        if entry not in self._end:
            b = self.pieces[entry].rstrip(b"\xff")
            after = b[:-1] + bytes([b[-1] + 1]) if b else None  # the first bytes past every extension
            self._end[entry] = len(self.sorted) if after is None else bisect.bisect_left(self.sorted, after, lo)
        return lo, self._end[entry]

    def sharpen(self, p: torch.Tensor, entries: torch.Tensor | None, held: torch.Tensor, lam: float) -> torch.Tensor:
        """Row ``p`` sharpened (module docstring): ``entries``, its columns' union entries (``None``:
        column = entry); ``held``: the entries the drafter holds as one id."""
        ents = torch.arange(len(p)) if entries is None else entries
        cols = ((p > lam) & held[ents]).nonzero().flatten().tolist()
        if not cols:
            return p
        if entries is None:
            ranks, perm = torch.arange(len(p)), self.order
        else:
            ranks, perm = self.rank[ents].sort()
        cum = torch.cat([torch.zeros(1, dtype=torch.float64), p[perm].double().cumsum(0)])
        out = p.clone()
        for c in cols:
            lo, hi = self.span(int(ents[c]))
            a, b = int(torch.searchsorted(ranks, lo)), int(torch.searchsorted(ranks, hi))
            out[c] = p[c] + (cum[b] - cum[a] - p[c].double()).clamp_min(0).to(p.dtype)
        return out
