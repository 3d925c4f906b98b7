"""A member's probability of a union entry, the one rule (``tokenfuse.alignment.entry_probs``), on the
real SmolLM2, Qwen and Gemma-3 tokenizers' union: the projection by gathers against the former
``index_add_`` projection (kept here as the reference), the entry probabilities against the
projection's columns and the sub-token aligner's ids, the call sites (``piece_probs``, UniTE) against
direct computations, and the greedy decision (exact ties, agreement skip, the torch paths a GPU
takes) against the former numpy rules, on constructed cases with exact answers.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfuse import Ensemble
from tokenfuse.combiners import Dist, StepView
from tokenfuse.combiners.contrast import head_columns_numpy, head_columns_torch
from tokenfuse.engine import Sampling
from tokenfuse.engine.decide import argmax_ties_numpy, argmax_ties_torch
from tokenfuse.engine.pool import MemberOutput, top_text_torch
from tokenfuse.engine.sampling import choose
from tokenfuse.members.base import SeqState

NAMES = ("smollm2-1", "qwen-2", "gemma3-3")  # members 0, 1, 2; SmolLM2's logits have 64 padding rows
SMOL, QWEN, GEMMA = range(3)


@pytest.fixture(scope="module")
def members(make_tiny):
    return [make_tiny("smollm2", seed=1, pad=64), make_tiny("qwen", seed=2), make_tiny("gemma3", seed=3)]


@pytest.fixture(scope="module")
def ens(members, align_cache):
    return Ensemble(members, primary="qwen-2", align_cache=align_cache)


@pytest.fixture(scope="module")
def space(ens):
    return ens.space


# ------------------------------------------------------------------------------ references
def old_project(union, member: int, logprobs: torch.Tensor) -> torch.Tensor:
    """The former ``Projector.project``: ``index_add_`` of every id into its entry (non-text ids into a
    spare column), renormalised over the text + END mass, non-representable entries zeroed."""
    size = len(union)
    dst = torch.from_numpy(union.maps[member]).clone()
    dst[dst < 0] = size
    v = min(logprobs.shape[-1], dst.numel())
    out = torch.zeros(logprobs.shape[0], size + 1, dtype=torch.float32)
    out.index_add_(1, dst[:v], logprobs[:, :v].exp())
    out = out[:, :size] / out[:, :size].sum(-1, keepdim=True).clamp_min(1e-30)
    out[:, torch.from_numpy(~union.representable)] = 0.0
    return out


def old_ids(union, member: int, entry: int) -> list[int]:
    return np.nonzero(union.maps[member] == entry)[0].tolist()


def direct_probs(union, member: int, row: torch.Tensor, ids: list[list[int]]) -> list[float]:
    """The rule in float64, id by id: each list of ids' mass over the text + END ids' mass."""
    text = float(row[np.nonzero(union.maps[member][: row.shape[-1]] >= 0)[0]].double().exp().sum())
    return [float(row[t].double().exp().sum()) / text if t else 0.0 for t in ids]


def old_top_text(umap: np.ndarray, arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = arr.argmax(axis=-1)
    for r, tid in enumerate(ids):
        if umap[tid] < 0:
            ids[r] = np.where(umap[: arr.shape[-1]] >= 0, arr[r], -np.inf).argmax()
    return ids, arr[np.arange(len(ids)), ids]


def old_agreement(union, members: list[int], lps: dict[int, torch.Tensor]) -> list[int]:
    """The former ``Decider.agreement`` (numpy, group sums by ``bincount``)."""
    rows = len(next(iter(lps.values())))
    agreed = [-2] * rows
    for i in members:
        umap, arr = union.maps[i], lps[i].numpy()
        ids, tops = old_top_text(umap, arr)
        entries = umap[ids]
        counts = np.bincount(umap[umap >= 0], minlength=len(union))
        gids = np.nonzero((umap >= 0) & (counts[np.maximum(umap, 0)] > 1))[0]
        best = own = None
        if len(gids):
            uniq, slot = np.unique(umap[gids], return_inverse=True)
            sums = np.stack([np.bincount(slot, weights=np.exp(arr[r, gids]), minlength=len(uniq)) for r in range(rows)])
            best = sums.max(axis=1)
            own = [sums[r, np.searchsorted(uniq, e)] if e in set(uniq.tolist()) else np.exp(tops[r])
                   for r, e in enumerate(entries.tolist())]
        for r, e in enumerate(entries.tolist()):
            ok = e >= 0 and union.representable[e] and (best is None or own[r] >= best[r])
            if not ok or agreed[r] not in (-2, e):
                agreed[r] = -1
            elif agreed[r] == -2:
                agreed[r] = e
    return [max(a, -1) for a in agreed]


def old_choose(union, primary: int, dist: Dist, row: int, primary_lp: torch.Tensor | None) -> int:
    """The former greedy ``Decider.choose`` / ``_break_tie`` (numpy argmax, ties by the primary's mass)."""
    arr = dist.probs[row].numpy()
    col = int(arr.argmax())
    if np.count_nonzero(arr == arr[col]) > 1:
        cols = np.nonzero(arr == arr[col])[0].tolist()
        if primary_lp is None:
            col = cols[0]
        else:
            def mass(c):
                ids = old_ids(union, primary, dist.entry(row, c))
                return float(primary_lp[ids].exp().sum()) if ids else 0.0

            col = max(cols, key=lambda c: (mass(c), -c))
    return dist.entry(row, col)


# ------------------------------------------------------------------------------ inputs
def logits(space, member: int, rows: int, seed: int, scale: float, width: int = 0) -> torch.Tensor:
    """Random logits of a member's vocabulary (``width`` more or fewer columns)."""
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(rows, space.projector.vocab(member) + width, generator=gen)


def token(space, member: int, piece: bytes) -> int:
    return space.codecs[member].token_bytes.index(piece)


def entry(space, piece: bytes) -> int:
    return space.union.pieces.index(piece)


def shared_multi(space) -> int:
    """An entry Gemma holds under two ids that the other two members hold and every member can hold."""
    inv, rep = space.union.inverse, space.union.representable
    return next(e for e in space.projector.multi(GEMMA).tolist()
                if e > 0 and rep[e] and inv[SMOL][e] >= 0 and inv[QWEN][e] >= 0)


# ------------------------------------------------------------------------------ the tables
def test_each_entry_lists_every_id_of_the_member_in_ascending_order(space):
    union, proj = space.union, space.projector
    for i in range(3):
        multi = proj.multi(i).tolist()
        counts = np.bincount(union.maps[i][union.maps[i] >= 0], minlength=len(union))
        assert multi == np.nonzero(counts > 1)[0].tolist()
        rng = np.random.default_rng(i)
        some = sorted(set(multi) | {0} | set(rng.integers(0, len(union), 300).tolist()))
        got = proj.ids(i, torch.tensor(some + [-1]))
        assert got.shape == (len(some) + 1, max(1, counts.max()))
        spare = proj.vocab(i)
        assert proj.vocab(i) == len(union.maps[i])
        for e, row in zip(some, got.tolist()):
            assert [t for t in row if t != spare] == old_ids(union, i, e) == proj.entry_ids(i, e)
        assert set(got[-1].tolist()) == {spare}
    assert len(proj.multi(GEMMA)) == 110 and proj.ids(GEMMA, proj.multi(GEMMA)).shape == (110, 2)
    assert not proj.multi(SMOL).numel() and not proj.multi(QWEN).numel()


# ------------------------------------------------------------------------------ the projection
@settings(max_examples=30, deadline=None)
@given(member=st.sampled_from([SMOL, QWEN, GEMMA]), seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 3),
       scale=st.floats(0.5, 12.0), width=st.sampled_from([0, -100, 64]), hot=st.booleans())
