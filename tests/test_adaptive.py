"""Adaptive combination (the step decision's strategies, ``tokenfuse.engine.strategies``): selective ensembling (SAFE-style), per-step
confidence weights, per-prompt PackLLM weights — in generation and in likelihood scoring."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfuse.combiners import StepView, get_combiner
from tokenfuse.combiners.base import weighted_average
from tokenfuse.engine import Ensemble, EnsembleOptions, Sampling
from tokenfuse.engine.strategies.prompt import PROMPT_CHUNK, prompt_logprob_per_byte
from tokenfuse.engine.strategies.confidence import Confidence
from tokenfuse.engine.strategies.gate import Gate
from tokenfuse.engine.pool import MemberOutput
from tokenfuse.errors import ConfigError

PROMPT = "Once upon a time there was"


@pytest.fixture(scope="module")
def trio(members):
    """A, B, C (SmolLM2, Qwen, Gemma-3 tokenizers); B is the primary of every ensemble here."""
    return members


def run(members, **options):
    return Ensemble(members, primary="B", **options).generate(PROMPT, max_new_tokens=10)


# ---------------------------------------------------------------------------------------- parameters
def test_parameters_are_declared_and_checked():
    o = EnsembleOptions(threshold=0.5, params=dict(boundary=True, confidence="entropy", sharpness=2, prompt_weights=0.1))
    assert (o.threshold, o.params["boundary"]) == (0.5, True)
    assert EnsembleOptions(method="unite", threshold=1, params=dict(k=3, boundary=True)).threshold == 1.0
    for params, msg in (({"select": 1.5}, "params.select: gac: Input should be less than or equal to 1"),
                        ({"confidence": "max"}, "params.confidence: gac: Input should be 'none', 'top' or 'entropy'"),
                        ({"sharpness": -1}, "params.sharpness: gac: Input should be greater than or equal to 0"),
                        ({"prompt_weights": 0}, "params.prompt_weights: gac: Input should be greater than 0")):
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            Ensemble([], params=params)
    with pytest.raises(ConfigError, match="params.select: deepen: unexpected keyword argument 'select'"):
        Ensemble([], method="deepen", params={"select": 0.5})
    assert not get_combiner("deepen").adaptive


def test_select_and_a_gate_exclude_each_other(trio):
    with pytest.raises(ConfigError, match="params.select: selective ensembling gates on the primary member"):
        Ensemble(trio, params={"select": 0.5}, gate="A", threshold=0.5)


# ---------------------------------------------------------------------------------------- selective
def test_select_0_is_the_primary_alone(trio):
    alone = Ensemble.single(trio[1]).generate(PROMPT, max_new_tokens=10)
    g = run(trio, threshold=0.0, params={"boundary": True})
    assert (g.text, g.output, g.ensembled_steps) == (alone.text, alone.output, 0)
    assert g.member_ids["B"] == alone.member_ids["B"]
    # Sampling: the primary's distribution over the ensemble's union, as the primary gating at 0 draws
    # it (a member alone has a smaller union, so its seeded draws differ).
    sampling = Sampling(temperature=0.9, seed=7)
    gated = Ensemble(trio, gate="B", threshold=0.0, primary="B").generate(PROMPT, max_new_tokens=10,
                                                                           sampling=sampling)
    g = Ensemble(trio, threshold=0.0, primary="B").generate(PROMPT, max_new_tokens=10,
                                                                            sampling=sampling)
    assert (g.text, g.ensembled_steps) == (gated.text, 0)


@pytest.mark.parametrize("method", ["gac", "unite"])
def test_select_1_without_the_boundary_rule_is_plain_combination(trio, method):
    plain = Ensemble(trio, method=method, primary="B").generate(PROMPT, max_new_tokens=10)
    g = Ensemble(trio, method=method, primary="B", threshold=1.0).generate(
        PROMPT, max_new_tokens=10)
    assert (g.text, g.ensembled_steps, g.skipped_steps, g.vetoed_steps) == (plain.text, plain.ensembled_steps,
                                                                          plain.skipped_steps, 0)


def _outs(ens, tops: list[list[int]]) -> dict[int, MemberOutput]:
    """Member outputs whose most likely token per row is ``tops[member][row]``."""
    outs = {}
    for i, ids in enumerate(tops):
        v = len(ens.space.codecs[i].token_bytes)
        lp = torch.full((len(ids), v), -30.0)
        lp[torch.arange(len(ids)), torch.tensor(ids)] = 0.0
        outs[i] = MemberOutput(logprobs=torch.log_softmax(lp, -1))
    return outs


def test_the_boundary_rule_keeps_a_word_a_member_holds_as_one_token(trio):
    ens = Ensemble(trio, threshold=0.5, params={"boundary": True}, primary="B")
    space = ens.space

    def tid(i, text):  # member i's single token for ``text``
        (t,) = space.codecs[i].encode_text(text)
        return t

    def entry(text):  # the union entry of ``text``'s bytes (pieces are sorted by bytes)
        return space.union.pieces.index(text.encode())

    seqs = [ens.open(PROMPT) for _ in range(3)]
    # rows: 0 the combination chose " the" but A's top token is " then" (longer: a split word);
    #       1 chose " then", A's top " then" (same length); 2 chose " the", everyone's top " the".
    tops = [[tid(0, " then"), tid(0, " then"), tid(0, " the")],
            [tid(1, " cat"), tid(1, " cat"), tid(1, " the")],
            [tid(2, " the"), tid(2, " the"), tid(2, " the")]]
    chosen = {0: entry(" the"), 1: entry(" then"), 2: entry(" the")}
    (gate,) = [st_ for st_ in ens.decider.strategies if isinstance(st_, Gate)]
    got = dict(chosen)
    vetoed = gate.revise(seqs, [0, 1, 2], _outs(ens, tops), got)
    assert got == {0: entry(" cat"), 1: entry(" then"), 2: entry(" the")}  # row 0: the primary's piece
    assert [int(r in vetoed) for r in range(3)] == [1, 0, 0]
    for s in seqs:
        ens.close(s)


def test_select_gates_on_the_primary_confidence(trio):
    """The first step is the primary's alone exactly when its top probability is above ``threshold``
    (no ``gate``: the primary gates)."""
    ens = Ensemble(trio, primary="B")
    s = ens.open(PROMPT)
    top = float(ens.decider.forward([1], [s])[1].top_logprob().exp()[0])
    ens.close(s)
    for t, gated in ((top * 0.99, True), (min(1.0, top * 1.01), False)):
        g = Ensemble(trio, primary="B", threshold=t).generate(PROMPT, max_new_tokens=3, trace=True)
        assert (g.trace[0].gated, g.trace[0].ensembled) == (gated, not gated)


# ---------------------------------------------------------------------------------------- confidence
def _view(logprobs: list[np.ndarray], weights: list[float]) -> StepView:
    rows = logprobs[0].shape[0]
    return StepView(space=None, models=[], states={i: [None] * rows for i in range(len(logprobs))},
                    computed=list(range(len(logprobs))), weights=weights,
                    logprobs={i: torch.log_softmax(torch.from_numpy(lp), -1) for i, lp in enumerate(logprobs)})


def _confidence_weights(view: StepView, method: str = "gac", **params) -> list:
    """The combiner's weights of ``view`` with the confidence strategy's factors on it."""
    view.log_factors = Confidence(EnsembleOptions(method=method, params=params)).factors(view, None)
    return get_combiner(method).weights(view)


logits = st.lists(st.floats(-8, 8), min_size=4, max_size=4)


@settings(max_examples=60, deadline=None)
@given(a=st.lists(logits, min_size=2, max_size=2), b=st.lists(logits, min_size=2, max_size=2),
       kind=st.sampled_from(["top", "entropy"]), beta=st.floats(0.1, 4), w=st.floats(0.1, 3))
def test_confidence_weights_are_the_formula(a, b, kind, beta, w):
    la, lb = np.array(a, dtype=np.float32), np.array(b, dtype=np.float32)
    view = _view([la, lb], [1.0, w])
    got = _confidence_weights(view, confidence=kind, sharpness=beta)
    expect = []
    for x, wi in ((la, 1.0), (lb, w)):
        lp = torch.log_softmax(torch.from_numpy(x), -1).double().numpy()  # the view's float32 log-probabilities
        top = np.exp(lp.max(-1))
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))  # renormalised in float64 for the entropy
        c = top if kind == "top" else np.exp((np.exp(lp) * lp).sum(-1))  # top prob / exp(-H)
        expect.append(wi * c ** beta)
    expect = np.array(expect)
    expect /= expect.max(0)  # scaled so each row's largest weight is 1
    assert [i for i, _ in got] == [0, 1]
    np.testing.assert_allclose(np.stack([g.numpy() for _, g in got]), expect, rtol=1e-9, atol=1e-12)
    probs = [torch.from_numpy(np.exp(torch.log_softmax(torch.from_numpy(x), -1).numpy())) for x in (la, lb)]
    avg = weighted_average(probs, [g for _, g in got])
    np.testing.assert_allclose(avg.numpy(), (expect[0][:, None] * probs[0].numpy() + expect[1][:, None]
                                             * probs[1].numpy()) / expect.sum(0)[:, None], rtol=1e-5, atol=1e-7)


def test_confidence_top_k_entropy_is_over_the_renormalised_top_k():
    lp = torch.log(torch.tensor([[0.5, 0.3]]))
    view = StepView(space=None, models=[], states={0: [None], 1: [None]}, computed=[0, 1], weights=[1.0, 1.0],
                    topk={0: (lp, torch.tensor([[3, 4]])), 1: (torch.log(torch.tensor([[0.2, 0.2]])),
                                                          torch.tensor([[1, 2]]))})
    (_, w0), (_, w1) = _confidence_weights(view, "unite", confidence="entropy")
    h0 = -(0.625 * math.log(0.625) + 0.375 * math.log(0.375))  # 0.5, 0.3 renormalised
    assert (float(w0[0]), float(w1[0])) == (1.0, pytest.approx(math.exp(h0 - math.log(2))))
    (_, t0), (_, t1) = _confidence_weights(view, "unite", confidence="top")
    assert (float(t0[0]), float(t1[0])) == (1.0, pytest.approx(0.4))  # raw top probabilities 0.5 and 0.2


@pytest.mark.parametrize("kind", ["top", "entropy"])
def test_confidence_keeps_agreement_skip_exact(trio, kind):
    """Per-row weights are positive, so where every member ranks a piece first the average does too."""
    with_skip = run(trio, params={"confidence": kind})
    ens = Ensemble(trio, params={"confidence": kind}, primary="B", agreement_skip=False)
    assert ens.generate(PROMPT, max_new_tokens=10).text == with_skip.text


def test_confidence_on_copies_of_one_member_is_that_member(make_tiny, one_thread):
    """Copies have the same confidence on every step: equal weights, the member's own output and likelihood."""
    a, a2 = make_tiny("gemma3", seed=5, name="g"), make_tiny("gemma3", seed=5, name="g#2")
    alone = Ensemble.single(a)
    ens = Ensemble([a, a2], params={"confidence": "entropy", "sharpness": 3})
    assert ens.generate(PROMPT, max_new_tokens=8).text == alone.generate(PROMPT, max_new_tokens=8).text
    req = [("The weather today is", " sunny and warm")]
    for stepwise in (False, True):
        assert ens.loglikelihood(req, stepwise=stepwise)[0].logprob == pytest.approx(
            alone.loglikelihood(req)[0].logprob, abs=1e-4)


