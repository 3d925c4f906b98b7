"""Teacher forcing: the log-likelihood of a given continuation under the token-level ensemble.

Definition: the continuation's bytes are cut into pieces by the primary member's own mid-stream
tokenization. Piece by piece, every weighted member runs on the context plus the pieces so far
(the same lockstep engine and re-sync as generation), and the piece's probability is the
combiner's probability of that union entry (``Combiner.piece_probs``: for GaC the weighted average
of the members' probabilities, a member without the piece as one token contributing its first
sub-token's probability as in UniTE — an upper bound, right for ranking the options of one question but
not a distribution over byte strings: bits per byte of text use the proper rows of
``engine.text_rows`` instead, docs/methods.md "Proper scores of text"; for UniTE the piece joins the
top-k candidates). The result
is the sum of the pieces' log-probabilities; a member alone (or copies of one member) gives
exactly that member's own likelihood of its tokens, each renormalised over its text + END ids.

Thresholded GaC (``gate``/``threshold``) gates each piece as in generation: where the gate
member's top probability is above the threshold, the piece's probability is the gate's alone;
elsewhere the group's combination. ``Likelihood.ensembled`` counts the latter.

Two ways to compute it, with the same definition:

- **one forward** (default when every member that decides runs in this process): the members'
  re-synchronised ids before each piece depend only on the continuation's bytes, never on the
  members' outputs, so they are worked out first (``OpenSequence.force`` without a forward). Each
  member then feeds them in as few chunked forwards as possible, keeping the logits of exactly the
  positions a piece is scored from (``Member.logprobs_at``): one forward per run of pieces along
  which its ids only grow; a member whose token straddled a piece boundary and is re-tokenised
  starts a new run from the common prefix (the cache is cropped there, as in the stepwise path).
- **stepwise** (``stepwise=True``, and always for members that run elsewhere): piece by piece,
  every member forwards the ids added since the last piece, the same lockstep as generation.

Both feed every member the same ids at the same positions; they differ only in how the ids are
cut into forward calls.

A ``RowMemo`` (one-forward path only) shares a member's rows between scorings of the same
requests: when a member's ids before every piece of a request are the very lists an earlier scoring
computed (same member, same context and cuts — e.g. every method of ``tokenfuse eval`` with the same
primary member, and the primary member alone), the rows are taken from the memo instead of being
computed again by the same forward. ``tokenfuse eval`` keeps one memo per batch of items. Only whole
requests are shared: llama.cpp's numbers depend on how a sequence is cut into calls (measured: a
position's distribution taken from another request's forward changed likelihoods), so a row is
shared only where the very same feed would compute it. For the same reason an ensemble with PackLLM
prompt weights neither shares nor takes rows (its prefill goes through prompt scoring, cut in
``PROMPT_CHUNK`` calls: taking ``gac``'s rows instead changed its likelihoods by up to 0.22, mean
0.04, on 32 ARC-Easy options of the real members). Where a backend's numbers do not depend on that (transformers; llama.cpp
for some quantisation types) they agree to float rounding; docs/evaluation.md gives what was
measured where they do not.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenfuse.engine.decide import Decider
from tokenfuse.engine.pool import MemberOutput
from tokenfuse.engine.sequence import OpenSequence
from tokenfuse.members.base import Member, SeqState
from tokenfuse.members.reading import positions_many


@dataclass(frozen=True)
class Likelihood:
    """``logprob``: natural-log likelihood of a continuation; ``pieces``/``bytes``: its length (for
    per-piece or per-byte normalisation)."""

    logprob: float
    pieces: int
    bytes: int
    ensembled: int = 0  # pieces scored by more than one member (fewer than ``pieces`` when gated)
    piece_logprobs: tuple[float, ...] = ()  # each piece's log-probability, in order (they sum to ``logprob``)
    piece_bytes: tuple[bytes, ...] = ()  # each piece's bytes (they concatenate to the continuation)
    # with ``top``: before each piece, the combined distribution's most likely (union entry, probability)
    piece_tops: tuple[tuple[tuple[int, float], ...], ...] = ()

    @property
    def per_byte(self) -> float:
        return self.logprob / max(self.bytes, 1)


def primary_pieces(decider: Decider, text: str) -> list[int]:
    """``text`` cut into union entries by the primary member's mid-stream tokenization."""
    i = decider.primary
    ids = decider.space.codecs[i].encode_text(text)
    return [int(decider.space.union.maps[i][t]) for t in ids]