def test_the_projection_is_the_former_index_add_projection(space, member, seed, rows, scale, width, hot):
    """Within 1e-6, the same argmax, exact zeros where the member has nothing or some member cannot
    hold the entry, the same bits on a second run; ``hot``: a multi-id entry (Gemma) or END made the
    most likely by its ids together."""
    union, proj = space.union, space.projector
    z = logits(space, member, rows, seed, scale, width)
    if hot:
        target = next(e for e in proj.multi(member).tolist() if union.representable[e]) if member == GEMMA else 0
        ids = old_ids(union, member, target)
        z[:, ids] = z.max() + (0.2 if len(ids) > 1 else 1.0)
    lp = torch.log_softmax(z, -1)
    new, old = proj.project(member, lp), old_project(union, member, lp)
    assert new.shape == old.shape == (rows, len(union)) and new.dtype == torch.float32 and new.is_contiguous()
    assert float((new - old).abs().max()) <= 1e-6
    assert torch.equal(new.argmax(-1), old.argmax(-1))
    if hot:
        assert new.argmax(-1).tolist() == [target] * rows
    held = proj.holds(member, torch.arange(len(union))) & torch.from_numpy(union.representable)
    assert not new[:, ~held].any() and bool((new[:, held] == 0).eq(old[:, held] == 0).all())
    blocked = torch.from_numpy(np.nonzero(~union.representable)[0])  # zeroed, their mass still in the divisor
    whole = new.sum(-1).double() + proj.probs(member, lp, blocked).sum(-1)
    assert torch.allclose(whole, torch.ones(rows, dtype=torch.float64), atol=1e-5)
    assert torch.equal(proj.project(member, lp), new)


