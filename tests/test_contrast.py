"""Contrastive decoding across tokenizers (``method: contrast``, ``combiners/contrast.py``): the rule
on hand-written distributions and on random ones against a direct computation, the plausible set,
β = 0 as the expert alone, member order, agreement skip, the trace's terms, mixed-script prompts on
the three tokenizer families, likelihood scoring and the parameters."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_unite import Fixed

from tokenfuse import Ensemble
from tokenfuse.cli import _methods
from tokenfuse.combiners import Setup, StepView, get_combiner
from tokenfuse.engine import EnsembleOptions, Sampling
from tokenfuse.errors import ConfigError
from tokenfuse.members.codec import ByteCodec

PROMPT = "Once upon a time there was"
MIXED = ["Привет, мир! Hello", "東京は日本の首都です。", "emoji 🎉🚀 test",
         "Mixed: café, 北京, Москва 🙂 ok"]  # Cyrillic + Latin, CJK, emoji, all four


@pytest.fixture(scope="module")
def fixed(tokenizers):
    codecs = {k: ByteCodec(t) for k, t in tokenizers.items()}

    def make(family, probs, name, weight=1.0):
        return Fixed(name, tokenizers[family], codecs[family], probs, weight=weight)

    return make


def first_step(ens: Ensemble, prompt: str = "x"):
    """The first step's view and contrastive distribution as ``{piece: probability}`` (non-zero only)."""
    seq = ens.open(prompt)
    members = ens.decider.computed()
    view = ens.decider.view([seq], members, ens.decider.forward(members, [seq]))
    dist = ens.combiner.combine(view)
    ens.close(seq)
    return view, dist, {ens.union.pieces[dist.entry(0, c)]: p for c, p in enumerate(dist.probs[0].tolist()) if p > 0}


def softmax(scores: dict[bytes, float]) -> dict[bytes, float]:
    top = max(scores.values())
    z = sum(math.exp(s - top) for s in scores.values())
    return {k: math.exp(s - top) / z for k, s in scores.items()}


# ---------------------------------------------------------------------------------------- the rule
def test_the_rule_on_written_distributions(fixed, align_cache):
    """Qwen (the expert) holds " Aberdeen"; SmolLM2 splits it " Aber" + "deen" and is asked for " Aber"."""
    expert = fixed("qwen", {b" Aberdeen": 0.5, b" London": 0.35, b" cat": 0.1, b" dog": 0.05}, "E")
    amateur = fixed("smollm2", {b" London": 0.6, b" Aber": 0.3, b" cat": 0.1}, "A")
    ens = Ensemble([amateur, expert], method="contrast", params={"alpha": 0.15, "beta": 0.5}, primary="E",
                   align_cache=align_cache)
    view, dist, got = first_step(ens)
    # V_head: p_E >= 0.15 * 0.5 -> " Aberdeen", " London", " cat" (" dog" 0.05 is out)
    pa = {b" Aberdeen": 0.3, b" London": 0.6, b" cat": 0.1}
    pe = {b" Aberdeen": 0.5, b" London": 0.35, b" cat": 0.1}
    expect = softmax({k: math.log(pe[k]) - 0.5 * math.log(pa[k]) for k in pe})
    assert got == pytest.approx(expect, abs=1e-6)
    assert [ens.union.pieces[e] for e in dist.index[0].tolist()] == sorted(pe)  # by bytes
    entries = [ens.union.pieces.index(p) for p in (b" cat", b" dog")]
    assert ens.combiner.piece_probs(view, entries[:1]).tolist() == pytest.approx([expect[b" cat"]], abs=1e-6)
    assert ens.combiner.piece_probs(view, entries[1:]).tolist() == [0.0]  # outside V_head
    # an amateur with no mass on a plausible piece counts it as 1e-30: finite, and strongly preferred
    ens = ens.variant(ens.options.replace(params={"alpha": 0.09}))
    _, _, got = first_step(ens)
    scores = {k: math.log(v) - 0.5 * math.log(pa.get(k, 1e-30)) for k, v in {**pe, b" dog": 0.05}.items()}
    assert got == pytest.approx(softmax(scores), abs=1e-6) and max(got, key=got.get) == b" dog"


