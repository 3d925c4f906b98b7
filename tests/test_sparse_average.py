"""GaC's argmax-only combination (``combiners.base.sparse_average``) against the dense average over
the whole union, on the real SmolLM2, Qwen and Gemma-3 tokenizers' union: the same argmax wherever it
answers, ``None`` (the dense path) at near ties and on flat rows, the entries Gemma holds under two
ids; its parts (``EntryProbs.head``, ``close_probs``, ``multi_masses``) against the rule's own
numbers; and the engine's greedy output with it against the output without it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenfuse.combiners.gac as gac_module
from tokenfuse import Ensemble
from tokenfuse.combiners import StepView
from tokenfuse.combiners.base import FLOOR, MARGIN, normalise, sparse_average, weighted_average
from tokenfuse.engine.pool import MemberOutput
from tokenfuse.members.base import SeqState

SMOL, QWEN, GEMMA = range(3)


@pytest.fixture(scope="module")
def ens(make_tiny, align_cache):
    """SmolLM2 (64 padding rows), Qwen (primary) and Gemma-3 tiny members: members 0, 1, 2."""
    tiny = [make_tiny("smollm2", seed=1, pad=64), make_tiny("qwen", seed=2), make_tiny("gemma3", seed=3)]
    return Ensemble(tiny, primary="qwen-2", align_cache=align_cache)


@pytest.fixture(scope="module")
def space(ens):
    return ens.space


def random_lps(space, rows: int, seed: int, scale: float) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {i: torch.log_softmax(scale * torch.randn(rows, space.projector.vocab(i) + (64 if i == SMOL else 0),
                                                     generator=gen), -1) for i in range(3)}


def view_of(ens, lps, weights, factors=None) -> StepView:
    rows = len(lps[0])
    return StepView(space=ens.space, models=ens.members, states={i: [None] * rows for i in range(3)},
                    computed=[0, 1, 2], weights=list(weights), logprobs=lps, log_factors=factors or {},
                    argmax_only=True)


def dense(ens, view) -> torch.Tensor:
    live = ens.combiner.weights(view)
    return weighted_average([view.project(i) for i, _ in live], [w for _, w in live])


def token(space, member: int, piece: bytes) -> int:
    return space.codecs[member].token_bytes.index(piece)


def entry(space, piece: bytes) -> int:
    return space.union.pieces.index(piece)


# ------------------------------------------------------------------------------ the parts
@settings(max_examples=20, deadline=None)
@given(member=st.sampled_from([SMOL, QWEN, GEMMA]), seed=st.integers(0, 2**31 - 1), scale=st.floats(0.5, 10.0))
def test_the_head_bounds_every_entry_it_leaves_out(space, member, seed, scale):
    """Every entry outside the head's has a projected probability below FLOOR over the row's text
    mass; the head's mass is ``text_logmass`` to float32 precision; ``close_probs`` and
    ``multi_masses`` are ``probs`` and ``masses`` to float64 rounding."""
    proj = space.projector
    lp = random_lps(space, 2, seed, scale)[member]
    entries, logmass = proj.head(member, lp, FLOOR)
    assert entries.tolist() == sorted(set(entries.tolist()))
    assert set(proj.multi(member).tolist()) & set(np.nonzero(space.union.representable)[0].tolist()) <= set(
        entries.tolist())
    assert torch.allclose(logmass, proj.text_logmass(member, lp), rtol=0, atol=1e-6)
    full = proj.project(member, lp).double()
    out = torch.ones(len(space.union), dtype=torch.bool)
    out[entries] = False
    bound = FLOOR / logmass.exp()
    assert bool((full[:, out] < bound[:, None] * (1 + 1e-5)).all())
    got = proj.close_probs(member, lp, entries, logmass)
    assert torch.allclose(got, proj.probs(member, lp, entries, logmass), rtol=1e-12, atol=0)
    assert torch.allclose(got.float(), full[:, entries].float(), rtol=1e-5, atol=1e-9)
    if proj.multi(member).numel():
        assert torch.allclose(proj.multi_masses(member, lp), proj.masses(member, lp, proj.multi(member), log=True).double(),
                              rtol=1e-6, atol=0)


@settings(max_examples=15, deadline=None)
@given(member=st.sampled_from([SMOL, QWEN, GEMMA]), seed=st.integers(0, 2**31 - 1), scale=st.floats(0.5, 10.0),
       rows=st.integers(1, 3))
def test_the_heads_torch_path_is_its_numpy_path(space, member, seed, scale, rows):
    """``head`` off the host (here: float64 rows, which numpy does not read as they are; on a GPU: any
    rows) takes its torch path: the same entries and the same mass as the numpy path to float32
    precision."""
    proj = space.projector
    lp = random_lps(space, rows, seed, scale)[member]
    entries, logmass = proj.head(member, lp, FLOOR)
    t_entries, t_logmass = proj.head(member, lp.double(), FLOOR)
    assert t_entries.tolist() == entries.tolist()
    assert torch.allclose(t_logmass, logmass, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------ the combination
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 3), scale=st.floats(0.3, 12.0),
       weights=st.lists(st.floats(0.05, 3.0), min_size=3, max_size=3), per_row=st.booleans())
def test_where_it_answers_it_is_the_dense_argmax(ens, seed, rows, scale, weights, per_row):
    """Random rows, flat to peaked, fixed or per-row weights: a ``Dist`` over candidates whose
    argmax is the dense average's argmax (unique there), or ``None``."""
    lps = random_lps(ens.space, rows, seed, scale)
    factors = {GEMMA: torch.linspace(-1.0, 1.0, rows, dtype=torch.float64)} if per_row else None
    view = view_of(ens, lps, weights, factors)
    got = sparse_average(view, ens.combiner.weights(view))
    full = dense(ens, view)
    if got is None:
        return
    assert got.index is not None and got.probs.shape == got.index.shape
    for r in range(rows):
        best = int(full[r].argmax())
        assert int((full[r] == full[r, best]).sum()) == 1
        assert int(got.index[r, int(got.probs[r].argmax())]) == best
        cols = got.index[r]
        assert torch.allclose(got.probs[r].double(), full[r, cols].double(), rtol=1e-5, atol=1e-9)