class RowMemo:
    """Members' log-probability rows by (member name, its ids before each piece of one request):
    a later scoring that would feed a member exactly those id lists takes the rows from here.
    ``hits``/``misses`` count requests × members. On bytes (``byte_logprobs``) it keeps each member's
    byte-model log-probabilities of a context's continuations, so the byte rows that differ only in
    their mixer (``byte-mix``, ``byte-gate``, ``byte-online``) run each member's byte model once."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, tuple[tuple[int, ...], ...]], list[torch.Tensor]] = {}
        self._bytes: dict[tuple, list[np.ndarray]] = {}
        self._count = threading.Lock()  # byte_logprobs runs in the member threads
        self.hits = 0
        self.misses = 0

    def byte_logprobs(self, member: Member, pruning: Any, context: str, continuations: Sequence[str],
                      make: Callable[[], list[np.ndarray]]) -> list[np.ndarray]:
        """``member``'s byte-model log-probabilities of ``context + c`` for each continuation under
        ``pruning`` (a hashable ``Pruning``): kept from an earlier call with the same key, else ``make()``."""
        key = (member.name, pruning, context, tuple(continuations))
        got = self._bytes.get(key)
        with self._count:
            if got is None:
                self.misses += 1
            else:
                self.hits += 1
        if got is None:
            got = self._bytes[key] = make()
        return got

    @staticmethod
    def key(member: Member, before: list[list[int]]) -> tuple[str, tuple[tuple[int, ...], ...]]:
        return member.name, tuple(tuple(ids) for ids in before)

    def get(self, member: Member, before: list[list[int]]) -> list[torch.Tensor] | None:
        rows = self._rows.get(self.key(member, before))
        if rows is None:
            self.misses += 1
        else:
            self.hits += 1
        return rows

    def put(self, member: Member, before: list[list[int]], rows: list[torch.Tensor]) -> None:
        self._rows[self.key(member, before)] = rows

    def __len__(self) -> int:
        return len(self._rows)


def score(decider: Decider, seqs: list[OpenSequence], continuations: Sequence[str], *,
          stepwise: bool = False, top: int = 0, memo: RowMemo | None = None) -> list[Likelihood]:
    """The likelihood of each continuation after its sequence's context (``seqs``, freshly opened;
    the caller closes them; the one-forward path hands each member's cache back as soon as a request's
    rows are read, ``_member_rows``). ``stepwise`` forces the piece-by-piece path (the reference); ``top``
    also keeps the combined distribution's ``top`` most likely entries before each piece (the gate's
    distribution on gated pieces, as in generation); ``memo`` shares members' rows with other
    scorings of the same requests (one-forward path only)."""
    cuts = [primary_pieces(decider, c) for c in continuations]
    local = all(decider.members[i].in_process for i in decider.computed())
    tops: list[list[tuple[tuple[int, float], ...]]] = [[] for _ in seqs]
    if local and not stepwise:
        per_piece, ensembled = _one_forward(decider, seqs, cuts, tops if top > 0 else None, top, memo)
    else:
        per_piece, ensembled = _stepwise(decider, seqs, cuts, tops if top > 0 else None, top)
    union = decider.space.union
    return [Likelihood(math.fsum(lps), len(c), len(cont.encode("utf-8")), e, tuple(lps),
                       tuple(union.pieces[u] for u in c), tuple(t))
            for lps, c, e, cont, t in zip(per_piece, cuts, ensembled, continuations, tops)]


def _keep_tops(decider: Decider, view, members: list[int], tops: list[list] | None, rows: list[int], top: int) -> None:
    """With ``tops``: append each row's ``top`` most likely combined entries (rows ``rows`` of ``tops``)."""
    if tops is None:
        return
    dist = decider.distribution(view, members)
    vals, cols = torch.topk(dist.probs, min(top, dist.probs.shape[-1]), dim=-1)
    for j, k in enumerate(rows):
        tops[k].append(tuple((dist.entry(j, c), v) for v, c in zip(vals[j].tolist(), cols[j].tolist()) if v > 0))


def _log(p: float) -> float:
    return math.log(p) if p > 0 else float("-inf")


def _stepwise(decider: Decider, seqs: list[OpenSequence], cuts: list[list[int]], tops: list[list] | None = None,
              top: int = 0) -> tuple[list[list[float]], list[int]]:
    per_piece: list[list[float]] = [[] for _ in seqs]
    ensembled = [0] * len(seqs)
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
            _keep_tops(decider, view, members, tops, [rows[r] for r in group], top)
            for r, p in zip(group, got):
                probs[r] = p
                ensembled[rows[r]] += len(members) > 1
        with decider.timer.stage("resync"):
            for k, s, u, p in zip(rows, active, entries, probs):
                per_piece[k].append(_log(p))
                s.force(u)
    return per_piece, ensembled