def test_weighted_amateurs(fixed, align_cache):
    e = fixed("qwen", {b" cat": 0.6, b" dog": 0.4}, "E", weight=0.1)  # the expert's weight plays no part
    a = fixed("smollm2", {b" cat": 0.7, b" dog": 0.3}, "A", weight=3.0)
    c = fixed("gemma3", {b" cat": 0.2, b" dog": 0.8}, "C", weight=1.0)
    _, _, got = first_step(Ensemble([a, c, e], method="contrast", params={"beta": 2.0}, primary="E",
                                    align_cache=align_cache))
    score = {k: math.log(pe) - 2.0 * (0.75 * math.log(pa) + 0.25 * math.log(pc))
             for k, pe, pa, pc in ((b" cat", 0.6, 0.7, 0.2), (b" dog", 0.4, 0.3, 0.8))}
    assert got == pytest.approx(softmax(score), abs=1e-6)
    _, _, got = first_step(Ensemble([a, c, e], method="contrast", params={"beta": 2.0}, primary="E",
                                    weights={"C": 0.0}, align_cache=align_cache))  # C not computed: A alone
    assert got == pytest.approx(softmax({b" cat": math.log(0.6 / 0.7 ** 2), b" dog": math.log(0.4 / 0.3 ** 2)}),
                                abs=1e-6)
    _, _, got = first_step(Ensemble([a, c, e], method="contrast", primary="E", weights={"A": 0.0, "C": 0.0},
                                    align_cache=align_cache))  # no amateur: the expert alone, its whole distribution
    assert got == pytest.approx({b" cat": 0.6, b" dog": 0.4}, abs=1e-6)


@pytest.fixture(scope="module")
def space_ens(members, align_cache):
    return Ensemble(members, method="contrast", primary="B", align_cache=align_cache)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), alpha=st.floats(0.01, 1.0), beta=st.floats(0.0, 3.0),
       wa=st.floats(0.1, 3.0), wc=st.floats(0.1, 3.0))
def test_the_rule_on_random_distributions(space_ens, seed, alpha, beta, wa, wc):
    """Two rows of sharp random distributions over the real vocabularies against a direct computation;
    every piece with probability is in V_head, every piece of V_head has it."""
    space = space_ens.space
    gen = torch.Generator().manual_seed(seed)
    lps = {i: torch.log_softmax(4 * torch.randn(2, len(space.codecs[i].token_bytes), generator=gen), -1)
           for i in range(3)}
    view = StepView(space=space, models=space_ens.members, states={i: [None, None] for i in range(3)},
                    computed=[0, 1, 2], weights=[wa, 1.0, wc], logprobs=lps)
    comb = get_combiner("contrast", alpha=alpha, beta=beta)
    comb.bind(Setup(space, space_ens.members, primary=1))
    dist = comb.combine(view)
    for r in range(2):
        pe = space.project(1, lps[1][r: r + 1])[0].double().numpy()
        head = np.nonzero(pe >= alpha * pe.max())[0].tolist()
        scores = {}
        for e in head:
            score = math.log(pe[e])
            for i, w in ((0, wa / (wa + wc)), (2, wc / (wa + wc))):
                text = torch.from_numpy(space.union.maps[i] >= 0)
                p = float(lps[i][r, space.aligner.query_ids(i, e)].double().exp().sum()
                          / lps[i][r, text].double().exp().sum())
                score -= beta * w * math.log(max(p, 1e-30))
            scores[e] = score
        head = sorted(head)
        assert [dist.entry(r, c) for c in range(len(head))] == head  # V_head, by bytes; then padding
        expect = softmax(scores)
        assert dist.probs[r, : len(head)].tolist() == pytest.approx([expect[e] for e in head], rel=1e-4, abs=1e-7)
        assert not dist.probs[r, len(head):].any()


def test_a_piece_outside_the_plausible_set_is_never_chosen(fixed, align_cache):
    """" pig" has the best score by far (the amateur gives it nothing) but p_E(" pig") = 0.04 < 0.1 · 0.5."""
    e = fixed("qwen", {b" cat": 0.5, b" dog": 0.46, b" pig": 0.04}, "E")
    a = fixed("gemma3", {b" cat": 0.6, b" dog": 0.4}, "A")
    for alpha, expect in ((0.1, {" dog"}), (0.05, {" pig"})):
        ens = Ensemble([e, a], method="contrast", params={"alpha": alpha}, primary="E", align_cache=align_cache)
        assert {ens.generate("x", max_new_tokens=1).text} == expect
        drawn = {ens.generate("x", max_new_tokens=1, sampling=Sampling(temperature=1.0, seed=s)).text
                 for s in range(40)}
        assert (" pig" in drawn) == (alpha == 0.05) and drawn <= {" cat", " dog", " pig"}


