"""The llama.cpp member's tree reader (members/llamacpp_tree.py) on the three real bundled GGUF files:
a trunk and its branches in shared calls give the numbers of the same calls made one sequence at a
time in a context of its own, and a byte view read through it stays what it was."""

from __future__ import annotations

import numpy as np
import pytest

from tokenfuse.alignment.byteview import TokenBytes, score_bytes
from tokenfuse.engine.text_features import Rows, primary_tokens

pytestmark = pytest.mark.real

TEXT = " Paris is the capital city of France, and Lyon is the third largest city of the country after"


def _plain(m, trunk: list[int], at: int, call: list[int]) -> list[np.ndarray]:
    """The rows of a call of ``call`` after ``trunk[:at]``, as one sequence in a context of its own
    computes them after the same calls: the whole trunk in one call, cut back to ``at``, then ``call``
    in one call with every position's logits."""
    st = m.new_state(trunk[:1])
    st.ids = list(trunk[1:])
    m.next_logprobs([st])
    st.n_valid = at
    st.ids = list(trunk[1:at]) + list(call)
    st.logprobs = None
    try:
        return [r.numpy().astype(np.float64) for r in m.logprobs_at(st, list(range(at + 1, at + len(call) + 1)))]
    finally:
        m.release(st)


# A row computed in a call with other rows against the same row in a call of its own (total variation;
# measured on the bundled files: at most 0.065, llama.cpp's kernels depending on a call's size; a
# branch that saw cells it should not would be far off).
BATCH_TV = 0.1


def _tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(np.exp(a) - np.exp(b)).sum())


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen"])
def test_trunk_and_branches_are_the_same_calls_made_one_sequence_at_a_time(llamacpp_members, family, monkeypatch):
    """The trunk's rows are one prefill's; a branch alone in its call is the row of that one-id call after
    the trunk's cells in a context of its own, bit for bit; branches in one call are those rows up to
    llama.cpp's dependence on a call's size (``BATCH_TV``)."""
    m = llamacpp_members[family]
    monkeypatch.setattr(m, "prefix_cache", False)  # every reference sequence prefilled from scratch
    trunk = m.encode_prompt("") + m.codec.encode_text(TEXT)
    every = list(range(m.n_vocab))
    rng = np.random.default_rng(0)
    ats = [2, 3, 5, 9, len(trunk) - 3, len(trunk) - 1]
    branches = [trunk[:at] + [int(rng.integers(m.n_vocab))] for at in ats]
    on_trunk = [trunk[:n] for n in (3, 7, len(trunk))]  # rows of the trunk itself, read again later
    with m.reader(m.encode_prompt("")) as take:
        whole = take([trunk[:n] for n in range(1, len(trunk) + 1)], [every] * len(trunk))
        alone = [take([x], [every])[0] for x in branches + on_trunk]
        together = take(branches + on_trunk, [every] * (len(branches) + len(on_trunk)))
    st = m.new_state(trunk[:1])
    st.ids = list(trunk[1:])
    ref = m.logprobs_at(st, list(range(1, len(trunk) + 1)))
    m.release(st)
    for a, b in zip(whole, ref):
        assert np.array_equal(a, b.numpy().astype(np.float64))
    for x, row, with_others in zip(branches + on_trunk, alone, together):
        at = min(len(x) - 1, max(n for n in range(len(x) + 1) if x[:n] == trunk[:n]))
        assert np.array_equal(row, _plain(m, trunk, at, x[at:])[0])  # a row on the trunk: its last id as a branch
        assert _tv(with_others, row) <= BATCH_TV


def _fed(m, first: list[int], steps: list[tuple[int, list[int]]]) -> np.ndarray:
    """The last row after ``first`` fed in one call, then for each step ``(cut, call)`` cut back to ``cut``
    ids and ``call`` fed in one call (one sequence in a context of its own)."""
    st = m.new_state(first[:1])
    st.ids = list(first[1:])
    m.next_logprobs([st])
    seq = list(first)
    try:
        for cut, call in steps:
            seq = seq[:cut] + list(call)
            st.n_valid, st.ids, st.logprobs = cut, seq[1:], None
            row = m.next_logprobs([st])[0]
        return row.numpy().astype(np.float64)
    finally:
        m.release(st)


