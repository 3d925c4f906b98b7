"""A member as a byte-level model (alignment/bytemodel.py, scored by alignment/byteview.py), against brute force on the real tokenizers:
random models whose mass lies on the tokens spelled from a small alphabet (and END), every string of
each length 1..MAX_LEN; and tiny random transformers, a whole document against the sum over its
tokenizations."""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from tokenfuse.alignment.bytemodel import ByteModel, Pruning
from tokenfuse.alignment.bytetree import TokenBytes
from tokenfuse.alignment.byteview import score_bytes
from tokenfuse.engine.text_features import Rows, doc_features, primary_tokens

ALPHABET = b"ab"
MAX_LEN = 5
FAMILIES = ("smollm2", "qwen", "gemma3")


def _fake_rows(member, seed: int, *, end: bool = True) -> Rows:
    """``member``'s codec with a random model on it: a seeded function of the id list, its mass on the
    tokens spelled from ``ALPHABET`` (and the END ids, with ``end``); ``take`` gathers the same float64
    numbers as ``fn``'s whole rows without building them."""
    codec = member.codec
    vocab = len(codec.token_bytes)
    allowed = np.array([bool(b) and set(b) <= set(ALPHABET) for b in codec.token_bytes])
    if end:
        allowed[list(codec.end_ids)] = True
    where = np.flatnonzero(allowed)
    at = np.full(vocab, -1, dtype=np.int64)
    at[where] = np.arange(len(where))
    memo: dict[tuple[int, ...], np.ndarray] = {}

    def sparse(ids: list[int]) -> np.ndarray:  # the log-probabilities of the ids in ``where``
        key = tuple(ids)
        if key not in memo:
            h = int(hashlib.sha256(f"{seed}:{list(ids)}".encode()).hexdigest()[:12], 16)
            x = torch.randn(len(where), generator=torch.Generator().manual_seed(h)).double() * 2.0
            memo[key] = torch.log_softmax(x, dim=-1).numpy()
        return memo[key]

    def fn(lists):
        out = []
        for ids in lists:
            row = torch.full((vocab,), float("-inf"), dtype=torch.float64)
            row[torch.from_numpy(where)] = torch.from_numpy(sparse(ids))
            out.append(row)
        return out

    def take(lists, ids):
        out = []
        for lst, x in zip(lists, ids):
            j = at[np.asarray(x, dtype=np.int64)]
            out.append(np.where(j >= 0, sparse(lst)[np.maximum(j, 0)], -np.inf))
        return out

    rows = Rows(member.name, codec, member.encode_prompt(""), fn, take)
    rows.support = where  # type: ignore[attr-defined]  # the ids with mass, for the brute force
    return rows


@pytest.fixture(scope="module")
def fake(make_tiny):
    return {f: _fake_rows(make_tiny(f, seed=i, name=f), seed=i) for i, f in enumerate(FAMILIES)}


def _brute(rows: Rows, n: int) -> tuple[dict[bytes, float], dict[bytes, float]]:
    """Every token sequence, grown until it spells ``n`` bytes or more or ends: the probability that the
    text starts with each string of length ``n``, and that it is each shorter string and then ends."""
    starts: dict[bytes, float] = defaultdict(float)
    ended: dict[bytes, float] = defaultdict(float)
    tb = rows.codec.token_bytes
    stack = [([], b"", 0.0)]
    while stack:
        ids, spelled, lp = stack.pop()
        row = rows.entries([rows.start + ids], [rows.support])[0]
        for v, lv in zip(rows.support.tolist(), row.tolist()):
            if not tb[v]:
                ended[spelled] += math.exp(lp + lv)
            elif len(spelled + tb[v]) >= n:
                starts[(spelled + tb[v])[:n]] += math.exp(lp + lv)
            else:
                stack.append((ids + [v], spelled + tb[v], lp + lv))
    return starts, ended