# ---------------------------------------------------------------------------------------- β = 0, order, skip
@pytest.mark.parametrize("prompt", [PROMPT, MIXED[1]])
def test_beta_0_is_the_expert_alone(members, align_cache, prompt):
    alone = Ensemble.single(members[1]).generate(prompt, max_new_tokens=12)
    for skip in (None, False):
        ens = Ensemble(members, method="contrast", params={"beta": 0}, primary="B", agreement_skip=skip,
                       align_cache=align_cache)
        assert ens.combiner.exact_agreement
        g = ens.generate(prompt, max_new_tokens=12)
        assert (g.output, g.member_ids["B"], g.ensembled_steps) == (alone.output, alone.member_ids["B"], g.steps)
    assert g.output != Ensemble(members, method="contrast", primary="B").generate(prompt, max_new_tokens=12).output


def test_agreement_skip_is_exact_only_for_beta_0(fixed, align_cache):
    """Both rank " cat" first; with β = 0.5 " dog" scores higher (the module docstring's example)."""
    e = fixed("qwen", {b" cat": 0.5, b" dog": 0.4, b" cow": 0.1}, "E")
    a = fixed("gemma3", {b" cat": 0.9, b" dog": 0.01, b" cow": 0.09}, "A")
    ens = Ensemble([e, a], method="contrast", primary="E", align_cache=align_cache)
    assert not ens.combiner.exact_agreement
    g = ens.generate("x", max_new_tokens=1)
    assert (g.text, g.skipped_steps, g.ensembled_steps) == (" dog", 0, 1)
    forced = Ensemble([e, a], method="contrast", primary="E", agreement_skip=True, align_cache=align_cache)
    assert forced.generate("x", max_new_tokens=1).text == " cat"  # forcing it changes the choice
    g = Ensemble([e, a], method="contrast", params={"beta": 0}, primary="E", align_cache=align_cache).generate(
        "x", max_new_tokens=1)
    assert (g.text, g.skipped_steps) == (" cat", 1)


def test_the_same_output_whatever_the_member_order(members, align_cache):
    sampling = Sampling(temperature=0.8, seed=3)
    runs = []
    for order in itertools.permutations(members):
        ens = Ensemble(list(order), method="contrast", params={"alpha": 0.05, "beta": 0.7}, primary="B",
                       align_cache=align_cache)
        greedy = ens.generate(PROMPT, max_new_tokens=8, trace=True)
        drawn = ens.generate(MIXED[3], max_new_tokens=8, sampling=sampling)
        runs.append((greedy.output, greedy.member_ids, [s.terms for s in greedy.trace], drawn.output,
                     drawn.member_ids))
    assert all(r == runs[0] for r in runs[1:])


def test_the_expert_needs_a_weight(make_tiny):
    with pytest.raises(ConfigError, match="members.weight: contrast: the expert is the primary member 'A'"):
        Ensemble([make_tiny("smollm2", seed=0, name="A", weight=0.0), make_tiny("qwen", seed=1, name="B")],
                 method="contrast", primary="A")


# ---------------------------------------------------------------------------------------- trace, scripts
def test_trace_shows_the_terms(members, align_cache, make_tiny):
    trio = [make_tiny("smollm2", seed=0, name="A", weight=2.0), members[1], members[2]]
    ens = Ensemble(trio, method="contrast", params={"beta": 0.8}, primary="B", align_cache=align_cache)
    g = ens.generate(PROMPT, max_new_tokens=8, trace=True, trace_k=3)
    assert g.text == ens.generate(PROMPT, max_new_tokens=8).text
    for s in g.trace:
        t = s.terms
        assert set(t) == {"score", "expert:B", "amateur:A", "amateur:C"} and s.to_dict()["terms"] == t
        assert t["score"] == pytest.approx(t["expert:B"] - 0.8 * (2 / 3 * t["amateur:A"] + 1 / 3 * t["amateur:C"]))
        assert s.prob == s.top[0].prob and all(x <= 1e-6 for k, x in t.items() if k != "score")
        # B's own probability of the piece, renormalised over its text + END ids (the trace's is over all ids)
        assert math.exp(t["expert:B"]) == pytest.approx(s.members[1].piece_prob, rel=2e-2)


