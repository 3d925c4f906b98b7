"""Scoring a text with a member's byte model: ``score_bytes``, a loop over ``bytemodel.ByteModel``, and
``Lookahead``, the rows it will want read ahead in few calls (a cache: the numbers do not depend on it).

For a trained member almost all the mass lies on its own tokenization of the text (its *chain*, computed
in one run), so ``Lookahead`` reads the chain's rows in one ``take`` first, then the histories one token
off it that pruning could keep in one more, and where a kept history that was not read yet stands at a
boundary of the chain, the chain's next tokens after it the same way: a member's best history can
leave its own tokens and follow them again shifted (`` Reason`` + ``ing`` for `` Reasoning``). On the
llama.cpp member these reads are branches off one trunk in shared calls (members/llamacpp_tree.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenfuse.alignment.bytemodel import ByteModel, Pruning, Reads, Take
from tokenfuse.alignment.bytetree import TokenBytes, spans

LOOK = 256  # ``Lookahead``: at most this many chain tokens read ahead after a history off it


@dataclass
class ByteScore:
    """``logprobs[n]``: the natural-log probability of byte ``n`` given the bytes before it;
    ``end``: of the text ending after the last byte (computed with ``score_bytes(..., end=True)``);
    ``rows``: the rows read; ``pruned``: the largest share of a boundary's prefix mass that pruning
    left out; ``deferrals``: the bytes only a deferred history spelled (its row read then, the defer rule);
    ``reseeds``: the bytes nothing kept spelled (the defer rule re-seeds after them); ``chain``: the member's log-probability of each of its own tokens (with ``chain``: the
    member alone on its tokens, read from the same rows)."""

    logprobs: np.ndarray
    end: float | None = None
    rows: int = 0
    pruned: float = 0.0
    chain: np.ndarray | None = None
    deferrals: int = 0
    reseeds: int = 0


def score_bytes(data: bytes, tokens: TokenBytes, start: Sequence[int], take: Take, *, chain: Sequence[int] = (),
                end: bool = False, prefetch: bool = True, pruning: Pruning | None = None, **fields) -> ByteScore:
    """The member's byte-level probability of each byte of ``data`` given the bytes before it: its byte
    model (``pruning``, or its fields ``keep``, ``width``, ``rule``, ``smooth``) advanced byte by byte.
    ``chain``: the member's own tokens of ``data``, read ahead (``Lookahead``, with ``prefetch`` also
    the histories off it; a cache: the numbers do not depend on it). ``end``: also ``p(end | data)``."""
    pruning = pruning if pruning is not None else Pruning(**fields)
    ahead = Lookahead(data, tokens, start, take, chain, pruning, prefetch) if chain and data else None
    model = ByteModel(tokens, start, take, pruning, reads=ahead)
    out = np.array([model.advance(b) for b in data], dtype=np.float64)
    last = model.end_logprob() if end else None
    return ByteScore(out, last, rows=model.rows, pruned=model.pruned, chain=ahead.own if ahead is not None else None,
                     deferrals=model.deferrals, reseeds=model.reseeds)


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


class Lookahead(Reads):
    """``score_bytes``'s rows, read ahead along paths (the module docstring): a path (a history and the
    member's own tokens of the bytes after it) is read in one ``take``, then (``prefetch``) the histories
    one token off it that pruning could keep (``_branches``) in one more; ``own``: the chain's tokens'
    log-probabilities."""

    def __init__(self, data: bytes, tokens: TokenBytes, start: Sequence[int], take: Take, chain: Sequence[int],
                 pruning: Pruning, prefetch: bool) -> None:
        super().__init__(start, take)
        self.data, self.tokens, self.chain, self.prefetch = data, tokens, list(chain), prefetch
        self.first = [tokens.span(data[i:i + 1]) for i in range(len(data))]
        self.floor, self.width, self.top = pruning.floor, pruning.width, pruning.rule == "top"
        self.cache: dict[tuple[int, ...], np.ndarray] = {}
        self.window = 8  # chain tokens the next path off the chain reads ahead
        self.ahead: list[tuple[int, ...]] = []  # the histories the last such path read
        self.at_chain = {at: j for j, at in enumerate(_spelled(tokens.token_bytes, chain, data))} if prefetch else {}
        self.own = self.path((), 0.0, 0, self.chain)

    def read(self, hs: list[tuple[int, ...]], at: int, lps: list[float], ids: np.ndarray,
             span: tuple[int, int] | None) -> list[np.ndarray]:
        if span is None or at >= len(self.data) or span != self.first[at]:
            return super().read(hs, at, lps, ids, span)
        if at in self.at_chain:  # a kept history off the paths read, where a chain token starts: the chain's rest follows it
            j = self.at_chain[at]
            for h, lp in zip(hs, lps):
                if h not in self.cache:
                    self.follow(h, lp, at, self.chain[j:j + LOOK])
        self.fetch(hs, [at] * len(hs))
        return [self.cache.pop(h) for h in hs]

    def fetch(self, hs: list[tuple[int, ...]], ats: list[int]) -> None:
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
        self.fetch(pre, ends)
        own = np.array([self.cache[x][self.tokens.rank[path[k]] - self.first[ends[k]][0]]
                        for k, x in enumerate(pre) if k < len(path)])
        if self.prefetch:
            lps = lp + np.concatenate([[0.0], np.cumsum(own)])[: len(pre)]
            ahead = _branches(self.data, self.tokens, pre, ends, lps, self.cache, self.first, self.floor, self.width,
                              self.top)
            self.fetch(list(ahead), list(ahead.values()))
        return own


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
