"""A member's byte-level model one byte at a time: the state that byte-level generation advances.

``ByteState`` is ``byteview.score_bytes`` made incremental (the definition, the pruning and the smoothing
are that module's, to the rounding): after the bytes ``x`` so far it holds

- the *live* histories: every kept token sequence ``h`` spelling a prefix ``x[:j]`` whose tokens can
  still spell past ``x`` (some token starts with ``x[j:]``), each with ``log P(h)``, its row (the
  member's next-token distribution after it, read once, in ``TokenBytes.sorted`` order) and the span of
  that row's tokens that start with ``x[j:]``, narrowed byte by byte; a history whose span holds
  nothing longer than ``x[j:]`` is dropped;
- the candidates at boundary ``|x|`` (histories spelling all of ``x``, made by the live ones' tokens
  that end exactly there), pruned and read when the next symbol's distribution is first asked for;
- the reserve (``byteview.Reserve``: with the reserve rule, the mass pruning dropped and where it
  re-seeds from);
- the kept histories' covers ``log C(x[:i])``, the prefix masses ``log P̂(x[:i])`` (the covers and the
  reserve's share) and the masses left out ``log D_i`` (the top rule) of every boundary so far.

``next_distribution()`` gives the 257 natural-log probabilities of the next symbol (bytes 0..255 and
``END_SYMBOL``): ``p(b | x) = (C(xb) + R / 257) / (P̂(x) − D_n)`` with ``C(xb)`` summed over the live
histories' tokens that start with ``x[j:] + b``, and ``p(end | x)`` the kept histories at ``|x|`` times
their mass on ids that are not text (and the reserve's ``1/257``); they sum to 1 (smoothed: ``(1 −
smooth) p + smooth / 257``). So the probability the state gives a byte string, symbol by symbol, is
``score_bytes``'s. ``advance(b)`` appends one byte. Once a prefix has probability 0 (only a smoothed
byte reaches it) every later symbol gets ``smooth / 257``, as in ``score_bytes``.

Rows are read through ``take(lists, ids)`` (``byteview.Take``), whole (every text token, then the
ids that are not text), one call per boundary for the histories kept there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tokenfuse.alignment.bytetree import LOG257, Reserve, TokenBytes, boundary
from tokenfuse.alignment.byteview import KEEP, SMOOTH, WIDTH, Take, _logsubexp, _smoothed

END_SYMBOL = 256  # the index of the end of the text among the 257 outcomes
DEPTH = 16  # ``ByteTable`` keeps the first this many bytes of every token as columns


class ByteTable:
    """A member's text tokens (``TokenBytes``) as generation reads them: the ids of a whole row (text
    tokens in sorted order, then the others), and the byte of every token at each depth (``-1`` past
    its end), so that the tokens of a span starting with a prefix split by their next byte with one
    search. Built once per member, shared by its states."""

    def __init__(self, tokens: TokenBytes) -> None:
        self.tokens = tokens
        self.text = len(tokens.sorted)
        self.ids = np.concatenate([tokens.order, tokens.other]).astype(np.int64)
        lens = np.fromiter((len(b) for b in tokens.sorted), dtype=np.int64, count=self.text)
        flat = b"".join(b[:DEPTH].ljust(DEPTH, b"\0") for b in tokens.sorted)
        mat = np.frombuffer(flat, dtype=np.uint8).reshape(self.text, DEPTH).astype(np.int16)
        mat[np.arange(DEPTH)[None, :] >= lens[:, None]] = -1
        self.cols = np.ascontiguousarray(mat.T)  # [DEPTH, text]: one depth's bytes contiguous

    def column(self, depth: int, lo: int, hi: int) -> np.ndarray:
        """The byte at ``depth`` of the tokens at ``sorted[lo:hi]`` (``-1``: shorter), non-decreasing
        where they share their first ``depth`` bytes."""
        if depth < DEPTH:
            return self.cols[depth, lo:hi]
        return np.fromiter((b[depth] if len(b) > depth else -1 for b in self.tokens.sorted[lo:hi]),
                           dtype=np.int16, count=hi - lo)


def next_byte_sums(p: np.ndarray, col: np.ndarray) -> np.ndarray:
    """``out[c]``: the sum of ``p`` over the entries whose ``col`` is ``c`` (``col`` non-decreasing,
    ``-1`` entries left out), for the 256 bytes."""
    starts = np.searchsorted(col, np.arange(257))
    out = np.zeros(256)
    some = starts[:-1] < starts[1:]
    if some.any():
        out[some] = np.add.reduceat(p, starts[:-1][some])
    return out


class _History:
    """A kept history: its ids after the start, its boundary ``at``, ``lp = log P(h)``, and its row's
    log-probabilities and probabilities over the span ``[lo, hi)`` of sorted positions (the tokens
    that start with the bytes after ``at``); ``end``: its mass on ids that are not text."""

    __slots__ = ("ids", "at", "lp", "lo", "hi", "logrow", "p", "end")

    def __init__(self, ids: tuple[int, ...], at: int, lp: float, entries: np.ndarray, text: int) -> None:
        self.ids, self.at, self.lp = ids, at, lp
        self.lo, self.hi = 0, text
        self.logrow = entries[:text]
        self.p = np.exp(self.logrow)
        self.end = float(np.exp(entries[text:]).sum())

    def narrow(self, a: int, b: int) -> None:
        """Keep the span ``[a, b)`` (copied once it is much smaller, so the whole row can go)."""
        sub = slice(a - self.lo, b - self.lo)
        small = 4 * (b - a) < len(self.p)
        self.logrow = self.logrow[sub].copy() if small else self.logrow[sub]
        self.p = self.p[sub].copy() if small else self.p[sub]
        self.lo, self.hi = a, b


class ByteState:
    """One member's byte-level model after the bytes so far (the module docstring).

    Args:
        table: the member's ``ByteTable``.
        start: the ids every history follows (the start ids, or a prompt's ids).
        take: the member's rows (``byteview.Take``).
        keep, width, smooth, reserve: the pruning, smoothing and rule of ``score_bytes``.
    """

    def __init__(self, table: ByteTable, start: Sequence[int], take: Take, *, keep: float = KEEP,
                 width: int | None = WIDTH, smooth: float = SMOOTH, reserve: bool = False) -> None:
        self.table, self.tokens = table, table.tokens
        self.start, self.take = list(start), take
        self.width, self.smooth = width, smooth
        self.floor = math.log(keep) if keep > 0 else -math.inf
        self.data = bytearray()
        self.covered = [0.0]  # log C(x[:i]): the kept histories' covers, for every boundary so far
        self.prefix = [0.0]  # log P̂(x[:i]): and the reserve's share
        self.lost = [-math.inf]  # log D_i: the mass left out at boundary i (the top rule)
        self.reserve = Reserve(reserve)
        self.live: list[_History] = []
        self.cands: dict[tuple[int, ...], float] = {(): 0.0}  # at boundary len(data), not yet pruned
        self.settled = False
        self.histories = 0  # rows read

    def __len__(self) -> int:
        return len(self.data)

    @property
    def pending(self) -> bool:
        """The next ``next_distribution`` reads rows first (candidates at this boundary not yet pruned)."""
        return not self.settled and (bool(self.cands) or (self.covered[-1] == -math.inf < self.reserve.lp))

    def _settle(self) -> None:
        """Prune the candidates at the current boundary and read the kept ones' rows."""
        if self.settled:
            return
        n = len(self.data)
        if self.prefix[n] > -math.inf:
            kept, _, self.lost[n] = boundary(self.cands, self.covered[n], self.prefix[n], n, self.floor, self.width,
                                             self.reserve, self.tokens, bytes(self.data))
            if kept:
                rows = self.take([self.start + list(h) for h, _ in kept], [self.table.ids] * len(kept))
                self.histories += len(kept)
                self.live += [_History(h, n, lp, np.asarray(r, dtype=np.float64), self.table.text)
                              for (h, lp), r in zip(kept, rows)]
        self.cands = {}
        self.settled = True

    def next_distribution(self) -> np.ndarray:
        """``float64[257]``: the natural-log probability of each next byte and (``END_SYMBOL``) of the end."""
        self._settle()
        n = len(self.data)
        mass = self.prefix[n]
        if mass == -math.inf:
            return _smoothed(np.full(257, -math.inf), self.smooth)
        acc = np.full(257, math.exp(self.reserve.lp - LOG257 - mass))
        for h in self.live:
            w = math.exp(h.lp - mass)
            d = n - h.at
            acc[:256] += w * next_byte_sums(h.p, self.table.column(d, h.lo, h.hi))
            if d == 0:
                acc[END_SYMBOL] += w * h.end
        with np.errstate(divide="ignore"):
            out = np.log(acc) - (_logsubexp(mass, self.lost[n]) - mass)
        return _smoothed(out, self.smooth)

    def advance(self, byte: int) -> None:
        """Append one byte: the live histories' covers of the longer prefix, their tokens that end
        there (the next boundary's candidates), and those that can still spell further."""
        if not 0 <= byte < 256:
            raise ValueError(f"byte: expected 0..255, got {byte!r}")
        self._settle()
        self.data.append(byte)
        covers: list[float] = []
        cands: dict[tuple[int, ...], float] = {}
        live = []
        for h in self.live:
            r = bytes(self.data[h.at:])
            a, b = self.tokens.span(r, h.lo, h.hi)
            if a >= b:
                continue
            m = float(h.p[a - h.lo:b - h.lo].sum())
            if m > 0:
                covers.append(h.lp + math.log(m))
            exact = self.tokens.exact.get(r, ())
            for q, t in enumerate(exact):  # they sort first in the span
                cands[h.ids + (t,)] = h.lp + float(h.logrow[a - h.lo + q])
            if b - a > len(exact):  # some token spells further
                h.narrow(a, b)
                live.append(h)
        self.live = live
        self.covered.append(float(np.logaddexp.reduce(np.array(covers))) if covers else -math.inf)
        self.prefix.append(float(np.logaddexp(self.covered[-1], self.reserve.step())))
        self.lost.append(-math.inf)
        self.cands = cands
        self.settled = False  # the new boundary is pruned when it is first asked for
