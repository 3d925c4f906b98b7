"""The pruned tree of a member's histories along a byte string, and its parts: the member's tokens by
their bytes, the rules for the mass pruning drops, a boundary's pruning, a history's covers. What the
tree computes and why it is a distribution: alignment/byteview.py's docstring."""

from __future__ import annotations

import bisect
import copy
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

LOG257 = math.log(257)


class TokenBytes:
    """A member's text tokens by their bytes: sorted (ties by id), the span of those starting with a
    prefix, and exact lookups."""

    def __init__(self, token_bytes: Sequence[bytes | None]) -> None:
        text = sorted((b, i) for i, b in enumerate(token_bytes) if b)
        self.sorted = [b for b, _ in text]
        self.order = np.array([i for _, i in text], dtype=np.int64)
        self.rank = np.full(len(token_bytes), -1, dtype=np.int64)  # each text token's position in ``sorted``
        self.rank[self.order] = np.arange(len(self.order))
        self.other = np.array([i for i, b in enumerate(token_bytes) if not b], dtype=np.int64)  # they end the text
        self.exact: dict[bytes, list[int]] = {}
        for b, i in text:
            self.exact.setdefault(b, []).append(i)
        self.token_bytes = list(token_bytes)
        self.longest = max((len(b) for b in self.sorted), default=0)

    def span(self, r: bytes, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        """``[a, b)``: the positions in ``sorted`` of the tokens that start with ``r`` (within ``[lo, hi)``)."""
        hi = len(self.sorted) if hi is None else hi
        if not r:
            return lo, hi
        a = bisect.bisect_left(self.sorted, r, lo, hi)
        return a, bisect.bisect_left(self.sorted, after_prefix(r), a, hi)

    def starting_with(self, r: bytes) -> np.ndarray:
        a, b = self.span(r)
        return self.order[a:b]

    def greedy(self, r: bytes) -> list[int]:
        """Tokens spelling ``r``, each the longest that spells a prefix of what is left (the lowest id
        among equal bytes); a byte that starts no token is left out (the member cannot spell it)."""
        out, pos = [], 0
        while pos < len(r):
            for d in range(min(self.longest, len(r) - pos), 0, -1):
                ids = self.exact.get(r[pos:pos + d])
                if ids:
                    out.append(ids[0])
                    pos += d
                    break
            else:
                pos += 1
        return out


class Reserve:
    """Where the mass pruning drops goes (the module docstring). ``on`` (the reserve rule): ``lp = log R``
    after the current boundary, and the most probable history dropped at the latest boundary that
    dropped one (``last``, at ``at``), from which a re-seed starts. Off (the top rule): the mass is left
    out and ``lp`` stays ``-inf``."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.lp = -math.inf
        self.last: tuple[int, ...] = ()
        self.at = 0

    def step(self) -> float:
        """Past one more byte: ``log(R / 257)``, the reserve's mass on that byte (and what it keeps)."""
        self.lp -= LOG257
        return self.lp

    def drop(self, gone: float, top: tuple[int, ...] | None, at: int) -> float:
        """Histories of log-mass ``gone`` dropped at boundary ``at`` (``top``: the most probable of them,
        ``None``: none); returns the log-mass left out (``-inf`` with the reserve on)."""
        if not self.on or top is None:
            return gone
        self.lp = float(np.logaddexp(self.lp, gone))
        self.last, self.at = top, at
        return -math.inf

    def reseed(self, tokens: TokenBytes, data: bytes, at: int) -> tuple[tuple[int, ...], float]:
        """The history spelling ``data[:at]`` that takes the reserve's whole mass, and that mass."""
        h, lp = self.last + tuple(tokens.greedy(data[self.at:at])), self.lp
        self.lp = -math.inf
        return h, lp


def boundary(cands: dict[tuple[int, ...], float] | None, covered: float, total: float, at: int, floor: float,
             width: int | None, reserve: Reserve, tokens: TokenBytes, data: bytes
             ) -> tuple[list[tuple[tuple[int, ...], float]], float, float]:
    """The histories kept at boundary ``at`` (``cands``: the candidates there, ``covered``: the kept
    histories' covers of ``data[:at]``, ``total``: ``log P̂(data[:at])``): pruned, the rest to
    ``reserve``, and with the reserve on its re-seed where nothing kept covers the prefix; with the
    log-share of the prefix mass dropped and the log-mass left out."""
    kept, gone, top = prune(cands or {}, total + floor, width, not reserve.on)
    lost = reserve.drop(gone, top, at)
    if reserve.on and at and covered == -math.inf and reserve.lp > -math.inf:
        kept.append(reserve.reseed(tokens, data, at))
    return kept, gone - total if gone > -math.inf else -math.inf, lost


def after_prefix(r: bytes) -> bytes:
    """The smallest byte string greater than every string that starts with ``r`` (``r`` non-empty)."""
    s = r.rstrip(b"\xff")
    return s[:-1] + bytes([s[-1] + 1]) if s else b"\xff" * (len(r) + 1)


def logaddexp_at(acc: np.ndarray, n: int, value: float) -> None:
    acc[n] = np.logaddexp(acc[n], value)


@dataclass
class Tree:
    """``score_bytes``'s pruned tree along the bytes: the kept histories' covers of each prefix
    (``prefix``), the prefix masses with the reserve's share (``total``), the masses left out (``lost``),
    the reserve, the candidates by boundary (``frontier``) and the largest log-share pruning dropped."""

    prefix: np.ndarray
    total: np.ndarray
    lost: np.ndarray
    res: Reserve
    frontier: dict[int, dict[tuple[int, ...], float]]
    share: float = -math.inf

    @classmethod
    def new(cls, n_bytes: int, reserve: bool) -> Tree:
        prefix = np.full(n_bytes + 1, -math.inf)
        prefix[0] = 0.0
        return cls(prefix, prefix.copy(), np.full(n_bytes + 1, -math.inf), Reserve(reserve), {0: {(): 0.0}})

    def boundary(self, i: int, floor: float, width: int | None, tokens: TokenBytes, data: bytes
                 ) -> list[tuple[tuple[int, ...], float]]:
        """The histories kept at boundary ``i`` (its candidates pruned, the prefix mass there set)."""
        if i:
            self.total[i] = np.logaddexp(self.prefix[i], self.res.step())
        kept, gone, self.lost[i] = boundary(self.frontier.pop(i, None), self.prefix[i], self.total[i], i, floor,
                                            width, self.res, tokens, data)
        self.share = max(self.share, gone)
        return kept

    def grow(self, data: bytes, i: int, h: tuple[int, ...], lp: float, entries: np.ndarray, lo: int, hi: int,
             tokens: TokenBytes) -> None:
        """History ``h`` (probability ``exp(lp)``, at boundary ``i``; ``entries``: its log-probabilities of the
        tokens at ``tokens.sorted[lo:hi]``, those starting with ``data[i]``): its covers of every longer prefix,
        and the histories it makes."""
        p = np.exp(entries)
        for d, a, b in spans(data, i, lo, hi, tokens, len(data)):
            mass = float(p[a - lo:b - lo].sum())
            if mass > 0:
                logaddexp_at(self.prefix, i + d, lp + math.log(mass))
            for q, t in enumerate(tokens.exact.get(data[i:i + d], ())):  # they sort first in the span
                self.frontier.setdefault(i + d, {})[h + (t,)] = lp + float(entries[a - lo + q])

    def fork(self) -> Tree:
        """A copy to simulate on (``_speculate``)."""
        return Tree(self.prefix.copy(), self.total.copy(), self.lost.copy(), copy.copy(self.res),
                     {k: dict(v) for k, v in self.frontier.items()}, self.share)


def prune(cands: dict[tuple[int, ...], float], floor: float, width: int | None, top: bool
           ) -> tuple[list[tuple[tuple[int, ...], float]], float, tuple[int, ...] | None]:
    """The histories kept at a boundary (most probable first, ties by ids), the log-mass of the others
    (``-inf``: none dropped) and the most probable of them (``None``). They stay above ``floor``
    (``keep`` times ``P̂(x[:i])``) among the ``width`` most probable; with ``top`` (the top rule) the
    most probable always stays (the histories at a boundary are the only ones that can spell any next
    byte: the covers of longer tokens from earlier boundaries die with the first byte that none of them
    has, and a tree without a history at every boundary would give the rest of the text no mass)."""
    ranked = sorted(cands.items(), key=lambda kv: (-kv[1], kv[0]))
    keep = [(top and k == 0) or (lp >= floor and (width is None or k < width)) for k, (_, lp) in enumerate(ranked)]
    gone = [hl for hl, k in zip(ranked, keep) if not k]
    kept = [hl for hl, k in zip(ranked, keep) if k]
    if not gone:
        return kept, -math.inf, None
    return kept, float(np.logaddexp.reduce(np.array([lp for _, lp in gone]))), gone[0][0]


def spans(data: bytes, i: int, lo: int, hi: int, tokens: TokenBytes, stop: int) -> Iterator[tuple[int, int, int]]:
    """``(d, a, b)`` for ``d = 1, 2, …`` while ``i + d <= stop``: the span ``[a, b)`` of the tokens (within
    ``[lo, hi)``) that start with ``data[i:i + d]``, as long as some do."""
    a, b, d = lo, hi, 1
    while i + d <= stop and a < b:
        a, b = tokens.span(data[i:i + d], a, b)
        if a >= b:
            return
        yield d, a, b
        d += 1
