"""A member's byte model one byte at a time (alignment/bytemodel.py): its whole next-symbol distribution
(generation's) against the byte-by-byte scoring path (``advance``, ``score_bytes``: only the rows'
entries of the next byte) and brute force, on the real tokenizers with the random models of
tests/test_byteview.py."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from test_byteview import ALPHABET, FAMILIES, MAX_LEN, _brute_all, fake  # noqa: F401  (the fixture)
from tokenfuse.alignment.bytemodel import END_SYMBOL, ByteModel, Pruning, next_byte_sums
from tokenfuse.alignment.bytetree import TokenBytes
from tokenfuse.alignment.byteview import score_bytes

PRUNINGS = [dict(keep=0.0, width=None, smooth=0.0), dict(smooth=0.0), dict(), dict(keep=0.05, width=1),
            dict(rule="reserve"), dict(keep=0.05, width=1, smooth=0.0, rule="reserve"), dict(rule="defer"),
            dict(keep=0.05, width=1, smooth=0.0, rule="defer"), dict(keep=0.3, width=2, rule="defer")]


_TOKENS: dict[int, TokenBytes] = {}


def _tokens(rows) -> TokenBytes:
    if id(rows.codec) not in _TOKENS:
        _TOKENS[id(rows.codec)] = TokenBytes(rows.codec.token_bytes)
    return _TOKENS[id(rows.codec)]


def _model(rows, take=None, **kw) -> ByteModel:
    return ByteModel(_tokens(rows), rows.start, take or rows.entries, Pruning(**kw))


def _walk(rows, data: bytes, **kw) -> tuple[np.ndarray, np.ndarray]:
    """The state's log-probability of each byte of ``data`` and of the end after it, and its last
    257-way distribution."""
    st = _model(rows, **kw)
    out = []
    for b in data:
        out.append(st.next_distribution()[b])
        st.advance(b)
    last = st.next_distribution()
    return np.array(out + [last[END_SYMBOL]]), last


def test_next_byte_sums_splits_a_span_by_its_next_byte():
    col = np.array([-1, -1, 3, 3, 7, 255], dtype=np.int16)
    p = np.array([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625])
    out = next_byte_sums(p, col)
    assert out[3] == 0.1875 and out[7] == 0.03125 and out[255] == 0.015625
    assert out.sum() == pytest.approx(p[2:].sum()) and np.count_nonzero(out) == 3


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prune", PRUNINGS)
def test_the_state_is_score_bytes_byte_by_byte(fake, family, prune):
    """Every byte's probability and the end's, as the state gives them one at a time, equal
    ``score_bytes`` of the whole string within 1e-9 (exact, default and pruned trees, smoothed or not)."""
    rows = fake[family]
    tokens = _tokens(rows)
    for data in [b"abbab", b"ba", b"aaaab", b"abzab"]:  # z: a byte the model never spells (the reserve re-seeds)
        got, _ = _walk(rows, data, **prune)
        want = score_bytes(data, tokens, rows.start, rows.entries, end=True, **prune)
        np.testing.assert_allclose(got[:-1], want.logprobs, rtol=0, atol=1e-9)
        assert math.isclose(got[-1], want.end, abs_tol=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prune", PRUNINGS)
def test_the_257_outcomes_sum_to_one(fake, family, prune):
    rows = fake[family]
    st = _model(rows, **prune)
    for b in b"abbaab":
        assert abs(np.exp(st.next_distribution()).sum() - 1.0) < 1e-12
        st.advance(b)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_exact_state_is_the_brute_force(fake, family):
    """``keep=0, width=None, smooth=0``: after each string of length < MAX_LEN, the state's probability of
    each next byte and of the end is the brute force's (the probability that the text starts with the
    string and that byte, or ends there, over that of the string)."""
    rows = fake[family]
    every, ended = _brute_all(rows)
    for n in range(MAX_LEN):
        for s in (bytes(c) for c in itertools.product(ALPHABET, repeat=n)):
            st = _model(rows, keep=0.0, width=None, smooth=0.0)
            for b in s:
                st.advance(b)
            q = np.exp(st.next_distribution())
            base = every.get(s, 0.0) if s else 1.0
            for b in ALPHABET:
                assert math.isclose(q[b] * base, every.get(s + bytes([b]), 0.0), rel_tol=1e-9, abs_tol=1e-15)
            assert math.isclose(q[END_SYMBOL] * base, ended.get(s, 0.0), rel_tol=1e-9, abs_tol=1e-15)
            assert q[[c for c in range(256) if c not in ALPHABET]].sum() == 0.0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=hs.binary(min_size=1, max_size=8).map(lambda b: bytes(ALPHABET[x % 2] for x in b)),
       keep=hs.sampled_from([0.0, 1e-3, 0.05]), width=hs.sampled_from([None, 1, 2, 3]),
       rule=hs.sampled_from(["top", "defer", "reserve"]), family=hs.sampled_from(FAMILIES))
def test_property_the_state_is_score_bytes(fake, data, keep, width, rule, family):
    rows = fake[family]
    got, _ = _walk(rows, data, keep=keep, width=width, rule=rule)
    want = score_bytes(data, _tokens(rows), rows.start, rows.entries, end=True, keep=keep, width=width,
                       rule=rule)
    np.testing.assert_allclose(got[:-1], want.logprobs, rtol=0, atol=1e-9)
    assert math.isclose(got[-1], want.end, abs_tol=1e-9)


def test_rows_are_read_once_and_dead_histories_go(fake):
    """Each history's row is read once (the state reads what ``score_bytes`` reads, whole), and after many bytes
    the live histories are few (those whose tokens can still spell further)."""
    rows = fake["qwen"]
    calls = []

    def take(lists, ids):
        calls.extend(tuple(x) for x in lists)
        return rows.entries(lists, ids)

    data = b"abbabaabbbab"
    st = _model(rows, take, keep=0.0, width=3)
    for b in data:
        st.next_distribution()
        st.next_distribution()
        st.advance(b)
    st.next_distribution()
    assert len(calls) == len(set(calls)) == st.rows
    want = score_bytes(data, _tokens(rows), rows.start, rows.entries, keep=0.0, width=3, end=True)
    assert st.rows == want.rows  # the end's rows included
    longest = max(len(b) for b in rows.codec.token_bytes if b and set(b) <= set(ALPHABET))
    assert all(len(data) - h.at < longest for h in st.live)


def test_a_bad_byte_is_refused(fake):
    st = _model(fake["gemma3"])
    with pytest.raises(ValueError, match="byte"):
        st.advance(256)


@pytest.mark.parametrize("prune", PRUNINGS)
def test_a_fork_continues_as_a_model_of_the_whole_text(fake, prune):
    """Forks of a model after a context, each advanced by its own continuation (one first reading whole
    next distributions), give each byte what a model of context + continuation gives, bit for bit, and
    leave the forked model where it was."""
    rows = fake["qwen"]
    ctx, conts = b"abba", [b"ab", b"ba", b"bbab"]
    model = _model(rows, **prune)
    for b in ctx:
        model.advance(b)
    before = model.next_distribution().copy()
    for k, cont in enumerate(conts):
        fork = model.fork()
        got = []
        for b in cont:
            if k == 0:
                fork.next_distribution()
            got.append(fork.advance(b))
        whole = _model(rows, **prune)
        want = [whole.advance(b) for b in ctx + cont][len(ctx):]
        assert got == want
    assert np.array_equal(model.next_distribution(), before) and len(model) == len(ctx)
