"""Likelihood on bytes: the ``byte`` method's ``loglikelihood``.

``log P(continuation | context)`` under the method's mixture of the members' byte models of the whole
text. Every member with a positive weight scores the bytes of ``context + continuation`` from its start
ids (its ``ByteModel`` under the method's pruning), so a token may straddle the boundary and nothing is conditioned away; the mixer (``params.mix``:
``mixture``, ``switch`` or ``gate``, ``combiners.mixers``) reads every byte of the text from the first;
the continuation's log-probability is the sum of its bytes' mixed conditionals, i.e. ``log P(context +
continuation) − log P(context)`` under the mixture. The end is not scored. The options of one question
share their context: each member runs one model over it (its own tokens of it read ahead, through one
reader per context, ``Member.reader``) and forks it for each continuation (``ByteModel.fork``: the
model is causal, so a fork gives the numbers of a model of the whole text).

Nothing is masked: these are the probabilities of the members' byte models mixed, a distribution over
every byte string. (Generation differs in two ways: it starts each byte model after the prompt's ids, so
the prompt is not scored, and it renormalises each step over the bytes that keep the output whole
UTF-8 text.) ``product`` does not score this way (its normaliser needs every member's whole next
distribution at every byte): refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from tokenfuse.alignment.bytetree import TokenBytes
from tokenfuse.alignment.bytemodel import ByteModel
from tokenfuse.alignment.byteview import Lookahead
from tokenfuse.combiners.mixers import Fitted, Mixer
from tokenfuse.engine.likelihood import Likelihood, RowMemo
from tokenfuse.engine.pool import MemberPool
from tokenfuse.engine.prompt import Prompt, TwoFormPrompt
from tokenfuse.engine.text_features import primary_tokens
from tokenfuse.errors import AlignmentError, ConfigError
from tokenfuse.members.base import Member


def byte_loglikelihood(members: Sequence[Member], combiner, tables: Callable[[int], TokenBytes], pool: MemberPool,
                       requests: Sequence[tuple[Prompt, str]], *, chat: bool = False,
                       weights: Sequence[float], memo: RowMemo | None = None) -> list[Likelihood]:
    """Each ``(context, continuation)``'s log-likelihood on bytes (the module docstring); ``combiner``: the
    ``byte`` method's (``params``, ``new_mixer``), ``tables(i)``: member ``i``'s tokens by bytes,
    ``weights``: the ensemble's weights of ``members``; ``memo``: shares each member's byte models of a
    context's continuations with other scorings under the same pruning (other mixers' rows)."""
    live = live_members(weights, combiner)
    texts = [(_context(ctx, chat), cont) for ctx, cont in requests]
    groups: dict[str, list[int]] = {}
    for k, (ctx, _) in enumerate(texts):
        groups.setdefault(ctx, []).append(k)
    out: list[Likelihood | None] = [None] * len(requests)
    pruning = combiner.params.pruning
    for ctx, ks in groups.items():
        conts = [texts[k][1] for k in ks]

        def run(i: int, ctx: str = ctx, conts: list[str] = conts) -> list[np.ndarray]:
            def make() -> list[np.ndarray]:
                return member_byte_logprobs(members[i], tables(i), pruning, ctx, conts)

            return make() if memo is None else memo.byte_logprobs(members[i], pruning, ctx, conts, make)

        lps = pool.run(live, run)
        n_ctx = len(ctx.encode("utf-8"))
        for j, (k, cont) in enumerate(zip(ks, conts)):
            mixed = _mix(_mixer(weights, combiner, live), [lps[i][j] for i in live])[n_ctx:]
            data = cont.encode("utf-8")
            out[k] = Likelihood(float(mixed.sum()), len(data), len(data), ensembled=len(data) if len(live) > 1 else 0,
                                piece_logprobs=tuple(float(x) for x in mixed),
                                piece_bytes=tuple(bytes([b]) for b in data))
    return out  # type: ignore[return-value]


def byte_score_prompt(members: Sequence[Member], combiner, tables: Callable[[int], TokenBytes], pool: MemberPool,
                      prompt: str, *, top: int = 0, weights: Sequence[float]) -> list[tuple[int, float, np.ndarray | None]]:
    """Each byte of ``prompt`` with its log-probability under the mixture given the bytes before it (the
    first given nothing: each member's byte model from its start ids), and with ``top`` the mixture's
    257-way distribution there (each member's whole next distribution read for it); ``weights``: the
    ensemble's weights of ``members``."""
    live = live_members(weights, combiner)
    data = prompt.encode("utf-8")

    def run(i: int) -> tuple[list[float], list[np.ndarray]]:
        m, start = members[i], members[i].encode_prompt("")
        with m.reader(start) as take:
            model = ByteModel(tables(i), start, take, combiner.params.pruning)
            dists = []
            lps = []
            for b in data:
                if top:
                    dists.append(model.next_distribution())
                lps.append(model.advance(b))
            return lps, dists

    got = pool.run(live, run)
    mixer = _mixer(weights, combiner, live)
    out = []
    for t, b in enumerate(data):
        p = np.exp(np.array([got[i][0][t] for i in live]))
        dist = mixer.combine([got[i][1][t] for i in live]) if top else None
        q = float(mixer.weights() @ p)
        out.append((b, float(np.log(q)) if q > 0 else -np.inf, dist))
        mixer.update(p)
    return out


def live_members(weights: Sequence[float], combiner) -> list[int]:
    """The members that score (a positive weight); ``product`` refused (it cannot score this way)."""
    if combiner.params.mix == "product":
        raise ConfigError("params.mix: product scores no bytes (its normaliser needs every member's whole next "
                          "distribution); score with mix mixture, switch or gate")
    return [i for i, w in enumerate(weights) if w > 0]


def mix_byte_logprobs(combiner, weights: Sequence[float], lps: Sequence[np.ndarray]) -> np.ndarray:
    """The mixture's natural-log probability of each byte of one text, from the log-probabilities ``lps``
    of its bytes under each member with a positive weight (in member order), the mixer reading every
    byte from the first (a new mixer: ``gate``'s features at zero, ``switch`` at its prior)."""
    live = live_members(weights, combiner)
    if len(lps) != len(live):
        raise ValueError(f"mix_byte_logprobs: {len(lps)} members' numbers for {len(live)} members with a weight")
    return _mix(_mixer(weights, combiner, live), lps)


def _mix(mixer: Mixer, lps: Sequence[np.ndarray]) -> np.ndarray:
    """``mixer``'s log-probability of each byte of one text from the members' (``lps``, in its order)."""
    return mixer.logprobs(np.exp(np.stack(lps, axis=1)))


def _mixer(weights: Sequence[float], combiner, live: list[int]) -> Mixer:
    """A text's mixer of the members ``live``: the combiner's (``switch``, ``gate``, a fit's mixture), else
    the mixture at their normalised weights."""
    w = np.array([weights[i] for i in live], dtype=np.float64)
    return combiner.new_mixer(list(w)) or Mixer("mixture", Fitted(weights=w / w.sum()), len(live))


def member_byte_logprobs(member: Member, tokens: TokenBytes, pruning, ctx: str, conts: Sequence[str], *,
                         start: Sequence[int] | None = None) -> list[np.ndarray]:
    """The member's byte model's natural-log probability of each byte of ``ctx + cont``, for each ``cont``:
    one model over the context (its own tokens of it read ahead), forked for each continuation; the model
    starts at ``start`` (default the member's start ids; a prompt's ids: as generation starts it)."""
    start, data = (member.encode_prompt("") if start is None else list(start)), ctx.encode("utf-8")
    with member.reader(start) as take:
        ahead = Lookahead(data, tokens, start, take, _own(member, ctx), pruning, True) if data else None
        model = ByteModel(tokens, start, take, pruning, reads=ahead)
        head = [model.advance(b) for b in data]
        out = []
        for cont in conts:
            fork = model.fork()
            out.append(np.array(head + [fork.advance(b) for b in cont.encode("utf-8")], dtype=np.float64))
        return out


def _own(member: Member, text: str) -> list[int]:
    """The member's own tokens of ``text``, read ahead (none where its tokenizer cannot spell the text:
    reading ahead is a cache, the numbers are the same without it)."""
    try:
        return primary_tokens(member.codec, text)
    except AlignmentError:
        return []


def _context(prompt: Prompt, chat: bool) -> str:
    """The context as text: a string as it is, a two-form prompt's raw form; chat messages (each member
    would render them with its own template, so no bytes are common to all) are refused."""
    if chat:
        raise ConfigError("chat: the byte method scores a context's bytes, the same for every member; "
                          "give the context as text, without chat")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, TwoFormPrompt):
        return prompt.raw
    raise ConfigError("the byte method scores a context's bytes, the same for every member: give it as text, "
                      "not chat messages")