def _brute_all(rows: Rows) -> tuple[dict[bytes, float], dict[bytes, float]]:
    """``_brute`` at ``MAX_LEN``, and from it every shorter string's probability of starting the text."""
    starts, ended = _brute(rows, MAX_LEN)
    every: dict[bytes, float] = defaultdict(float)
    for s, p in list(starts.items()) + list(ended.items()):
        for n in range(1, len(s) + 1):
            every[s[:n]] += p
    return every, ended


_TOKENS: dict[int, TokenBytes] = {}


def _view(rows: Rows, s: bytes, **kw):
    if id(rows.codec) not in _TOKENS:
        _TOKENS[id(rows.codec)] = TokenBytes(rows.codec.token_bytes)
    tokens = _TOKENS[id(rows.codec)]
    return score_bytes(s, tokens, rows.start, rows.entries, end=True, **kw)


def _strings(n: int) -> list[bytes]:
    return [bytes(c) for c in itertools.product(ALPHABET, repeat=n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_view_is_the_brute_force_for_every_string(fake, family):
    """``keep=0, width=None``: each string's probability (the product of its bytes' conditionals) and
    its probability of ending there equal the brute force within 1e-9, lengths 1..MAX_LEN."""
    rows = fake[family]
    starts, ended = _brute(rows, MAX_LEN)
    assert abs(sum(starts.values()) + sum(ended.values()) - 1.0) < 1e-12
    every, ended = _brute_all(rows)
    for n in range(1, MAX_LEN + 1):
        for s in _strings(n):
            v = _view(rows, s, keep=0.0, width=None, smooth=0.0)
            assert math.isclose(math.exp(v.logprobs.sum()), every.get(s, 0.0), rel_tol=1e-9, abs_tol=1e-15), s
            if n < MAX_LEN:
                assert math.isclose(math.exp(v.logprobs.sum() + v.end), ended.get(s, 0.0), rel_tol=1e-9,
                                    abs_tol=1e-15), s


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prune", [dict(keep=0.0, width=None, smooth=0.0), dict(smooth=0.0, rule="top"),
                                   dict(smooth=0.0, fallback=0.0), dict(keep=0.05, width=1, smooth=0.0, rule="top"), dict(keep=0.05, width=1, smooth=0.0, rule="defer", fallback=0.0),
                                   dict(keep=0.2, width=2, smooth=0.0, rule="defer", fallback=0.0)])
def test_every_view_is_a_distribution_over_byte_strings(fake, family, prune):
    """Exact or pruned, the view's probabilities of all strings of length ``n`` plus those of ending
    after each shorter string sum to 1, for every ``n`` up to MAX_LEN."""
    rows = fake[family]
    views = {s: _view(rows, s, **prune) for n in range(MAX_LEN + 1) for s in _strings(n)}
    for n in range(1, MAX_LEN + 1):
        total = sum(math.exp(views[s].logprobs.sum()) for s in _strings(n))
        total += sum(math.exp(views[s].logprobs.sum() + views[s].end) for m in range(n) for s in _strings(m))
        assert abs(total - 1.0) < 1e-9, (n, total)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prune", [dict(smooth=0.0, rule="reserve"), dict(keep=0.05, width=1, smooth=0.0, rule="reserve"),
                                   dict(keep=0.05, width=1, rule="defer"), dict(keep=0.2, width=1, smooth=0.0, rule="defer"),
                                   dict(keep=0.2, width=1, smooth=0.0, rule="defer", fallback=0.05)])
