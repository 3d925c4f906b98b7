"""The parts of a member's byte model (alignment/bytemodel.py): the member's tokens by their bytes, where
the mass pruning drops goes, a boundary's pruning."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence

import numpy as np

LOG257 = math.log(257)
DEPTH = 16  # ``TokenBytes.column`` keeps the first this many bytes of every token as columns


def logsubexp(a: float, b: float) -> float:
    """``log(exp(a) − exp(b))`` for ``b ≤ a`` (``-inf`` when they are equal)."""
    if b == -math.inf:
        return a
    if b >= a:
        return -math.inf
    return a + math.log1p(-math.exp(b - a))


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
        self.text = len(self.sorted)
        self.row_ids = np.concatenate([self.order, self.other]).astype(np.int64)  # a whole row: text sorted, then the rest
        self._cols: np.ndarray | None = None

    def column(self, depth: int, lo: int, hi: int) -> np.ndarray:
        """The byte at ``depth`` of the tokens at ``sorted[lo:hi]`` (``-1``: shorter), non-decreasing
        where they share their first ``depth`` bytes (the first ``DEPTH`` bytes kept as columns, built
        on first use)."""
        if depth >= DEPTH:
            return np.fromiter((b[depth] if len(b) > depth else -1 for b in self.sorted[lo:hi]),
                               dtype=np.int16, count=hi - lo)
        if self._cols is None:
            lens = np.fromiter((len(b) for b in self.sorted), dtype=np.int64, count=self.text)
            flat = b"".join(b[:DEPTH].ljust(DEPTH, b"\0") for b in self.sorted)
            mat = np.frombuffer(flat, dtype=np.uint8).reshape(self.text, DEPTH).astype(np.int16)
            mat[np.arange(DEPTH)[None, :] >= lens[:, None]] = -1
            self._cols = np.ascontiguousarray(mat.T)  # [DEPTH, text]: one depth's bytes contiguous
        return self._cols[depth, lo:hi]

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


class Dropped:
    """Where the mass pruning drops goes (alignment/bytemodel.py). It always remembers the most probable
    history dropped at the latest boundary that dropped one (``last``, at ``at``), from which a re-seed
    starts. With ``keeps`` (the reserve rule) the mass joins the reserve: ``lp = log R`` after the
    current boundary; otherwise it is left out and ``lp`` stays ``-inf``."""

    def __init__(self, keeps: bool) -> None:
        self.keeps = keeps
        self.lp = -math.inf
        self.last: tuple[int, ...] = ()
        self.last_lp = 0.0  # its log-probability
        self.at = 0

    def step(self) -> float:
        """Past one more byte: ``log(R / 257)``, the reserve's mass on that byte (and what it keeps)."""
        self.lp -= LOG257
        return self.lp

    def drop(self, gone: float, top: tuple[int, ...] | None, at: int, top_lp: float = 0.0) -> float:
        """Histories of log-mass ``gone`` dropped at boundary ``at`` (``top``: the most probable of them,
        ``None``: none); returns the log-mass left out (``-inf`` when the reserve keeps it)."""
        if top is None:
            return gone
        self.last, self.last_lp, self.at = top, top_lp, at
        if not self.keeps:
            return gone
        self.lp = float(np.logaddexp(self.lp, gone))
        return -math.inf

    def reseed(self, tokens: TokenBytes, data: bytes, at: int) -> tuple[tuple[int, ...], float]:
        """The history spelling ``data[:at]`` that re-seeds the tree, and the reserve's mass it takes."""
        h, lp = self.last + tuple(tokens.greedy(data[self.at:at])), self.lp
        self.lp = -math.inf
        return h, lp


def boundary(cands: dict[tuple[int, ...], float] | None, covered: float, total: float, at: int, floor: float,
             width: int | None, top: bool, dropped: Dropped, tokens: TokenBytes, data: bytes
             ) -> tuple[list[tuple[tuple[int, ...], float]], float, float]:
    """The histories kept at boundary ``at`` (``cands``: the candidates there, ``covered``: the kept
    histories' covers of ``data[:at]``, ``total``: ``log P̂(data[:at])``; ``top``: the top rule): pruned,
    the rest to ``dropped``, and with the reserve its re-seed where nothing kept covers the prefix; with
    the log-share of the prefix mass dropped and the log-mass left out."""
    kept, gone, best = prune(cands or {}, total + floor, width, top)
    lost = dropped.drop(gone, best, at, cands[best] if best is not None else 0.0)
    if dropped.keeps and at and covered == -math.inf and dropped.lp > -math.inf:
        kept.append(dropped.reseed(tokens, data, at))
    return kept, gone - total if gone > -math.inf else -math.inf, lost


def after_prefix(r: bytes) -> bytes:
    """The smallest byte string greater than every string that starts with ``r`` (``r`` non-empty)."""
    s = r.rstrip(b"\xff")
    return s[:-1] + bytes([s[-1] + 1]) if s else b"\xff" * (len(r) + 1)


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