def test_the_projection_drops_special_ids_and_padding_rows(space):
    """Almost all the mass on non-text ids: the rest is renormalised, exactly as before."""
    proj, union = space.projector, space.union
    lp = torch.full((1, proj.vocab(SMOL) + 64), -30.0)
    specials = np.nonzero(union.maps[SMOL] < 0)[0]
    lp[0, specials] = 0.0
    lp[0, proj.vocab(SMOL):] = 0.0
    a, b = token(space, SMOL, b" cat"), token(space, SMOL, b" dog")
    lp[0, a], lp[0, b] = -1.0, -2.0
    new, old = proj.project(SMOL, lp), old_project(union, SMOL, lp)
    assert float((new - old).abs().max()) <= 1e-7
    assert new[0, entry(space, b" cat")] / new[0, entry(space, b" dog")] == pytest.approx(math.e, rel=1e-5)


# ------------------------------------------------------------------------------ entry probabilities
@settings(max_examples=25, deadline=None)
@given(member=st.sampled_from([SMOL, QWEN, GEMMA]), seed=st.integers(0, 2**31 - 1),
       scale=st.floats(0.5, 8.0), picks=st.lists(st.integers(0, 314_036), min_size=1, max_size=12))
def test_entry_probabilities_are_the_projections_columns(space, member, seed, scale, picks):
    """``probs`` of an entry is the projection's column (each row's top entries, END, the multi-id
    ones, random ones; ``-1`` and entries the member lacks are 0); a non-representable entry keeps
    the mass the projection zeroes; ``logprobs`` is its log; ``masses`` sums what it is given."""
    union, proj = space.union, space.projector
    lp = torch.log_softmax(logits(space, member, 2, seed, scale), -1)
    full = proj.project(member, lp)
    picks = [e % len(union) for e in picks]
    blocked = np.nonzero(~union.representable & (union.inverse[member] >= 0))[0][:2].tolist()
    extra = [0, -1, *proj.multi(member)[:3].tolist(), *blocked, *picks]
    entries = torch.cat([full.topk(4, -1).indices, torch.tensor(extra).expand(2, -1)], 1)
    got = proj.probs(member, lp, entries)
    assert got.dtype == torch.float64 and got.shape == entries.shape
    ids = [[old_ids(union, member, e) if e >= 0 else [] for e in entries[r].tolist()] for r in range(2)]
    for r in range(2):
        assert got[r].tolist() == pytest.approx(direct_probs(union, member, lp[r], ids[r]), rel=1e-6, abs=1e-12)
        for e, t, p in zip(entries[r].tolist(), ids[r], got[r].tolist()):
            if not t:
                assert p == 0.0
            elif union.representable[e]:
                assert abs(p - float(full[r, e])) <= 1e-6
    every_row = proj.probs(member, lp, torch.tensor(extra))  # entries [n]: the same on every row
    assert torch.allclose(every_row, got[:, 4:], rtol=1e-12, atol=0.0)
    assert torch.equal(proj.logprobs(member, lp, entries), got.log())
    p = lp.exp()
    sums = proj.masses(member, p, entries)
    ref = [float(p[r, t].double().sum()) for r in range(2) for t in ids[r]]
    assert sums.flatten().tolist() == pytest.approx(ref, rel=1e-6, abs=0.0)
    assert torch.allclose(proj.masses(member, lp, entries, log=True), sums, rtol=1e-6, atol=0.0)