def test_peaked_rows_are_answered_and_flat_ones_left_to_the_dense_path(ens):
    answered = [sparse_average(v, ens.combiner.weights(v)) is not None
                for v in (view_of(ens, random_lps(ens.space, 2, seed, 8.0), (1.0, 1.0, 1.0)) for seed in range(6))]
    assert all(answered)
    flat = view_of(ens, random_lps(ens.space, 1, 0, 0.01), (1.0, 1.0, 1.0))  # every entry below the bound
    assert sparse_average(flat, ens.combiner.weights(flat)) is None


def test_a_near_tie_is_left_to_the_dense_path(ens, space):
    """Two entries every member holds, equally likely in every member (or within MARGIN / 10): the
    dense path decides (its tie rule); a clear winner (10 MARGIN ahead) is answered."""
    cat, dog = entry(space, b" cat"), entry(space, b" dog")
    for gap, answered in ((0.0, False), (MARGIN / 10, False), (10 * MARGIN, True)):
        lps = {}
        for i in range(3):
            z = torch.full((1, space.projector.vocab(i) + (64 if i == SMOL else 0)), -8.0)
            z[0, token(space, i, b" cat")] = math.log(0.4) + gap
            z[0, token(space, i, b" dog")] = math.log(0.4)
            lps[i] = torch.log_softmax(z, -1)
        view = view_of(ens, lps, (1.0, 1.0, 1.0))
        got = sparse_average(view, ens.combiner.weights(view))
        assert (got is not None) == answered
        if answered:
            assert int(got.index[0, int(got.probs[0].argmax())]) == cat == int(dense(ens, view)[0].argmax())


def test_an_entry_held_under_two_ids_below_the_floor_still_wins(ens, space):
    """Gemma holds an entry under two ids of 0.007 each (each below FLOOR), everything else flat:
    the entry (always a candidate) is the argmax, answered; with weights that leave it below the
    bound the dense path decides."""
    proj = space.projector
    dup = next(e for e in proj.multi(GEMMA).tolist() if e > 0 and space.union.representable[e])
    lps = {i: torch.log_softmax(torch.zeros(1, proj.vocab(i) + (64 if i == SMOL else 0)), -1) for i in range(3)}
    z = torch.zeros(1, proj.vocab(GEMMA))
    z[0, proj.entry_ids(GEMMA, dup)] = math.log(0.007 * proj.vocab(GEMMA))  # ~0.007 each after normalising
    lps[GEMMA] = torch.log_softmax(z, -1)
    assert float(lps[GEMMA][0, proj.entry_ids(GEMMA, dup)].exp().max()) < FLOOR
    view = view_of(ens, lps, (0.05, 0.05, 0.9))
    got = sparse_average(view, ens.combiner.weights(view))
    assert got is not None and int(got.index[0, int(got.probs[0].argmax())]) == dup == int(dense(ens, view)[0].argmax())
    even = view_of(ens, lps, (1.0, 1.0, 1.0))
    assert sparse_average(even, ens.combiner.weights(even)) is None