def _one_forward(decider: Decider, seqs: list[OpenSequence], cuts: list[list[int]], tops: list[list] | None = None,
                 top: int = 0, memo: RowMemo | None = None) -> tuple[list[list[float]], list[int]]:
    computed = decider.computed()
    if decider.prefills:  # PackLLM weights: each member scores its prompt first (its prefill)
        decider.prepare(seqs)
        memo = None  # that prefill cuts the prompt into other calls than one feed would: no rows to share
    # 1. every member's ids before each piece (re-sync needs the bytes only, not the members' outputs)
    before: list[dict[int, list[list[int]]]] = [{i: [] for i in computed} for _ in seqs]
    with decider.timer.stage("resync"):
        for s, cut, ids in zip(seqs, cuts, before):
            for u in cut:
                for i in computed:
                    ids[i].append(s.states[i].all_ids())
                s.force(u)
    # 2. each member's log-probabilities before every piece, in as few forwards as its ids allow
    with decider.timer.stage("forward"):
        dists = decider.pool.run(computed, lambda i: _member_rows(decider.members[i], [s.states[i] for s in seqs],
                                                                  [ids[i] for ids in before], memo))
    # 3. the pieces' probabilities, piece by piece as in the stepwise path
    topk = decider.combiner.k if decider.combiner.needs == "topk" else 0
    per_piece: list[list[float]] = [[] for _ in seqs]
    ensembled = [0] * len(seqs)
    for j in range(max((len(c) for c in cuts), default=0)):
        rows = [k for k in range(len(seqs)) if j < len(cuts[k])]
        lps = {i: torch.stack([dists[i][k][j] for k in rows]) for i in computed}
        outs = {i: MemberOutput(topk=torch.topk(lp, min(topk, lp.shape[-1]), dim=-1)) if topk else MemberOutput(logprobs=lp)
                for i, lp in lps.items()}
        probs = [0.0] * len(rows)
        for group, members in decider.split(outs.get(decider.gate), len(rows)):
            pick = torch.tensor(group)
            states = {i: [SeqState(prompt_ids=[], logprobs=lps[i][r]) for r in group] for i in members}
            view = decider.states_view(states, members, outs, pick, seqs=[seqs[rows[r]] for r in group])
            with decider.timer.stage("combine"):
                got = decider.combiner.piece_probs(view, [cuts[rows[r]][j] for r in group]).tolist()
            _keep_tops(decider, view, members, tops, [rows[r] for r in group], top)
            for r, p in zip(group, got):
                probs[r] = p
                ensembled[rows[r]] += len(members) > 1
        for k, p in zip(rows, probs):
            per_piece[k].append(_log(p))
    return per_piece, ensembled


def _member_rows(member: Member, finals: list[SeqState], befores: list[list[list[int]]],
                 memo: RowMemo | None) -> list[list[torch.Tensor]]:
    """``_rows`` of each request in turn, or of all of them at once for a member that scores
    sequences together (``Member.scores_together``: a batched transformers member, which keeps no
    prefix cache). A request's state is released as soon as its rows are read (nothing reads it
    again): its cache goes back to the member, so the next request sharing its context (another
    option of the same question) reuses that cache in place rather than a copy of it — a llama.cpp
    copy of a cache past a sliding window (Gemma-3) is not exact and is not made, and without this
    every such option would prefill the whole prompt again."""
    groups = [list(range(len(finals)))] if member.scores_together else [[r] for r in range(len(finals))]
    out: list[list[torch.Tensor]] = [[] for _ in finals]
    for group in groups:
        for r, rows in zip(group, _rows(member, [finals[r] for r in group], [befores[r] for r in group], memo)):
            out[r] = rows
        for r in group:
            member.release(finals[r])
    return out


def _rows(member: Member, finals: list[SeqState], befores: list[list[list[int]]],
          memo: RowMemo | None) -> list[list[torch.Tensor]]:
    """``positions_many``, or the memo's rows for the same member and id lists (a hit feeds nothing;
    requests of this call with the same id lists are fed once, the later ones hits as in turn)."""
    got: list[list[torch.Tensor] | None] = [None] * len(finals)
    todo, again, fed = [], [], set()
    for r, before in enumerate(befores):
        if memo is None:
            todo.append(r)
            continue
        key = RowMemo.key(member, before)
        if key in fed:
            again.append(r)
            continue
        got[r] = memo.get(member, before)
        if got[r] is None:
            todo.append(r)
            fed.add(key)
    for r, rows in zip(todo, positions_many(member, [finals[r] for r in todo], [befores[r] for r in todo])):
        got[r] = rows
        if memo is not None:
            memo.put(member, befores[r], rows)
    for r in again:
        got[r] = memo.get(member, befores[r])
    return got