def test_text_logmass_both_ways(space):
    """The whole row's mass less the special ids' and, where those hold most of it, the text ids' own
    ``logsumexp``: both the text + END mass to 1e-6 (normalised rows or not)."""
    union, proj = space.union, space.projector
    lp = torch.log_softmax(logits(space, GEMMA, 3, 7, 3.0), -1)
    lp[1] += 5.0  # not normalised
    heavy = lp[2].clone()
    heavy[union.maps[GEMMA] < 0] = 2.0  # the special ids hold almost everything
    lp[2] = heavy
    text = torch.from_numpy(union.maps[GEMMA] >= 0)
    want = lp[:, text].double().logsumexp(-1)
    assert proj.text_logmass(GEMMA, lp[:2]).tolist() == pytest.approx(want[:2].tolist(), abs=1e-6)
    assert proj.text_logmass(GEMMA, lp).tolist() == pytest.approx(want.tolist(), abs=1e-9)  # the second way
    assert proj.text_logmass(GEMMA, lp[:, :-10]).tolist() == pytest.approx(
        lp[:, :-10][:, text[:-10]].double().logsumexp(-1).tolist(), abs=1e-9)


@settings(max_examples=15, deadline=None)
@given(member=st.sampled_from([SMOL, QWEN, GEMMA]), seed=st.integers(0, 2**31 - 1), n=st.integers(1, 8))
def test_aligned_probabilities_follow_the_subtoken_aligner(space, member, seed, n):
    """``aligned`` is ``aligned_entry`` entry by entry; the probability of the aligned entry is the
    mass on the aligner's ``query_ids`` (the first sub-token's where the member lacks the entry)."""
    union, aligner, proj = space.union, space.aligner, space.projector
    rng = np.random.default_rng(seed)
    lacking = np.nonzero((union.inverse[member] < 0) & union.representable)[0]
    holding = np.nonzero(union.inverse[member] >= 0)[0]
    entries = torch.tensor([rng.choice(lacking, n).tolist() + rng.choice(holding, n).tolist() + [0, -1]])
    aligned = aligner.aligned(member, entries)
    assert aligned.tolist() == [[aligner.aligned_entry(member, e) if e >= 0 else -1 for e in entries[0].tolist()]]
    assert (aligned[0, :n] != entries[0, :n]).all() and torch.equal(aligned[0, n:], entries[0, n:])
    lp = torch.log_softmax(logits(space, member, 1, seed, 4.0), -1)
    got = proj.probs(member, lp, aligned)[0].tolist()
    want = direct_probs(union, member, lp[0],
                        [aligner.query_ids(member, e) if e >= 0 else [] for e in entries[0].tolist()])
    assert got == pytest.approx(want, rel=1e-6, abs=1e-12)


# ------------------------------------------------------------------------------ the call sites
def test_piece_probs_is_the_weighted_rule(ens, space, align_cache):
    """``Combiner.piece_probs`` (GaC): the weighted average of each member's aligned probability."""
    union = space.union
    lps = {i: torch.log_softmax(logits(space, i, 3, 11 + i, 5.0), -1) for i in range(3)}
    only_gemma = int(np.nonzero((union.inverse[GEMMA] >= 0) & (union.inverse[SMOL] < 0) & (union.inverse[QWEN] < 0)
                                & union.representable)[0][0])
    entries = [entry(space, b" the"), only_gemma, 0]
    view = StepView(space=space, models=ens.members, states={i: [None] * 3 for i in range(3)}, computed=[0, 1, 2],
                    weights=[1.0, 2.0, 0.5], logprobs=lps)
    got = ens.combiner.piece_probs(view, entries)
    want = [sum(w / 3.5 * direct_probs(union, i, lps[i][r], [space.aligner.query_ids(i, e)])[0]
                for i, w in zip(range(3), (1.0, 2.0, 0.5))) for r, e in enumerate(entries)]
    assert got.dtype == torch.float64 and got.tolist() == pytest.approx(want, rel=1e-6)