def test_every_reserve_and_defer_view_is_a_distribution(fake, family, prune):
    """Under the reserve and defer rules, after each string of length < 4 over the alphabet and after
    one with a byte the model never spells, the next byte's probabilities over all 256 bytes and the
    end's sum to 1 (scored byte by byte: a deferred history's row read only where it is needed)."""
    rows = fake[family]
    for s in [x for n in range(4) for x in _strings(n)] + [b"abzb"]:
        total = math.exp(_view(rows, s, **prune).end)
        total += sum(math.exp(_view(rows, s + bytes([c]), **prune).logprobs[-1]) for c in range(256))
        assert abs(total - 1.0) < 1e-9, (s, total)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_reserve_gives_a_byte_no_kept_history_spells_a_share_and_reseeds(fake, family):
    """``z`` is a byte the random model never spells: under the reserve rule its probability is the
    reserve's ``1/257`` share, and after it the re-seeded history predicts the alphabet as the model
    does (well above the reserve's ``1/257``); exact (nothing dropped, no reserve), ``z`` has no mass."""
    rows = fake[family]
    v = _view(rows, b"abzab", keep=0.05, width=1, smooth=0.0, rule="reserve")
    assert np.all(np.isfinite(v.logprobs)) and v.logprobs[2] < -math.log(257)
    assert np.all(v.logprobs[3:] > -math.log(257) + 2)
    assert _view(rows, b"abzab", keep=0.0, width=None, smooth=0.0, rule="reserve").logprobs[2] == -math.inf


@pytest.mark.parametrize("family", FAMILIES)
def test_the_defer_rule_reads_a_deferred_row_only_where_nothing_read_spells_the_byte(fake, family):
    """With a high ``keep`` most boundaries' histories are deferred: scoring reads a deferred row only
    at the bytes no history read spells (``ByteScore.deferrals``), the rest of the deferred mass going
    nowhere the text went; the whole next-symbol distribution (which reads every deferred row) gives
    each byte the same probability, within 1e-12."""
    rows = fake[family]
    tokens = TokenBytes(rows.codec.token_bytes)
    s = b"abbabaabbab"
    v = _view(rows, s, keep=0.3, width=1, smooth=0.0, rule="defer")
    assert v.deferrals < len(s)
    model = ByteModel(tokens, rows.start, rows.entries, Pruning(keep=0.3, width=1, smooth=0.0, rule="defer"))
    for n, b in enumerate(s):
        assert math.isclose(model.next_distribution()[b], v.logprobs[n], rel_tol=0, abs_tol=1e-12)
        model.advance(b)
    assert model.rows > v.rows


@pytest.mark.parametrize("rule", ["defer", "reserve"])
def test_the_defer_and_reserve_rules_read_fewer_rows_than_the_top_rule(fake, rule):
    rows = fake["qwen"]
    s = b"abbabaabba"
    top, other = _view(rows, s, keep=0.05, width=1, rule="top"), _view(rows, s, keep=0.05, width=1, rule=rule)
    assert other.rows < top.rows == len(s) + 1  # the top rule: a row at every boundary, and the end's
    assert np.all(np.isfinite(other.logprobs))


def test_pruning_reports_what_it_left_out_and_reads_fewer_rows(fake):
    rows = fake["qwen"]
    s = b"abba"
    exact, pruned = _view(rows, s, keep=0.0, width=None, smooth=0.0), _view(rows, s, keep=0.05, width=1)
    assert exact.pruned == 0.0 and pruned.pruned > 0.0
    assert pruned.rows < exact.rows


def test_the_two_path_rule_is_not_a_distribution(fake):
    """The old component of another member (``e``: its one- and two-token paths to each of the primary's
    pieces), read as that member's probability of a string, does not sum to 1 over the strings of a
    length; the byte view of the same member does."""
    members = [fake["qwen"], fake["gemma3"]]
    n = 4
    old = new = 0.0
    vocabs: dict = {}
    k = sum(bool(b) and set(b) <= set(ALPHABET) for b in members[0].codec.token_bytes)  # every piece a candidate
    for s in _strings(n):
        f = doc_features(s.decode(), members, 0, k=k, vocabs=vocabs)
        assert np.all(f.true_at >= 0)
        old += float(np.prod(f.e[1][np.arange(len(f.true_at)), f.true_at]))
        new += math.exp(_view(members[1], s, keep=0.0, width=None, smooth=0.0).logprobs.sum())
    every, _ = _brute_all(members[1])
    exact = sum(every.get(s, 0.0) for s in _strings(n))
    assert abs(old - exact) > 0.01
    assert abs(new - exact) < 1e-9