@pytest.mark.parametrize("method", ["gac", "unite"])
def test_confidence_scoring_one_forward_equals_stepwise(trio, method):
    ens = Ensemble(trio, method=method, params={"confidence": "top", "sharpness": 2}, primary="B")
    plain = Ensemble(trio, method=method, primary="B")
    req = [("Question: what is hot?\nAnswer:", " fire"), ("Question: what is cold?\nAnswer:", " snow and ice")]
    one, step = ens.loglikelihood(req), ens.loglikelihood(req, stepwise=True)
    assert [x.logprob for x in one] == pytest.approx([x.logprob for x in step], abs=1e-4)
    assert [x.logprob for x in one] != pytest.approx([x.logprob for x in plain.loglikelihood(req)], abs=1e-3)


# ---------------------------------------------------------------------------------------- PackLLM
@pytest.mark.parametrize("last_bytes, first", [(None, 1), (10_000, 1), (40, None), (1, None)])
def test_prompt_logprob_per_byte_is_the_prefill(make_tiny, one_thread, last_bytes, first):
    m = make_tiny("qwen", seed=3, name="q")
    text = " ".join(f"word{i} and more" for i in range(30))  # > 2 chunks of prompt ids
    st_ = m.new_state(m.encode_prompt(text))
    ids = list(st_.prompt_ids)
    assert len(ids) > 2 * PROMPT_CHUNK
    with torch.inference_mode():
        lp = torch.log_softmax(m.model(torch.tensor([ids], device=m.device)).logits[0].float().cpu(), -1)
    tb = m.codec.token_bytes
    if first is None:  # the last ids that cover ``last_bytes`` bytes
        first = len(ids) - 1
        while sum(len(tb[t]) for t in ids[first:]) < last_bytes:
            first -= 1
    scored = [n for n in range(first, len(ids)) if tb[ids[n]]]
    total = sum(float(lp[n - 1, ids[n]]) for n in scored)
    nbytes = sum(len(tb[ids[n]]) for n in scored)
    if last_bytes is None:
        assert nbytes == len(text.encode()) - len(tb[ids[0]] or b"")
    else:
        assert nbytes >= min(last_bytes, len(text.encode()) - len(tb[ids[0]] or b""))
    assert prompt_logprob_per_byte(m, st_, last_bytes=last_bytes) == pytest.approx(total / nbytes, abs=1e-5)
    # the state is left as a prefill leaves it: nothing to feed, the next distribution kept
    assert not st_.stale and st_.n_valid == len(ids) and st_.prompt_ids == ids
    torch.testing.assert_close(st_.logprobs, lp[-1], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="fresh"):
        prompt_logprob_per_byte(m, st_)