def test_unite_member_probs_are_the_aligned_rule(members, space, align_cache):
    unite = Ensemble(members, method="unite", params={"k": 3}, align_cache=align_cache)
    lps = {i: torch.log_softmax(logits(space, i, 2, 21 + i, 6.0), -1) for i in range(3)}
    states = {i: [SeqState(prompt_ids=[], logprobs=lps[i][r]) for r in range(2)] for i in range(3)}
    view = StepView(space=space, models=unite.members, states=states, computed=[0, 1, 2], weights=[1.0] * 3,
                    topk={i: torch.topk(lps[i], 3, dim=-1) for i in range(3)})
    comb = unite.combiner
    cands = comb.candidates(view)
    avg = torch.zeros(2, max(len(c) for c in cands), dtype=torch.float64)
    for i in range(3):
        got = comb.member_probs(view, i, cands)
        for r, row in enumerate(cands):
            raw = [float(lps[i][r, space.aligner.query_ids(i, e)].double().exp().sum()) for e in row]
            want = [x / sum(raw) for x in raw] + [0.0] * (got.shape[1] - len(row))
            assert got[r].tolist() == pytest.approx(want, rel=1e-12, abs=0.0)
        avg += got * (1.0 / 3.0)  # the combiner's own arithmetic: each weight 1/3, added in order
    dist = comb.combine(view)
    assert torch.equal(dist.probs, avg.float())
    assert [dist.index[r, : len(c)].tolist() for r, c in enumerate(cands)] == cands


def test_contrast_heads_are_the_same_in_numpy_and_torch(space):
    """The plausible set's columns, as numpy finds them on a CPU and torch on another device."""
    pe = space.projector.project(QWEN, torch.log_softmax(logits(space, QWEN, 3, 5, 4.0), -1))
    pe[1, 100:103] = 2 * pe[1].max()  # three tied at the top
    for alpha in (0.01, 0.1, 1.0):
        cut = alpha * pe.max(-1).values
        a, b = head_columns_numpy(pe, cut), head_columns_torch(pe, cut)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert head_columns_numpy(pe, pe.max(-1).values)[0][1] == 3


# ------------------------------------------------------------------------------ the greedy choice
def seq(primary_lp: torch.Tensor | None, *, sampling: Sampling = Sampling(), seed: int = 0):
    return SimpleNamespace(sampling=sampling, states=[SeqState(prompt_ids=[], logprobs=primary_lp) for _ in range(3)],
                           generator=None if sampling.greedy else torch.Generator().manual_seed(seed))