@pytest.mark.parametrize("prompt", MIXED)
def test_mixed_scripts_across_the_three_families(members, align_cache, prompt):
    for expert, sampling in itertools.product("ABC", (Sampling(), Sampling(temperature=1.0, seed=1))):
        ens = Ensemble(members, method="contrast", primary=expert, align_cache=align_cache)
        g = ens.generate(prompt, max_new_tokens=10, sampling=sampling, trace=True)
        assert g.steps > 0 and g.text == g.output.decode("utf-8", errors="replace")
        assert "".join(s.text for s in g.trace) == g.text
        for m in members:  # re-synced: every member's ids spell the output (an unfinished character held back)
            got = m.codec.decode(g.member_ids[m.name])
            assert g.output.startswith(got) and len(g.output) - len(got) < 4, (expert, m.name)


# ---------------------------------------------------------------------------------------- scoring, parameters
def test_scoring_one_forward_equals_stepwise(members, align_cache):
    req = [("Question: what is hot?\nAnswer:", " fire"), ("Привет", ", мир 🙂")]
    ens = Ensemble(members, method="contrast", params={"alpha": 1e-12}, primary="B", align_cache=align_cache)
    one, step = ens.loglikelihood(req), ens.loglikelihood(req, stepwise=True)
    assert all(math.isfinite(x.logprob) for x in one)
    assert [x.logprob for x in one] == pytest.approx([x.logprob for x in step], abs=1e-4)
    gac = Ensemble(members, primary="B", align_cache=align_cache).loglikelihood(req)
    assert [x.logprob for x in one] != pytest.approx([x.logprob for x in gac], abs=1e-3)
    cut = ens.variant(ens.options.replace(params={"alpha": 1e-6}))  # some pieces fall outside V_head
    one, step = cut.loglikelihood(req), cut.loglikelihood(req, stepwise=True)
    flat = [p for x in one for p in x.piece_logprobs]
    assert -math.inf in flat and any(math.isfinite(p) for p in flat)
    assert [p for x in step for p in x.piece_logprobs] == pytest.approx(flat, abs=1e-4)


def test_parameters_are_declared_and_checked():
    assert EnsembleOptions(method="contrast", params={"alpha": 1, "beta": 0}).params == {"alpha": 1, "beta": 0}
    c = get_combiner("contrast")
    assert (c.alpha, c.beta, c.exact_agreement, c.adaptive) == (0.1, 0.5, False, False)
    for params, msg in (({"alpha": 0}, "params.alpha: contrast: Input should be greater than 0"),
                        ({"alpha": 1.5}, "params.alpha: contrast: Input should be less than or equal to 1"),
                        ({"beta": -0.1}, "params.beta: contrast: Input should be greater than or equal to 0"),
                        ({"beta": math.inf}, "params.beta: contrast: Input should be a finite number"),
                        ({"alpha": math.nan}, "params.alpha: contrast: Input should be a finite number"),
                        ({"beta": True}, "params.beta: contrast: expected a number, got True"),
                        ({"select": 0.5}, r"params.select: contrast: unexpected keyword argument 'select' "
                                          r"\(known: alpha, beta\)")):
        with pytest.raises(ConfigError, match=msg):
            Ensemble([], method="contrast", params=params)
    assert _methods("gac,unite,contrast") == ("gac", "unite", "contrast")  # the bench's contrast row


def test_speculative_decoding_gives_the_plain_output(members, align_cache):
    plain = Ensemble(members, method="contrast", primary="B", align_cache=align_cache)
    spec = Ensemble(members, method="contrast", primary="B", speculative={"draft": "A", "k": 3},
                    align_cache=align_cache)
    for prompt in (PROMPT, MIXED[3]):
        a, b = plain.generate(prompt, max_new_tokens=10), spec.generate(prompt, max_new_tokens=10)
        assert (b.output, b.member_ids) == (a.output, a.member_ids) and b.drafted > 0