def test_prompt_weights_reach_the_view(trio):
    ens = Ensemble(trio, params={"prompt_weights": 0.25}, primary="B")
    seqs = [ens.open(PROMPT), ens.open("def main():\n    return 1")]
    outs = ens.decider.forward([0, 1, 2], seqs)
    view = ens.decider.view(seqs, [0, 1, 2], outs)
    for i in range(3):
        expect = [prompt_logprob_per_byte(trio[i], trio[i].new_state(s.states[i].prompt_ids)) / 0.25 for s in seqs]
        assert view.log_factors[i].tolist() == pytest.approx(expect, abs=1e-5)
        assert [s.notes["prompt_weights"][i] for s in seqs] == pytest.approx([x * 0.25 for x in expect], abs=1e-6)
    for s in seqs:
        ens.close(s)


def test_prompt_weights_at_a_small_temperature_are_the_best_prompt_member(trio):
    """τ → 0 gives the member that predicts the prompt best all the weight (here A, SmolLM2)."""
    ens = Ensemble(trio, params={"prompt_weights": 1e-4}, primary="B")
    s = ens.open(PROMPT, max_new_tokens=10)
    while s.finished is None:
        ens.step([s])
    best = max(s.notes["prompt_weights"], key=s.notes["prompt_weights"].get)
    ens.close(s)
    assert best == 0
    assert s.result().text == Ensemble.single(trio[0]).generate(PROMPT, max_new_tokens=10).text
    assert run(trio, params={"prompt_weights": 1e-4}).text == s.result().text