def test_exact_ties_go_to_the_primary_then_the_smaller_entry(ens, space):
    union = space.union
    d = ens.decider
    assert d.primary == QWEN
    cat, dog = entry(space, b" cat"), entry(space, b" dog")
    assert cat < dog  # by bytes
    only_gemma = np.nonzero((union.inverse[GEMMA] >= 0) & (union.inverse[QWEN] < 0) & union.representable)[0][:2]
    probs = torch.rand(6, len(union), generator=torch.Generator().manual_seed(3)) * 0.1
    for r in range(5):
        probs[r, [cat, dog]] = 0.25
    probs[3, only_gemma] = 0.5  # tied, the primary holds neither
    probs[4, [cat, dog, int(only_gemma[0])]] = 0.5  # three-way
    probs[5, dog] = 0.3  # no tie
    lp = torch.full((space.projector.vocab(QWEN),), -20.0)
    prefers_dog = lp.clone()
    prefers_dog[token(space, QWEN, b" cat")], prefers_dog[token(space, QWEN, b" dog")] = -2.0, -1.0
    prefers_cat = lp.clone()
    prefers_cat[token(space, QWEN, b" cat")], prefers_cat[token(space, QWEN, b" dog")] = -1.0, -2.0
    equal = lp.clone()
    equal[[token(space, QWEN, b" cat"), token(space, QWEN, b" dog")]] = -1.5
    seqs = [seq(prefers_dog), seq(prefers_cat), seq(equal), seq(prefers_cat), seq(prefers_dog), seq(prefers_cat)]
    dist = Dist(probs)
    got = d.choose(dist, list(range(6)), seqs)
    assert got == [dog, cat, cat, int(only_gemma[0]), dog, dog]
    assert got == [old_choose(union, QWEN, dist, r, s.states[QWEN].logprobs) for r, s in enumerate(seqs)]
    assert d.choose(dist, [0], [seq(None)]) == [cat]  # no primary row: the smaller entry
    # candidate columns (UniTE, contrast): ties by the entries the columns stand for
    index = torch.tensor([[cat, dog, 7], [cat, dog, 7]])
    cand = Dist(torch.tensor([[0.4, 0.4, 0.2], [0.4, 0.4, 0.2]]), index)
    assert d.choose(cand, [0, 1], [seqs[0], seqs[1]]) == [dog, cat] == [
        old_choose(union, QWEN, cand, r, seqs[r].states[QWEN].logprobs) for r in range(2)]
    # sampled rows still draw with their own generator
    hot = Sampling(temperature=1.0, seed=5)
    drawn = choose(dist.probs[5], hot, torch.Generator().manual_seed(5))
    assert d.choose(dist, [5, 0], [seq(None, sampling=hot, seed=5), seqs[0]]) == [drawn, dog]


def test_tie_break_sums_an_entry_held_under_several_ids(members, space, align_cache):
    """Primary Gemma: an entry it holds under two ids (0.25 + 0.25) beats one of 0.4 at a tie."""
    d = Ensemble(members, primary="gemma3-3", align_cache=align_cache).decider
    dup, single = shared_multi(space), entry(space, b" cat")
    lp = torch.full((space.projector.vocab(GEMMA),), -30.0)
    lp[space.projector.entry_ids(GEMMA, dup)] = math.log(0.25)
    lp[token(space, GEMMA, b" cat")] = math.log(0.4)
    probs = torch.zeros(1, len(space.union))
    probs[0, [dup, single]] = 0.5
    dist = Dist(probs)
    assert d.choose(dist, [0], [seq(lp)]) == [dup] == [old_choose(space.union, GEMMA, dist, 0, lp)]
    lp[space.projector.entry_ids(GEMMA, dup)[1]] = -30.0
    assert d.choose(dist, [0], [seq(lp)]) == [single] == [old_choose(space.union, GEMMA, dist, 0, lp)]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), ties=st.integers(0, 4), rows=st.integers(1, 4))
def test_argmax_ties_on_torch_are_numpys(seed, ties, rows):
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(rows, 5000, generator=gen)
    cols = torch.randint(0, 5000, (ties,), generator=gen)
    p[:, cols] = 2.0
    want = [argmax_ties_numpy(row.numpy()) for row in p]
    assert argmax_ties_torch(p) == want
    assert all(c == sorted(set(cols.tolist())) for c in want) if ties else all(len(c) == 1 for c in want)