def test_the_normalised_weights_are_the_dense_averages(ens):
    """``normalise`` of fixed and per-row weights, as ``weighted_average`` divides them."""
    assert normalise([(0, 1.0), (2, 3.0)]) == [(0, 0.25), (2, 0.75)]
    per_row = normalise([(0, torch.tensor([1.0, 2.0])), (1, torch.tensor([3.0, 2.0]))])
    assert torch.allclose(per_row[0][1], torch.tensor([0.25, 0.5], dtype=torch.float64))


# ------------------------------------------------------------------------------ in the engine
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "日本語の文章", "Once upon a time"]


def test_greedy_generation_is_the_dense_paths(ens, monkeypatch):
    """The engine's greedy output, alone and in a batch, with the argmax-only combination and with
    the dense average only; the argmax-only one was used (and answered) on most combined steps."""
    used = {"asked": 0, "answered": 0}
    real = gac_module.sparse_average

    def counted(view, live):
        used["asked"] += 1
        got = real(view, live)
        used["answered"] += got is not None
        return got

    monkeypatch.setattr(gac_module, "sparse_average", counted)
    fast_alone = [ens.generate(p, max_new_tokens=12).output for p in PROMPTS]
    fast_batch = [g.output for g in ens.generate(PROMPTS, max_new_tokens=12)]
    monkeypatch.setattr(gac_module, "sparse_average", lambda view, live: None)
    plain_alone = [ens.generate(p, max_new_tokens=12).output for p in PROMPTS]
    assert fast_alone == plain_alone == fast_batch
    assert used["asked"] >= 20 and used["answered"] >= used["asked"] // 2


def test_sampled_and_traced_rows_take_the_dense_path(ens, monkeypatch):
    monkeypatch.setattr(gac_module, "sparse_average", lambda view, live: pytest.fail("not an argmax-only step"))
    from tokenfuse.engine import Sampling

    ens.generate(PROMPTS[0], max_new_tokens=4, trace=True)
    ens.generate(PROMPTS[0], max_new_tokens=4, sampling=Sampling(temperature=0.8, seed=1))


def test_agreement_from_top_k_outputs_is_the_full_outputs(ens, space):
    """The multi-id masses asked of the member (top-k outputs) or read from its full output: the same
    agreement, on rows where Gemma's top id loses to or beats an entry it holds under two ids."""
    proj = space.projector
    the = entry(space, b" the")
    dup = next(e for e in proj.multi(GEMMA).tolist() if e > 0 and space.union.representable[e]
               and space.union.inverse[SMOL][e] >= 0 and space.union.inverse[QWEN][e] >= 0)
    gen = torch.Generator().manual_seed(5)
    z = {i: torch.randn(3, proj.vocab(i) + (64 if i == SMOL else 0), generator=gen) for i in range(3)}
    for i in range(3):
        z[i][:, token(space, i, b" the")] = 8.0
    z[GEMMA][1, proj.entry_ids(GEMMA, dup)] = 7.8  # 2 e^7.8 > e^8: Gemma's first entry is not " the"
    z[GEMMA][2, proj.entry_ids(GEMMA, dup)] = 7.0
    lps = {i: torch.log_softmax(z[i], -1) for i in range(3)}
    seqs = [SimpleNamespace(states=[SeqState(prompt_ids=[], logprobs=lps[i][r]) for i in range(3)]) for r in range(3)]
    full = {i: MemberOutput(logprobs=lps[i]) for i in range(3)}
    topk = {i: MemberOutput(topk=torch.topk(lps[i], 5, dim=-1)) for i in range(3)}
    assert ens.decider.agreement(seqs, [0, 1, 2], full) == ens.decider.agreement(seqs, [0, 1, 2], topk) == [the, -1, the]
