"""A member as a byte-level model, one byte at a time: the one implementation that scoring
(``byteview.score_bytes``: a loop over it), generation (the ``byte`` method) and every byte row use.

**The definition.** A member is a distribution over token sequences after its start ids. Its *text*
tokens have bytes (``ByteCodec.token_bytes``); any other id (END, a special token) ends the text. The
member's byte model is the distribution this induces on byte strings. The probability that the text
starts with ``x`` is the mass of its *covers*: token sequences ``h + [v]`` where the *history* ``h``
spells a strict prefix ``x[:i]`` (``i`` is its *boundary*) and ``v`` spells the rest of ``x`` or more:

    P(x) = Σ_{i < |x|} Σ_{h spells x[:i]} P(h) · M_h(x[i:]),    M_h(r) = Σ_{text v starting with r} p(v | h).

Then ``p(b | x) = P(xb) / P(x)`` for each byte ``b`` and ``p(end | x) = Σ_{h spells x} P(h) p(not text | h) / P(x)``:
257 numbers that sum to 1. Every token sequence the vocabulary can spell counts (byte-fallback tokens,
splits the tokenizer would not make): the member's own distribution over bytes, nothing conditioned
away (Phan et al. 2025, cover encodings; Hayase et al. 2025, ByteSampler's tree of tokenizations).

**The state** after the bytes ``x`` so far (``ByteModel``):

- the *live* histories: kept histories ``h`` at a boundary ``j < |x|`` whose tokens can still spell past
  ``x`` (some token starts with ``x[j:]``), each with ``log P(h)``, its *row* (the member's next-token
  distribution after it, read once, in ``TokenBytes.sorted`` order) narrowed to the span of tokens that
  start with ``x[j:]``;
- the histories at boundary ``|x|``: candidates (made by live tokens that end exactly there), *pruned*
  when the state is next used, the kept ones' rows read then;
- per boundary so far, the kept histories' covers ``log C(x[:i])`` (``cover``), the prefix masses
  ``log P̂(x[:i])`` (``mass``: the covers and the reserve's share) and the masses left out ``log D_i``
  (``lost``).

A row is read only for a kept history at its boundary: the bytes inside a token are predicted from the
row already read (the mass of the tokens that continue with each byte). In scoring (``advance`` only),
a row is read for the tokens starting with the next byte alone (``Reads``: the member gathers them);
``next_distribution`` reads whole rows.

**Pruning** (``Pruning``): at each boundary a history is dropped when its probability is below ``keep``
times ``P̂(x[:i])`` or it is not among the ``width`` most probable there (``keep = 0``, ``width = None``:
exact, every history; exponential in the length, for tests and short strings). Where the dropped mass
``D_i`` goes is the *rule*:

- **top** (the first ``text-bytes`` run's, keep 1e-2): left out, and a boundary's most probable history always stays (``bytetree.prune``):
  ``p(x[n] | x[:n]) = P̂(x[:n+1]) / (P̂(x[:n]) − D_n)``. A row at almost every byte.
- **defer** (the default, keep 2e-3): a boundary's most probable history is read only when it holds ``keep`` of the prefix mass
  (the others below ``keep`` are left out, as with the top rule). Below that it is *deferred*: its
  mass ``S`` goes to the next symbols that no history read spells (``U``, the end among them), shared
  as its own row shares them, and its row is read only when such a symbol comes (in scoring: almost
  never; ``next_distribution`` reads it):
  ``p(b | x) = C_read(xb) / (P̂(x) − D_n)`` for ``b`` outside ``U``, ``S q(b) / q(U) / (P̂(x) − D_n)`` in
  it (``q``: the deferred history's next-symbol masses). The top rule gives ``S q(b)`` to every ``b``;
  this one moves the deferred mass from the bytes the read histories spell to those they do not, so
  the bytes the top rule keeps a row at every byte for still get at least its mass, and a row is
  read about 1.5–1.9 times per token of the member's own (docs/benchmarks.md, "Byte models: cost").
  Where nothing read or deferred stands at the boundary (the histories read are all inside tokens),
  the *fallback*: the symbols no history read spells get ``fallback`` (1e-3) of the probability, shared
  as the history dropped at the latest boundary that dropped one would continue the bytes since (its
  row read only when such a symbol comes; evenly where it spells none), the others ``1 − fallback``
  of theirs. Where even that history cannot spell the text, the byte has the smoothing's share alone
  and the state re-seeds: one history spelling the bytes so far, that history followed by the longest
  tokens spelling the rest (``TokenBytes.greedy``).
- **reserve**: it joins a pseudo-history ``R`` that gives each of the 257 next symbols ``1/257`` of
  itself, ``P̂(x[:i+1]) = C(x[:i+1]) + R_i / 257`` and ``R_{i+1} = R_i / 257 + D_{i+1}``, with the same
  re-seed (which takes ``R``'s whole mass) where no kept history covers ``x[:i]``.

Either way a prediction depends only on the bytes before it and the 257 outcomes' masses sum to what
they split: a pruned model is a distribution (a proper predictor). ``smooth`` mixes each next-symbol
distribution with the uniform one over the 257 outcomes (a byte no token of the member starts with has
no mass otherwise; exact with 0). Once a prefix has probability 0 (only a smoothed byte reaches it)
every later symbol gets ``1 / 257``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenfuse.alignment.bytetree import LOG257, Dropped, TokenBytes, boundary, logsubexp
from tokenfuse.members.reading import Take

KEEP = 2e-3  # default: a history below this share of its boundary's prefix mass is pruned (the defer rule's,
# chosen on the dev slices: docs/benchmarks.md, "Byte models: cost")
WIDTH = 1  # default: at most this many histories per boundary
SMOOTH = 1e-6  # default: this share of each next-symbol distribution is spread evenly over the 257 outcomes
RULE = "defer"  # default rule for the pruned mass
FALLBACK = 1e-3  # the defer rule: share of the next symbols no history read spells, where nothing stands at the boundary
RULES = ("top", "defer", "reserve")
END_SYMBOL = 256  # the index of the end of the text among the 257 outcomes



@dataclass(frozen=True)
class Pruning:
    """A byte model's pruning (the module docstring): ``keep``, ``width``, the ``rule`` for the dropped
    mass, ``smooth`` and (the defer rule) ``fallback``. The same names in code, config (``params`` of the ``byte`` method) and
    ``tokenfuse score --bytes`` flags."""

    keep: float = KEEP
    width: int | None = WIDTH
    rule: str = RULE
    smooth: float = SMOOTH
    fallback: float = FALLBACK

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"rule: expected one of {', '.join(RULES)}, got {self.rule!r}")
        if not 0 <= self.keep < 1:
            raise ValueError(f"keep: expected 0 <= keep < 1, got {self.keep!r}")
        if self.width is not None and self.width < 1:
            raise ValueError(f"width: expected a positive number or none, got {self.width!r}")
        if not 0 <= self.smooth < 1:
            raise ValueError(f"smooth: expected 0 <= smooth < 1, got {self.smooth!r}")
        if not 0 <= self.fallback < 1:
            raise ValueError(f"fallback: expected 0 <= fallback < 1, got {self.fallback!r}")

    @property
    def floor(self) -> float:
        return math.log(self.keep) if self.keep > 0 else -math.inf


def smoothed(logprobs: np.ndarray, smooth: float) -> np.ndarray:
    """``log((1 − smooth) p + smooth / 257)`` of each ``log p``."""
    if smooth <= 0:
        return logprobs
    return np.logaddexp(math.log1p(-smooth) + logprobs, math.log(smooth / 257))


def next_byte_sums(p: np.ndarray, col: np.ndarray, present: bool = False):
    """``out[c]``: the sum of ``p`` over the entries whose ``col`` is ``c`` (``col`` non-decreasing,
    ``-1`` entries left out), for the 256 bytes; with ``present``, also ``bool[256]``: which bytes
    some entry has (whatever its mass)."""
    starts = np.searchsorted(col, np.arange(257))
    out = np.zeros(256)
    some = starts[:-1] < starts[1:]
    if some.any():
        out[some] = np.add.reduceat(p, starts[:-1][some])
    return (out, some) if present else out


class Reads:
    """How a byte model gets its rows: ``take`` after ``start`` plus each history. ``read`` gets, for
    the histories ``hs`` at boundary ``at`` (log-probabilities ``lps``), the entries ``ids``; ``span``:
    those ids are ``tokens.order[span[0]:span[1]]`` (the tokens starting with the byte after ``at``),
    ``None``: a whole row or the ids that are not text. A subclass may serve them from rows it read
    ahead (``byteview.Lookahead``): the numbers do not depend on it."""

    def __init__(self, start: Sequence[int], take: Take) -> None:
        self.start, self.take = list(start), take

    def read(self, hs: list[tuple[int, ...]], at: int, lps: list[float], ids: np.ndarray,
             span: tuple[int, int] | None) -> list[np.ndarray]:
        return self.take([self.start + list(h) for h in hs], [ids] * len(hs))


class _History:
    """A kept history: its ids after the start, its boundary ``at``, ``lp = log P(h)``, and (once read)
    its row's log-probabilities and probabilities over the span ``[lo, hi)`` of sorted positions (the
    tokens that start with the bytes after ``at``); ``end``: its mass on ids that are not text
    (``None``: not read)."""

    __slots__ = ("ids", "at", "lp", "lo", "hi", "logrow", "p", "end")

    def __init__(self, ids: tuple[int, ...], at: int, lp: float) -> None:
        self.ids, self.at, self.lp = ids, at, lp
        self.lo = self.hi = 0
        self.logrow: np.ndarray | None = None
        self.p: np.ndarray | None = None
        self.end: float | None = None

    def fill(self, entries: np.ndarray, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.logrow = np.asarray(entries[: hi - lo], dtype=np.float64)
        self.p = np.exp(self.logrow)

    def narrow(self, a: int, b: int) -> None:
        """Keep the span ``[a, b)`` (copied once it is much smaller, so the whole row can go)."""
        sub = slice(a - self.lo, b - self.lo)
        small = 4 * (b - a) < len(self.p)
        self.logrow = self.logrow[sub].copy() if small else self.logrow[sub]
        self.p = self.p[sub].copy() if small else self.p[sub]
        self.lo, self.hi = a, b


class ByteModel:
    """One member's byte model after the bytes so far (the module docstring).

    Args:
        tokens: the member's text tokens by their bytes (``TokenBytes``, shared by its models).
        start: the ids every history follows (the start ids, or a prompt's ids).
        take: the member's rows (``Take``); or ``reads``, a ``Reads`` that serves them.
        pruning: ``keep``, ``width``, ``rule`` and ``smooth``.
    """

    def __init__(self, tokens: TokenBytes, start: Sequence[int], take: Take | None = None,
                 pruning: Pruning = Pruning(), *, reads: Reads | None = None) -> None:
        if reads is None:
            if take is None:
                raise ValueError("ByteModel: give take or reads")
            reads = Reads(start, take)
        self.tokens, self.reads, self.pruning = tokens, reads, pruning
        self.start = list(start)
        self.floor = pruning.floor
        self.data = bytearray()
        self.cover = [0.0]  # log C(x[:i]): the kept histories' covers, for every boundary so far
        self.mass = [0.0]  # log P̂(x[:i]): and the reserve's share
        self.lost = [-math.inf]  # log D_i: the mass left out at boundary i
        self.dropped = Dropped(pruning.rule == "reserve")
        self.live: list[_History] = []  # at boundaries before len(data), rows read
        self.kept: list[_History] = []  # at boundary len(data), once pruned
        self.cands: dict[tuple[int, ...], float] | None = {(): 0.0}  # at boundary len(data), not yet pruned
        self.deferred: _History | None = None  # at boundary len(data) (the defer rule), row read when needed
        self._fallback: _History | None = None  # the history the fallback continues (row read when needed)
        self.rows = 0  # rows read (a history's, once)
        self.deferrals = 0  # symbols that only a deferred history spelled (its row read then)
        self.reseeds = 0  # bytes that nothing kept spelled (the defer rule re-seeds after them)
        self.share = -math.inf  # the largest log-share of a boundary's prefix mass pruning dropped

    def __len__(self) -> int:
        return len(self.data)

    def fork(self) -> ByteModel:
        """An independent model after the same bytes, sharing the rows read so far (never read again, and
        never changed in place) and the reads: a context's model continued by each of several
        continuations gives each the numbers of a model of the whole text (the model is causal)."""
        new = copy.copy(self)
        new.data, new.cover, new.mass, new.lost = bytearray(self.data), list(self.cover), list(self.mass), list(self.lost)
        new.dropped = copy.copy(self.dropped)
        new.live, new.kept = [copy.copy(h) for h in self.live], [copy.copy(h) for h in self.kept]
        new.cands = None if self.cands is None else dict(self.cands)
        new.deferred, new._fallback = copy.copy(self.deferred), copy.copy(self._fallback)
        return new

    @property
    def pending(self) -> bool:
        """The next ``next_distribution`` reads rows first."""
        if self.cands is not None:
            return bool(self.cands) or (self.pruning.rule == "reserve" and self.cover[-1] == -math.inf
                                        < self.dropped.lp)
        return any(h.logrow is None or h.end is None for h in self.kept + ([self.deferred] if self.deferred else []))

    @property
    def pruned(self) -> float:
        """The largest share of a boundary's prefix mass that pruning dropped."""
        return math.exp(self.share)

    # ------------------------------------------------------------------ boundaries
    def _settle(self) -> None:
        """Prune the candidates at the current boundary (their rows are read when first needed)."""
        if self.cands is None:
            return
        n = len(self.data)
        if self.mass[n] > -math.inf:
            rule = self.pruning.rule
            kept, gone, self.lost[n] = boundary(self.cands, self.cover[n], self.mass[n], n, self.floor,
                                                self.pruning.width, rule == "top", self.dropped,
                                                self.tokens, bytes(self.data))
            self.share = max(self.share, gone)
            self.kept = [_History(h, n, lp) for h, lp in kept]
            if rule == "defer" and not kept and self.cands:  # the most probable one, deferred
                h, lp = min(self.cands.items(), key=lambda kv: (-kv[1], kv[0]))
                self.deferred = _History(h, n, lp)
                self.lost[n] = logsubexp(self.lost[n], lp)
        self.cands = None

    def _read(self, hs: list[_History], whole: bool, byte: int | None = None) -> None:
        """Read the rows of ``hs`` that lack them: whole (every text token, then the other ids), or only
        the tokens starting with ``byte``; with ``byte=None`` and not ``whole``, the other ids only
        (``end``)."""
        tb, n = self.tokens, len(self.data)
        if whole:
            todo = [h for h in hs if h.logrow is None or h.end is None or (h.lo, h.hi) != (0, tb.text)]
            ids, span = tb.row_ids, None
        elif byte is not None:
            todo = [h for h in hs if h.logrow is None]
            span = tb.span(bytes([byte]))
            ids = tb.order[span[0]:span[1]]
            if span[0] == span[1]:  # no token starts with the byte: nothing to read
                for h in todo:
                    h.fill(np.zeros(0), *span)
                return
        else:
            todo = [h for h in hs if h.end is None]
            ids, span = tb.other, None
        if not todo:
            return
        got = self.reads.read([h.ids for h in todo], n, [h.lp for h in todo], ids, span)
        self.rows += sum(h.logrow is None and h.end is None for h in todo)
        for h, r in zip(todo, got):
            r = np.asarray(r, dtype=np.float64)
            if whole:
                h.fill(r, 0, tb.text)
                h.end = float(np.exp(r[tb.text:]).sum())
            elif byte is not None:
                h.fill(r, *span)
            else:
                h.end = float(np.exp(r).sum())

    # ------------------------------------------------------------------ the next symbol
    def next_distribution(self) -> np.ndarray:
        """``float64[257]``: the natural-log probability of each next byte and (``END_SYMBOL``) of the end."""
        self._settle()
        self._read(self.kept, whole=True)
        n = len(self.data)
        mass = self.mass[n]
        if mass == -math.inf:  # past a byte only the smoothing reached: uniform
            return np.full(257, -LOG257)
        acc = np.full(257, math.exp(self.dropped.lp - LOG257 - mass))
        spelled = np.zeros(257, dtype=bool)
        for h in self.live + self.kept:
            w = math.exp(h.lp - mass)
            sums, some = next_byte_sums(h.p, self.tokens.column(n - h.at, h.lo, h.hi), present=True)
            acc[:256] += w * sums
            spelled[:256] |= some
            if h.at == n:
                acc[END_SYMBOL] += w * h.end
                spelled[END_SYMBOL] = True
        if self.deferred is not None:
            acc[~spelled] += math.exp(self.deferred.lp - mass) * self._shares(self.deferred, ~spelled)
        p = acc * math.exp(mass - logsubexp(mass, self.lost[n]))
        if self._falls_back():
            p *= 1 - self.pruning.fallback
            p[~spelled] += self.pruning.fallback * self._shares(self._fallback_history(), ~spelled)
        with np.errstate(divide="ignore"):
            return smoothed(np.log(p), self.pruning.smooth)

    def _falls_back(self) -> bool:
        """The defer rule's fallback applies: nothing read or deferred stands at the current boundary."""
        return self.pruning.rule == "defer" and self.pruning.fallback > 0 and self.deferred is None and not self.kept

    def _shares(self, h: _History, unspelled: np.ndarray) -> np.ndarray:
        """How history ``h`` shares a mass among the next symbols ``unspelled`` (a mask over the 257): as
        its row continues the bytes since its boundary (``q(b) / q(U)``; its row read whole), evenly
        where it spells none of them. The deferred history's (at the boundary) and the fallback's."""
        self._read([h], whole=True)
        n = len(self.data)
        a, b = self.tokens.span(bytes(self.data[h.at:]), h.lo, h.hi) if n > h.at else (h.lo, h.hi)
        q = np.zeros(257)
        if a < b:
            q[:256] = next_byte_sums(h.p[a - h.lo:b - h.lo], self.tokens.column(n - h.at, a, b))
        if n == h.at:
            q[END_SYMBOL] = h.end
        q = q[unspelled]
        total = q.sum()
        return q / total if total > 0 else np.full(len(q), 1 / len(q))

    def _fallback_history(self) -> _History:
        if self._fallback is None or self._fallback.ids != self.dropped.last:
            self._fallback = _History(self.dropped.last, self.dropped.at, self.dropped.last_lp)
        return self._fallback

    def end_logprob(self) -> float:
        """``log p(end | x)`` alone (the ids that are not text of the histories kept at ``|x|``)."""
        self._settle()
        n = len(self.data)
        if self.mass[n] == -math.inf:
            return -LOG257
        if self.deferred is not None or self._falls_back():  # nothing read stands at |x|: a deferred or fallback end
            return float(self.next_distribution()[END_SYMBOL])
        self._read(self.kept, whole=False)
        ends = [h.lp + math.log(h.end) if h.end > 0 else -math.inf for h in self.kept]
        raw = np.logaddexp.reduce(np.array(ends + [self.dropped.lp - LOG257]))
        return float(smoothed(np.array([raw - logsubexp(self.mass[n], self.lost[n])]), self.pruning.smooth)[0])

    def advance(self, byte: int) -> float:
        """Append one byte; returns its natural-log probability given the bytes before it (what
        ``next_distribution()[byte]`` gives, reading only the rows' entries of the tokens that start
        with it, and a deferred or fallback history's row only if no history read spells it)."""
        if not 0 <= byte < 256:
            raise ValueError(f"byte: expected 0..255, got {byte!r}")
        self._settle()
        self._read(self.kept, whole=False, byte=byte)
        n = len(self.data)
        was, lost = self.mass[n], self.lost[n]
        falls_back = self._falls_back()
        hs = self.live + self.kept
        spans = [self.tokens.span(bytes(self.data[h.at:]) + bytes([byte]), h.lo, h.hi) for h in hs]
        given = None  # the byte's probability where no history read spells it (a deferred or fallback history's)
        if not any(a < b for a, b in spans) and (self.deferred is not None or falls_back):
            unspelled = self._unspelled(n)
            k = int(np.count_nonzero(unspelled[:byte]))
            if self.deferred is not None:
                share = float(self._shares(self.deferred, unspelled)[k])
                given = math.exp(self.deferred.lp - logsubexp(was, lost)) * share
                h = self.deferred
            else:
                given = self.pruning.fallback * float(self._shares(self._fallback_history(), unspelled)[k])
                h = self._fallback
            self.deferrals += 1
            hs, spans = [h], [self.tokens.span(bytes(self.data[h.at:]) + bytes([byte]), h.lo, h.hi)]
            self._fallback = None
        self.deferred = None
        self.data.append(byte)
        covers: list[float] = []
        cands: dict[tuple[int, ...], float] = {}
        live = []
        for h, (a, b) in zip(hs, spans):
            if a >= b:
                continue
            r = bytes(self.data[h.at:])
            m = float(h.p[a - h.lo:b - h.lo].sum())
            if m > 0:
                covers.append(h.lp + math.log(m))
            exact = self.tokens.exact.get(r, ())
            for q, t in enumerate(exact):  # they sort first in the span
                cands[h.ids + (t,)] = h.lp + float(h.logrow[a - h.lo + q])
            if b - a > len(exact):  # some token spells further
                h.narrow(a, b)
                live.append(h)
        self.live, self.kept = live, []
        cover = float(np.logaddexp.reduce(np.array(covers))) if covers else -math.inf
        mass = float(np.logaddexp(cover, self.dropped.step()))
        if given is not None:
            lp = math.log(given) if given > 0 else -math.inf
        else:
            lp = mass - logsubexp(was, lost) if was > -math.inf else -math.inf
            if falls_back:
                lp += math.log1p(-self.pruning.fallback)
        if cover == -math.inf and was > -math.inf and self.pruning.rule == "defer":  # nothing spells it: re-seed
            h, _ = self.dropped.reseed(self.tokens, bytes(self.data), n + 1)
            cover = mass = was - LOG257  # any finite mass: only ratios of masses after it count
            cands = {h: mass}
            self.reseeds += 1
        self.cover.append(cover)
        self.mass.append(mass)
        self.lost.append(-math.inf)
        self.cands = cands
        if was == -math.inf:  # past a byte only the smoothing reached: uniform
            return -LOG257
        return float(smoothed(np.array([lp]), self.pruning.smooth)[0])

    def _unspelled(self, n: int) -> np.ndarray:
        """``bool[257]``: the next symbols after ``data[:n]`` that no history read spells (the end: no
        history read stands at ``n``)."""
        spelled = np.zeros(257, dtype=bool)
        for h in self.live + self.kept:
            if h.at == n:
                return ~np.ones(257, dtype=bool)  # (a read history at n spells every byte a token starts with)
            col = self.tokens.column(n - h.at, h.lo, h.hi)
            spelled[:256] |= next_byte_sums(h.p, col, present=True)[1]
        return ~spelled