def test_the_chain_is_a_cache_only(fake):
    """Reading the member's own tokens' rows first changes no number, bit for bit."""
    rows = fake["smollm2"]
    s = b"abbabab"
    own = primary_tokens(rows.codec, s.decode())
    a, b = _view(rows, s), _view(rows, s, chain=own)
    assert a.logprobs.tolist() == b.logprobs.tolist() and a.end == b.end


def _counted(take):
    calls = []

    def counted(lists, ids):
        calls.append(len(lists))
        return take(lists, ids)

    return counted, calls


@pytest.mark.parametrize("rule", ["top", "defer", "reserve"])
@pytest.mark.parametrize("family", FAMILIES)
def test_reading_ahead_is_a_cache_only(fake, family, rule):
    """``Lookahead`` (the chain's rows in one call, then the histories off it that pruning could keep)
    changes no number, bit for bit, on random strings under every rule, and gathers reads into fewer
    calls than reading each boundary's rows when the model needs them."""
    rows = fake[family]
    tokens = TokenBytes(rows.codec.token_bytes)
    rng = np.random.default_rng(3)
    n_calls = {"none": 0, "chain": 0, "all": 0}
    for n in (9, 40, 120):
        s = bytes(rng.choice(list(ALPHABET), size=n).tolist())
        own = primary_tokens(rows.codec, s.decode())
        got = {}
        for how in n_calls:
            take, calls = _counted(rows.entries)
            got[how] = score_bytes(s, tokens, rows.start, take, chain=own if how != "none" else (), keep=1e-2,
                                   width=1, end=True, rule=rule, prefetch=how == "all")
            n_calls[how] += len(calls)
        for how in ("chain", "all"):
            assert got[how].logprobs.tolist() == got["none"].logprobs.tolist() and got[how].end == got["none"].end
            assert got[how].rows == got["none"].rows and got[how].pruned == got["none"].pruned
    assert n_calls["all"] < n_calls["none"]