def test_a_list_a_few_ids_off_the_trunk_is_the_detour_and_one_far_off_the_trunk(llamacpp_members, monkeypatch):
    """A list that leaves the trunk by 2 to ``TAIL`` ids is fed after the trunk's cells it shares, in one
    call, and kept (the detour): the trunk stays, and a list one id past the detour is a branch of it. A
    list that leaves both by more than ``TAIL`` ids becomes the trunk. Each row is that of the same calls
    made one sequence at a time, bit for bit."""
    from tokenfuse.members import llamacpp_tree

    m = llamacpp_members["smollm2"]
    monkeypatch.setattr(m, "prefix_cache", False)
    monkeypatch.setattr(llamacpp_tree, "TAIL", 4)  # short calls: the references' cuts are the reader's
    trunk = m.encode_prompt("") + m.codec.encode_text(TEXT)
    other = trunk[:6] + m.codec.encode_text(" Berlin is a city")
    far = trunk[:4] + m.codec.encode_text(" Rome, Milan and Turin")
    assert 2 <= len(other) - 6 <= 4 < min(len(far) - 4, len(trunk))
    with m.reader(m.encode_prompt("")) as take:
        take([trunk], [[5]])
        row = take([other], [[5, 6]])[0]
        back = take([trunk[:9]], [[5]])[0]  # on the trunk still: its last id decoded again after 8 cells
        more = take([other + [7]], [[5]])[0]  # one id past the detour
        moved = take([far], [[5]])[0]
        again = take([far[:-1] + [9]], [[5]])[0]  # one id off the new trunk
        stats = take.__self__.stats  # its decode calls: three feeds of a kept sequence, three one-id branches
    assert stats["kept"] == llamacpp_tree.CallStats(3, len(trunk) + len(other) - 6 + len(far) - 4, 3,
                                                    stats["kept"].seconds)
    assert stats["branches"] == llamacpp_tree.CallStats(3, 3, 3, stats["branches"].seconds)
    assert stats["kept"].seconds > 0 and stats["branches"].seconds > 0
    assert np.array_equal(row, _plain(m, trunk, 6, other[6:])[-1][[5, 6]])
    assert np.array_equal(back, _plain(m, trunk, 8, trunk[8:9])[-1][[5]])
    assert np.array_equal(more, _fed(m, trunk, [(6, other[6:]), (len(other), [7])])[[5]])
    assert np.array_equal(moved, _fed(m, trunk, [(4, far[4:])])[[5]])
    assert np.array_equal(again, _fed(m, trunk, [(4, far[4:]), (len(far) - 1, [9])])[[5]])


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen"])
def test_a_byte_view_read_through_the_tree_is_deterministic_and_near_the_state_readers(llamacpp_members, family):
    """The tree's rows are those of other calls than the state reader's (which re-feeds every branch
    as a fresh prefill does), so they differ in llama.cpp's last bits and beyond (its quantised
    kernels depend on a call's size: up to 0.6 in one log-probability on these files), not in the
    view's total beyond a small share."""
    m = llamacpp_members[family]
    text = "def area(r):\n    return 3.14159 * r ** 2\n\n# 円の面積を計算する\nprint(area(2.0))\n"
    data, tokens, rows = text.encode(), TokenBytes(m.codec.token_bytes), Rows.from_member(m)
    chain = primary_tokens(m.codec, text)
    runs = []
    for _ in range(2):
        with rows.reader() as take:
            runs.append(score_bytes(data, tokens, rows.start, take, chain=chain, keep=1e-2, width=1))
    assert np.array_equal(runs[0].logprobs, runs[1].logprobs)
    assert runs[0].rows == runs[1].rows
    plain = Rows("plain", m.codec, rows.start, rows.fn, rows.take)  # no held reader: every read a fresh prefill
    with plain.reader() as take:
        ref = score_bytes(data, tokens, rows.start, take, chain=chain, keep=1e-2, width=1)
    assert abs(runs[0].logprobs.sum() - ref.logprobs.sum()) <= 0.01 * abs(ref.logprobs.sum())
    assert np.array_equal(runs[0].chain, ref.chain)  # the chain's rows are one prefill's in both


@pytest.mark.parametrize("rule", ["top", "defer"])
def test_a_view_keeps_mass_where_the_members_longer_tokens_all_miss(llamacpp_members, rule):
    """`` Omit`` is no Qwen token: after ``, O`` most of the prefix mass is on longer tokens (`` Omega``,
    ...) that the next byte kills, and only the history ending at `` O`` goes on. A tree that dropped it
    (below ``keep`` of that mass) gave every later byte no mass; the top rule always keeps a boundary's
    most probable history, the defer rule gives its mass to the bytes no history read spells (and reads
    fewer rows)."""
    m = llamacpp_members["qwen"]
    text = "from typing import Any\n\nfrom openai import AsyncOpenAI, AsyncStream, Omit, omit\n"  # 9 bytes of no mass before
    rows, tokens = Rows.from_member(m), TokenBytes(m.codec.token_bytes)
    with rows.reader() as take:
        s = score_bytes(text.encode(), tokens, rows.start, take, chain=primary_tokens(m.codec, text), smooth=0.0,
                        rule=rule, keep=1e-2 if rule == "top" else 2e-3)
    assert np.all(np.isfinite(s.logprobs)) and s.logprobs.min() > -15
    if rule == "defer":
        assert s.rows < len(text.encode())
