"""A member as a byte-level language model: its probability of each next byte, summed over tokenizations.

**The definition.** A member is a distribution over token sequences after its start ids. Its *text*
tokens have bytes (``ByteCodec.token_bytes``); any other id (END, a special token) ends the text. The
member's byte-level model is the distribution this induces on byte strings. The probability that the
text starts with ``x`` is the mass of its *covers*: token sequences ``h + [v]`` where ``h`` spells a
strict prefix ``x[:i]`` and ``v`` spells the rest of ``x`` or more:

    P(x) = Σ_{i < |x|} Σ_{h spells x[:i]} P(h) · M_h(x[i:]),    M_h(r) = Σ_{text v starting with r} p(v | h).

Then ``p(b | x) = P(xb) / P(x)`` for each byte ``b`` and ``p(end | x) = Σ_{h spells x} P(h) p(not text | h) / P(x)``:
257 numbers that sum to 1. Every token sequence the vocabulary can spell counts (byte-fallback tokens,
splits the tokenizer would not make): this is the member's own distribution over bytes, nothing
conditioned away. (Phan et al. 2025, "Exact byte-level probabilities from tokenized language models",
cover encodings; Hayase et al. 2025, ByteSampler, the tree of live tokenizations.)

**The computation.** The histories spelling ``x[:i]`` are grown boundary by boundary along the bytes: a
history at boundary ``i`` adds its covers to ``P(x[:i+d])`` for every ``d`` that some token starting with
``x[i:i+d]`` reaches, and each token spelling exactly ``x[i:i+d]`` makes a history at ``i + d``. A history
needs one row of the member (its next-token distribution), of which only the entries of the tokens
starting with the byte ``x[i]`` are read (``take``: the backend gathers them where it computes the row).

``keep = 0`` and ``width = None`` are exact (every history; exponential in the length, for tests and
short strings). By default the tree is pruned at each boundary: a history is dropped when its
probability is below ``keep`` times ``P̂(x[:i])`` or it is not among the ``width`` most probable there.
Where the dropped mass ``D_i`` goes is the rule (``Reserve``):

- **top** (``reserve=False``, the default): it is left out, and a boundary's most probable history
  always stays (``prune``): ``p(x[n] | x[:n]) = P̂(x[:n+1]) / (P̂(x[:n]) − D_n)``, with ``P̂`` the kept
  histories' covers (``D_n`` is exactly what the 257 outcomes' sum lacks). A row at almost every byte.
- **reserve** (``reserve=True``): it joins a pseudo-history ``R`` that gives each of the 257 next
  symbols ``1/257`` of itself, ``P̂(x[:i+1]) = C(x[:i+1]) + R_i / 257`` and ``R_{i+1} = R_i / 257 +
  D_{i+1}`` (``C``: the kept histories' covers), ``p(x[n] | x[:n]) = P̂(x[:n+1]) / P̂(x[:n])``. Where no
  kept history covers ``x[:i]`` (the covers of longer tokens all missed a byte) the reserve re-seeds
  the tree: its whole mass goes to one history spelling ``x[:i]``, the most probable one dropped at the
  latest boundary ``j`` that dropped one followed by the longest tokens spelling ``x[j:i]``
  (``TokenBytes.greedy``; a byte no token of the member starts with left out). Rows only where a
  history holds ``keep`` of its boundary's mass: a third to two thirds as many on dev text, at 0.4–1.8 %
  more bits (docs/benchmarks.md, "Byte-level views").

Either way the view depends only on the bytes before ``n`` and the 257 outcomes' masses sum to what
they split: a pruned view is a distribution (a proper predictor). For a trained member almost all the
mass lies on its own tokenization, which the member's ``chain`` (its own tokens of the text, computed
in one run) serves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tokenfuse.alignment.bytetree import LOG257, Reserve, TokenBytes, Tree, boundary, spans

KEEP = 1e-2  # default: a history below this share of its boundary's prefix mass is dropped (chosen on dev
# text, docs/benchmarks.md "Byte-level views": bits against rows read)
WIDTH = 1  # default: at most this many histories per boundary
LOOK = 256  # ``score_bytes``: at most this many chain tokens read ahead after a history off it
SPECULATE = 256  # ``score_bytes``: bytes the tree is grown ahead on the rows read, to gather the rows it will want
SMOOTH = 1e-6  # default: this share of each next-symbol distribution is spread evenly over the 257 outcomes

Take = Callable[[list[list[int]], list[np.ndarray]], list[np.ndarray]]
"""``take(lists, ids)``: the member's next-token natural-log probabilities of ``ids[j]`` after ``lists[j]``
(start ids included), float64 arrays."""


@dataclass
class ByteScore:
    """``logprobs[n]``: the natural-log probability of byte ``n`` given the bytes before it;
    ``end``: of the text ending after the last byte (computed with ``score_bytes(..., end=True)``);
    ``histories``: the rows read; ``pruned``: the largest share of a boundary's prefix mass that
    pruning left out; ``chain``: the member's log-probability of each of its own tokens (with ``chain``:
    the member alone on its tokens, read from the same rows)."""

    logprobs: np.ndarray
    end: float | None = None
    histories: int = 0
    pruned: float = 0.0
    chain: np.ndarray | None = None


def _logsubexp(a: float, b: float) -> float:
    """``log(exp(a) − exp(b))`` for ``b ≤ a`` (``-inf`` when they are equal)."""
    if b == -math.inf:
        return a
    return a + math.log1p(-min(1.0, math.exp(b - a)))


def _spelled(token_bytes: Sequence[bytes | None], path: Sequence[int], data: bytes, at: int = 0) -> list[int]:
    """Where each prefix of ``path`` that spells ``data[at:]`` up to a point strictly before its end ends
    (``at`` for the empty one)."""
    out, pos = [at], at
    for t in path:
        b = token_bytes[t] or b""
        if not b or data[pos:pos + len(b)] != b or pos + len(b) >= len(data):
            break
        pos += len(b)
        out.append(pos)
    return out


class _Reads:
    """``score_bytes``'s rows by history (``cache``), read ahead along paths: a path (a history and the
    member's own tokens of the bytes after it) is read in one ``take``, then (``prefetch``) the
    histories one token off it that pruning could keep (``_branches``) in one more."""

    def __init__(self, data: bytes, tokens: TokenBytes, start: list[int], take: Take, first: list[tuple[int, int]],
                 floor: float, width: int | None, prefetch: bool, top: bool) -> None:
        self.data, self.tokens, self.start, self.take, self.first = data, tokens, start, take, first
        self.floor, self.width, self.prefetch, self.top = floor, width, prefetch, top
        self.cache: dict[tuple[int, ...], np.ndarray] = {}
        self.window = 8  # chain tokens the next path off the chain reads ahead
        self.ahead: list[tuple[int, ...]] = []  # the histories the last such path read

    def read(self, hs: list[tuple[int, ...]], ats: list[int]) -> None:
        """The rows of the histories ``hs`` not read yet (``ats``: their boundaries)."""
        todo = [(h, at) for h, at in zip(hs, ats) if h not in self.cache]
        if todo:
            rows = self.take([self.start + list(h) for h, _ in todo],
                             [self.tokens.order[slice(*self.first[at])] for _, at in todo])
            self.cache.update(zip((h for h, _ in todo), rows))

    def follow(self, h: tuple[int, ...], lp: float, at: int, path: Sequence[int]) -> None:
        """The first ``window`` tokens of ``path`` after a history off the chain: the window doubles (up
        to ``LOOK``) while the last such path's histories were all used, and falls back to 8 when they
        were not (reading ahead past where the tree leaves a path reads rows no boundary keeps)."""
        if self.ahead:
            used = all(x not in self.cache for x in self.ahead)
            self.window = min(2 * self.window, LOOK) if used else 8
        self.path(h, lp, at, path[: self.window])
        self.ahead = [h + tuple(path[:k]) for k in range(min(len(path), self.window))]

    def path(self, h: tuple[int, ...], lp: float, at: int, path: Sequence[int]) -> np.ndarray:
        """Read ``h + path[:k]`` for each ``k`` that ends before the data does (``h``: log-probability
        ``lp``, at boundary ``at``); returns the log-probability of each ``path[k]`` after it."""
        tb = self.tokens.token_bytes
        ends = _spelled(tb, path, self.data, at)
        pre = [h + tuple(path[:k]) for k in range(len(ends))]
        self.read(pre, ends)
        own = np.array([self.cache[x][self.tokens.rank[path[k]] - self.first[ends[k]][0]]
                        for k, x in enumerate(pre) if k < len(path)])
        if self.prefetch:
            lps = lp + np.concatenate([[0.0], np.cumsum(own)])[: len(pre)]
            ahead = _branches(self.data, self.tokens, pre, ends, lps, self.cache, self.first, self.floor, self.width,
                              self.top)
            self.read(list(ahead), list(ahead.values()))
        return own


def score_bytes(data: bytes, tokens: TokenBytes, start: Sequence[int], take: Take, *,
                chain: Sequence[int] = (), keep: float = KEEP, width: int | None = WIDTH,
                smooth: float = SMOOTH, end: bool = False, prefetch: bool = True, reserve: bool = False,
                speculate: int = SPECULATE) -> ByteScore:
    """The member's byte-level probability of each byte of ``data`` given the bytes before it (the
    module docstring). ``chain``: the member's own tokens of ``data``, whose histories are read in one
    ``take`` first (a cache: the numbers do not depend on it). ``smooth``: each next-symbol distribution
    mixed with the uniform one over the 256 bytes and the end at this weight (a byte that no token of the
    member starts with has no mass otherwise; exact with 0). ``end``: also ``p(end | data)``. ``prefetch``: with ``chain``, the
    histories one token off it that can be kept (``_branches``) are read in one more ``take`` (a
    backend's shared calls; a cache again), and where a kept history that was not read yet stands at
    a boundary of the chain, the chain's next tokens after it are read ahead the same way (``window``
    of them: ``_Reads.follow``): a member's best history can leave its own tokens and
    follow them again shifted (`` Reason`` + ``ing`` for `` Reasoning``). ``speculate``: where a kept
    history's row is missing, the tree is grown ``speculate`` bytes ahead on the rows read so far and
    every row it then lacks is read in the same ``take`` (``_speculate``; a cache too, 0: off).
    ``reserve``: the rule for the dropped mass (the module docstring)."""
    n_bytes = len(data)
    if n_bytes == 0 and not end:
        return ByteScore(np.zeros(0))
    start = list(start)
    first = [tokens.span(data[i:i + 1]) for i in range(n_bytes)]
    floor = math.log(keep) if keep > 0 else -math.inf
    reads = _Reads(data, tokens, start, take, first, floor, width, prefetch, not reserve)
    cache = reads.cache
    own = reads.path((), 0.0, 0, chain) if chain and n_bytes else None
    at_chain = {at: j for j, at in enumerate(_spelled(tokens.token_bytes, chain, data))} if prefetch and chain else {}
    tree = Tree.new(n_bytes, reserve)
    read = 0
    for i in range(n_bytes):
        kept = tree.boundary(i, floor, width, tokens, data)
        lo, hi = first[i]
        if i in at_chain:  # a kept history off the paths read, where a chain token starts: the chain's rest follows it
            for h, lp in kept:
                if h not in cache:
                    reads.follow(h, lp, i, chain[at_chain[i]:at_chain[i] + LOOK])
        if speculate and any(h not in cache for h, _ in kept):
            reads.read(*_speculate(tree, i, kept, cache, first, floor, width, tokens, data, speculate))
        reads.read([h for h, _ in kept], [i] * len(kept))
        for h, lp in kept:
            entries = cache.pop(h)
            read += 1
            tree.grow(data, i, h, lp, entries, lo, hi, tokens)
    cache.clear()
    total, lost, res = tree.total, tree.lost, tree.res
    if n_bytes:
        total[n_bytes] = np.logaddexp(tree.prefix[n_bytes], res.step())
    out = np.empty(n_bytes)
    for n in range(n_bytes):  # once a prefix has probability 0, so have its bytes
        out[n] = total[n + 1] - _logsubexp(total[n], lost[n]) if total[n] > -math.inf else -math.inf
    score = ByteScore(_smoothed(out, smooth), histories=read, pruned=math.exp(tree.share), chain=own)
    if end:
        raw = _end_logprob(data, tokens, start, take, tree.frontier.get(n_bytes, {}), tree.prefix[n_bytes],
                           total[n_bytes], floor, width, res)
        score.end = float(_smoothed(np.array([raw]), smooth)[0])
    return score


def _speculate(tree: Tree, i: int, kept: list[tuple[tuple[int, ...], float]], cache: dict[tuple[int, ...], np.ndarray],
               first: list[tuple[int, int]], floor: float, width: int | None, tokens: TokenBytes, data: bytes,
               horizon: int) -> tuple[list[tuple[int, ...]], list[int]]:
    """The histories whose rows the tree will want next, guessed: the tree grown on a copy from boundary
    ``i`` (``kept`` there) for ``horizon`` bytes with the rows in ``cache`` only, a kept history without
    one gathered (with its boundary) and grown no further. Every history kept at ``i`` is among them, and
    so is the next one the tree will want (up to ``horizon``); later ones can be wrong guesses (a missing
    row's covers would have changed what was kept after it): read, not used."""
    sim, want = tree.fork(), {}
    for j in range(i, min(len(data), i + horizon)):
        for h, lp in kept if j == i else sim.boundary(j, floor, width, tokens, data):
            entries = cache.get(h)
            if entries is None:
                want[h] = j
            else:
                sim.grow(data, j, h, lp, entries, *first[j], tokens)
    return list(want), list(want.values())


def _branches(data: bytes, tokens: TokenBytes, pre: list[tuple[int, ...]], ends: list[int], lps: np.ndarray,
              cache: dict[tuple[int, ...], np.ndarray], first: list[tuple[int, int]], floor: float,
              width: int | None, top: bool) -> dict[tuple[int, ...], int]:
    """The histories one token off a path (``pre[j] + (v,)``, ``v`` not its next token; ``pre[j]`` at
    boundary ``ends[j]`` with log-probability ``lps[j]``) that pruning could keep, each with its
    boundary: ``v`` must hold at least ``keep`` of ``pre[j]``'s own covers of its bytes (the prefix mass
    there is at least those), and with ``width`` 1 beat the path's history at that boundary. Read from
    the path's rows in ``cache``. With ``top`` (the top rule), where the path has no boundary, the most
    probable of them there too (``prune`` keeps a boundary's most probable history whatever its share)."""
    on_path = dict(zip(ends, lps))
    out: dict[tuple[int, ...], int] = {}
    best: dict[int, tuple[float, tuple[int, ...]]] = {}  # off the path's boundaries: the most probable one-off there
    for h, o, lp_h in zip(pre, ends, lps):
        lo, hi = first[o]
        entries = cache[h]
        p = np.exp(entries)
        for d, a, b in spans(data, o, lo, hi, tokens, len(data) - 1):
            cover = math.log(max(float(p[a - lo:b - lo].sum()), 1e-300))
            for q, v in enumerate(tokens.exact.get(data[o:o + d], ())):
                lp = lp_h + float(entries[a - lo + q])
                if h + (v,) in cache:
                    continue
                if top and o + d not in on_path and lp > best.get(o + d, (-math.inf, ()))[0]:
                    best[o + d] = (lp, h + (v,))
                if lp < lp_h + cover + floor or (width == 1 and on_path.get(o + d, -math.inf) > lp):
                    continue
                out[h + (v,)] = o + d
    out.update((h, at) for at, (_, h) in best.items())
    return out


def _smoothed(logprobs: np.ndarray, smooth: float) -> np.ndarray:
    """``log((1 − smooth) p + smooth / 257)`` of each ``log p``."""
    if smooth <= 0:
        return logprobs
    return np.logaddexp(math.log1p(-smooth) + logprobs, math.log(smooth / 257))


def _end_logprob(data: bytes, tokens: TokenBytes, start: list[int], take: Take,
                 cands: dict[tuple[int, ...], float], covered: float, total: float, floor: float,
                 width: int | None, reserve: Reserve) -> float:
    """``log p(end | data)``: the histories kept at ``len(data)``, their mass on ids that are not text (and
    the reserve's ``1/257``)."""
    if total == -math.inf:
        return -math.inf
    kept, _, lost = boundary(cands, covered, total, len(data), floor, width, reserve, tokens, data)
    rows = take([start + list(h) for h, _ in kept], [tokens.other] * len(kept)) if kept else []  # read, not 1 − the text's mass
    ends = [lp + (float(np.logaddexp.reduce(r)) if len(r) else -math.inf) for (_, lp), r in zip(kept, rows)]
    return float(np.logaddexp.reduce(np.array(ends + [reserve.lp - LOG257])) - _logsubexp(total, lost))
