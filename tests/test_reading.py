"""A member's reader (``Member.reader``, ``members/reading.py``): the rows after many id lists along one
text, whole or by entries, the same numbers as a fresh state's ``positions``."""

from __future__ import annotations

import numpy as np
import pytest

from tokenfuse.members.reading import positions
from tokenfuse.members.llamacpp_tree import TreeReader


def _fresh(member, start, lists):
    """Each list's whole row on a state of its own (one prefill each)."""
    out = []
    for x in lists:
        st = member.new_state(start)
        try:
            out.append(positions(member, st, [x])[0].numpy().astype(np.float64))
        finally:
            member.release(st)
    return out


@pytest.mark.parametrize("family", ["smollm2", "gemma3"])
def test_a_state_reader_gives_whole_rows_and_entries_of_fresh_states(make_tiny, one_thread, family):
    """Lists that grow, branch off and come back, read in several calls (some whole, some by entries, some
    calls mixing the two): every answer is the row a fresh state gives after that list (float rounding
    of a cache against a prefill), the entries those rows' entries."""
    m = make_tiny(family, seed=3, name=family)
    start = m.encode_prompt("")
    trunk = start + m.codec.encode_text("ab, ba ab ba")
    calls = [[trunk[:3], trunk[:4], trunk[:6]],
             [trunk[:4] + [7], trunk[:6] + [9, 11]],
             [trunk, trunk[:5], trunk[:2] + [5]]]
    picks = [[None, None, None], [[1, 2, 3], [4]], [None, [8, 9], [0, 1, 2, 3]]]
    with m.reader(start) as take:
        got = [take(lists, ids) for lists, ids in zip(calls, picks)]
    for lists, ids, rows in zip(calls, picks, got):
        for want, x, row in zip(_fresh(m, start, lists), ids, rows):
            expect = want if x is None else want[np.asarray(x)]
            assert row.dtype == np.float64 and row.shape == expect.shape
            # float32 rounding of a cache against a prefill: a few units in the last place of the value
            # (which kernels the CPU runs sets how many; 6 ulps at -20.45 seen on AVX-512, 1.1e-5)
            np.testing.assert_allclose(row, expect, rtol=4 * np.finfo(np.float32).eps, atol=1e-5)


def test_the_llamacpp_reader_is_the_tree_with_shared_calls_and_states_without(llamacpp_members):
    """``shared`` reads branches in the tree reader's shared calls; without it (byte-level generation) on
    sequence states. A whole row and a pick of it in one call are the same numbers bit for bit."""
    m = llamacpp_members["smollm2"]
    start = m.encode_prompt("")
    x = start + m.codec.encode_text(" Paris is the capital")
    ids = [5, 17, 300]
    with m.reader(start) as take:
        assert isinstance(take.__self__, TreeReader)
        whole, picked = take([x, x], [None, ids])
    assert whole.shape == (m.n_vocab,) and np.array_equal(whole[ids], picked)
    with m.reader(start, shared=False) as take:
        assert not isinstance(getattr(take, "__self__", None), TreeReader)
        whole, picked = take([x, x], [None, ids])
    assert np.array_equal(whole[ids], picked)