@pytest.mark.parametrize("rule", ["top", "defer"])
def test_reading_ahead_on_a_tiny_transformer(make_tiny, one_thread, rule):
    """The same on a tiny transformer's rows and a text of several tokenizations (its own tokens as the
    chain), to float32 rounding: a row's numbers depend on which lists share its forward."""
    rows = Rows.from_member(make_tiny("gemma3", seed=2, name="gemma3"))
    tokens = TokenBytes(rows.codec.token_bytes)
    doc = "The reasoning is done: 3.14159 * r ** 2, Omit, omit.".encode()
    own = primary_tokens(rows.codec, doc.decode())
    got = [score_bytes(doc, tokens, rows.start, rows.entries, chain=chain, prefetch=ahead, rule=rule)
           for chain, ahead in (((), False), (own, False), (own, True))]
    for g in got[1:]:
        assert g.rows == got[0].rows
        np.testing.assert_allclose(g.logprobs, got[0].logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_document_is_the_sum_over_its_tokenizations(make_tiny, one_thread, family):
    """A tiny random transformer on the real tokenizer (mass on every id): the exact view's probability of
    a whole document and then its end equals the sum over every token sequence spelling it of that
    sequence's probability times its END mass; and the probability that a text starts with the
    document equals the sum over its covers — each computed with one forward per sequence."""
    member = make_tiny(family, seed=11, name=family)
    rows = Rows.from_member(member)
    doc = b"ab, a"
    tb = member.codec.token_bytes
    tokens = TokenBytes(tb)

    def row(ids):
        st = member.new_state(rows.start + ids)
        try:
            return member.next_logprobs([st])[0].double().numpy()
        finally:
            member.release(st)

    def spellings(rest: bytes):
        if not rest:
            yield []
        for d in range(1, len(rest) + 1):
            for t in tokens.exact.get(rest[:d], ()):
                for tail in spellings(rest[d:]):
                    yield [t] + tail

    end_ids = [i for i, b in enumerate(tb) if not b]
    whole = 0.0
    covers = 0.0
    for seq in spellings(doc):
        lp = sum(row(seq[:j])[t] for j, t in enumerate(seq))
        whole += math.exp(lp + np.logaddexp.reduce(row(seq)[end_ids]))
    for cut in range(len(doc)):
        for h in spellings(doc[:cut]):
            lh = sum(row(h[:j])[t] for j, t in enumerate(h))
            covers += math.exp(lh) * float(np.exp(row(h)[tokens.starting_with(doc[cut:])]).sum())
    v = _view(rows, doc, keep=0.0, width=None, smooth=0.0)
    assert math.isclose(math.exp(v.logprobs.sum()), covers, rel_tol=1e-5)
    assert math.isclose(math.exp(v.logprobs.sum() + v.end), whole, rel_tol=1e-5)


def test_the_chain_gives_the_member_alone_on_its_tokens(fake):
    """``ByteScore.chain``: the member's log-probability of each of its own tokens, read from the same rows,
    equals its own scoring of them (``Rows.logprobs_of``), bit for bit."""
    rows = fake["qwen"]
    s = b"abbaabab"
    own = primary_tokens(rows.codec, s.decode())
    got = _view(rows, s, chain=own).chain
    want = rows.logprobs_of([rows.start + own[:j] for j in range(len(own))], own)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("family", ["smollm2", "gemma3"])
def test_a_reader_keeps_states_and_gives_the_same_numbers(make_tiny, one_thread, family):
    """``Rows.reader`` (sequence states kept across calls, each list on the one sharing most of it) gives
    the numbers of a fresh state per call, and so the same byte view, on a tiny transformer."""
    rows = Rows.from_member(make_tiny(family, seed=5, name=family))
    tokens = TokenBytes(rows.codec.token_bytes)
    doc = b"ab, ba ab"
    own = primary_tokens(rows.codec, doc.decode())
    plain = score_bytes(doc, tokens, rows.start, rows.entries, chain=own, keep=0.0, width=3, end=True)
    with rows.reader() as take:
        held = score_bytes(doc, tokens, rows.start, take, chain=own, keep=0.0, width=3, end=True)
    assert held.rows == plain.rows > len(own)
    np.testing.assert_allclose(held.logprobs, plain.logprobs, rtol=0, atol=1e-5)
    assert abs(held.end - plain.end) < 1e-5


def test_a_pruned_tree_gives_every_byte_mass_and_smoothing_mixes_in_the_uniform(make_tiny, one_thread):
    """A sharp tiny transformer and a pruned tree: every byte keeps mass even unsmoothed (a boundary's most
    probable history is always kept, and can spell any next byte); smoothed (the default), each
    conditional is ``(1 − ε) p + ε / 257`` of the unsmoothed one."""
    rows = Rows.from_member(make_tiny("smollm2", seed=5, name="smollm2"))
    tokens = TokenBytes(rows.codec.token_bytes)
    doc = b"ab, ba ab"
    raw = score_bytes(doc, tokens, rows.start, rows.entries, keep=1e-4, width=3, smooth=0.0, rule="top")
    smooth = score_bytes(doc, tokens, rows.start, rows.entries, keep=1e-4, width=3, rule="top")
    assert np.all(np.isfinite(raw.logprobs)) and np.all(np.isfinite(smooth.logprobs))
    np.testing.assert_allclose(np.exp(smooth.logprobs), (1 - 1e-6) * np.exp(raw.logprobs) + 1e-6 / 257, rtol=1e-12)