# ------------------------------------------------------------------------------ agreement skip
def test_agreement_skip_on_constructed_rows(members, ens, space):
    """Row by row: all agree on " the"; Gemma prefers " a"; Gemma's top id is " the" but an entry it
    holds under two ids has more mass; that entry is everyone's top (Gemma by its first id); Qwen's
    top id is a special token (its best text id agrees); Gemma's top is an entry some member cannot
    hold. The same answers as the former numpy rule, and the top text ids of the torch path."""
    union = space.union
    the, a, dup = entry(space, b" the"), entry(space, b" a"), shared_multi(space)
    blocked = int(np.nonzero(~union.representable & (union.inverse[GEMMA] >= 0))[0][0])
    z = {i: logits(space, i, 6, 40 + i, 1.0) for i in range(3)}
    for i in range(3):
        z[i][:, token(space, i, b" the")] = 8.0
    z[GEMMA][5, space.projector.entry_ids(GEMMA, blocked)] = 9.0
    z[GEMMA][1, token(space, GEMMA, b" a")] = 9.0
    z[GEMMA][2, space.projector.entry_ids(GEMMA, dup)] = 7.8  # 2 e^7.8 > e^8
    for i in (SMOL, QWEN):
        z[i][3, space.projector.entry_ids(i, dup)] = 9.0
    g1, g2 = space.projector.entry_ids(GEMMA, dup)
    z[GEMMA][3, g1], z[GEMMA][3, g2], z[GEMMA][3, token(space, GEMMA, b" the")] = 8.0, 7.5, 0.0
    z[QWEN][4, int(np.nonzero(union.maps[QWEN] < 0)[0][0])] = 12.0
    lps = {i: torch.log_softmax(z[i], -1) for i in range(3)}
    seqs = [SimpleNamespace(states=[SeqState(prompt_ids=[], logprobs=lps[i][r]) for i in range(3)]) for r in range(6)]
    outs = {i: MemberOutput(logprobs=lps[i]) for i in range(3)}
    want = [the, -1, -1, dup, the, -1]
    assert ens.decider.agreement(seqs, [0, 1, 2], outs) == want == old_agreement(union, [0, 1, 2], lps)
    assert ens.decider.agreement(seqs, [GEMMA], outs) == [the, a, -1, dup, the, -1]
    assert old_agreement(union, [GEMMA], lps) == [the, a, -1, dup, the, -1]
    assert ens.decider.agreement(seqs, [SMOL, QWEN], outs) == [the, the, the, dup, the, the]
    for i in range(3):
        ids, tops = top_text_torch(lps[i], union.maps[i])
        want_ids, want_tops = old_top_text(union.maps[i], lps[i].numpy())
        assert ids.tolist() == want_ids.tolist() and torch.equal(tops, torch.from_numpy(want_tops))
        got_ids, got_tops = outs[i].top_text(union.maps[i])
        assert got_ids.tolist() == want_ids.tolist() and np.array_equal(got_tops, want_tops)
    assert int(top_text_torch(lps[QWEN], union.maps[QWEN])[0][4]) == token(space, QWEN, b" the")


def test_a_top_id_with_half_the_mass_skips_the_multi_id_masses(members, ens, space, monkeypatch):
    """Where a member's top text id holds half its mass or more, no entry held under several ids can
    hold more, so the agreement needs no multi-id masses for that row: the same answers as the former
    rule, the masses asked only for the other rows."""
    union = space.union
    the, dup = entry(space, b" the"), shared_multi(space)
    z = {i: logits(space, i, 4, 60 + i, 1.0) for i in range(3)}
    for i in range(3):
        z[i][:, token(space, i, b" the")] = 8.0
        z[i][:2, token(space, i, b" the")] = 30.0  # rows 0, 1: p(" the") ~ 1
    z[GEMMA][1, space.projector.entry_ids(GEMMA, dup)] = 29.0  # 2 e^29 < e^30: still " the"
    z[GEMMA][3, space.projector.entry_ids(GEMMA, dup)] = 7.8  # 2 e^7.8 > e^8, both far below half
    lps = {i: torch.log_softmax(z[i], -1) for i in range(3)}
    seqs = [SimpleNamespace(states=[SeqState(prompt_ids=[], logprobs=lps[i][r]) for i in range(3)]) for r in range(4)]
    outs = {i: MemberOutput(logprobs=lps[i]) for i in range(3)}
    asked = []
    beats = ens.decider._beats_multi
    monkeypatch.setattr(ens.decider, "_beats_multi",
                        lambda i, s, rows, e, t, out: asked.append(len(rows)) or beats(i, s, rows, e, t, out))
    assert ens.decider.agreement(seqs, [0, 1, 2], outs) == [the, the, the, -1] == old_agreement(union, [0, 1, 2], lps)
    assert asked and all(n == 2 for n in asked)  # rows 2 and 3 only, for each member holding multi-id entries