@pytest.mark.parametrize("stepwise", [False, True])
def test_prompt_weights_in_scoring(trio, make_tiny, stepwise):
    ens = Ensemble(trio, params={"prompt_weights": 1e-4}, primary="B")
    req = [("The weather today is", " sunny and warm")]
    # τ → 0: A (the best at predicting this prompt) alone scores the pieces of the primary's segmentation,
    # as an ensemble where B and C have weight 0 does
    a_only = Ensemble([trio[0], make_tiny("qwen", seed=1, name="B", weight=0.0),
                       make_tiny("gemma3", seed=2, name="C", weight=0.0)], primary="B")
    got, ref = ens.loglikelihood(req, stepwise=stepwise)[0], a_only.loglikelihood(req, stepwise=True)[0]
    assert (got.pieces, got.piece_bytes) == (ref.pieces, ref.piece_bytes)
    assert got.logprob == pytest.approx(ref.logprob, abs=1e-5)


def test_prompt_weights_one_forward_equals_stepwise(trio):
    ens = Ensemble(trio, params={"prompt_weights": 0.25}, primary="B")
    plain = Ensemble(trio, primary="B")
    req = [("Question: what is hot?\nAnswer:", " fire"), ("def main():\n", "    return 1")]
    one, step = ens.loglikelihood(req), ens.loglikelihood(req, stepwise=True)
    assert [x.logprob for x in one] == pytest.approx([x.logprob for x in step], abs=1e-4)  # the bound
    assert [x.logprob for x in one] != pytest.approx([x.logprob for x in plain.loglikelihood(req)], abs=1e-3)
