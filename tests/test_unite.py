"""UniTE, agreement skip and the primary member.

Most tests use *fixed-distribution* members on the real tokenizers: a member whose next-token
distribution is written by hand, so every UniTE number can be computed exactly here.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenfuse import Ensemble
from tokenfuse.members.codec import ByteCodec
from tokenfuse.errors import ConfigError
from tokenfuse.members.base import LocalMember, SeqState


class Fixed(LocalMember):
    """A member whose next-token distribution is always the same: ``{piece bytes: probability}``."""

    def __init__(self, name, tokenizer, codec, probs: dict[bytes, float], weight=1.0):
        self.name, self.tokenizer, self.codec, self.weight = name, tokenizer, codec, weight
        self.lp = torch.full((codec.vocab_size,), -math.inf)
        for piece, p in probs.items():
            ids = [i for i, b in enumerate(codec.token_bytes) if b == piece] if piece else sorted(codec.end_ids)[:1]
            assert ids, (name, piece)
            self.lp[ids[0]] = math.log(p)
        self.forwards = 0

    def _forward(self, state: SeqState) -> torch.Tensor:
        self.forwards += 1
        return self.lp.clone()


@pytest.fixture(scope="module")
def codecs(tokenizers):
    return {k: ByteCodec(t) for k, t in tokenizers.items()}


@pytest.fixture
def fixed(tokenizers, codecs):
    def make(family, probs, name=None, weight=1.0):
        return Fixed(name or family, tokenizers[family], codecs[family], probs, weight=weight)

    return make


def one_step(ens: Ensemble, prompt: str = "Hello"):
    """The combined distribution of the first step as ``{piece: probability}`` (non-zero only)."""
    seq = ens.open(prompt)
    members = list(range(len(ens.members)))
    view = ens.decider.view([seq], members, ens.decider.forward(members, [seq]))
    dist = ens.combiner.combine(view)
    out = {}
    for col, p in enumerate(dist.probs[0].tolist()):
        if p > 0:
            out[ens.union.pieces[dist.entry(0, col)]] = p
    ens.close(seq)
    return out


def test_missing_token_gets_first_subtoken_probability(fixed, codecs, align_cache):
    # " Aberdeen" is one Qwen token; SmolLM2 has no such token and splits it " Aber" + "deen".
    smol = codecs["smollm2"]
    assert b" Aberdeen" not in set(smol.token_bytes)
    assert [smol.token_bytes[i] for i in smol.encode_bytes(b" Aberdeen")] == [b" Aber", b"deen"]
    qwen = fixed("qwen", {b" Aberdeen": 0.6, b" London": 0.4})
    small = fixed("smollm2", {b" London": 0.5, b" Aber": 0.3, b" Paris": 0.2})
    ens = Ensemble([qwen, small], method="unite", params={"k": 2}, align_cache=align_cache)
    q = one_step(ens)
    # candidates: top-2 of each = {" Aberdeen", " London"} | {" London", " Aber"}
    assert set(q) == {b" Aberdeen", b" London", b" Aber"}
    # Qwen holds " Aber" as a token but gives it no mass; SmolLM2 scores " Aberdeen" by " Aber".
    p_qwen = {b" Aberdeen": 0.6, b" London": 0.4, b" Aber": 0.0}
    s = 0.5 + 0.3 + 0.3
    p_small = {b" Aberdeen": 0.3 / s, b" London": 0.5 / s, b" Aber": 0.3 / s}
    for piece in q:
        assert q[piece] == pytest.approx((p_qwen[piece] + p_small[piece]) / 2, abs=1e-6)
    assert max(q, key=q.get) == b" Aberdeen"


def test_first_subtoken_keeps_the_leading_space(codecs, fixed, align_cache):
    # Gemma (SentencePiece) has no " Absol": the first piece is " Abs", never a lone "▁"/space piece.
    gemma = codecs["gemma3"]
    first = gemma.token_bytes[gemma.encode_bytes(b" Absol")[0]]
    assert first == b" Abs"
    ens = Ensemble([fixed("smollm2", {b" Absol": 1.0}), fixed("gemma3", {b" Abs": 0.25, b" the": 0.75})],
                   method="unite", params={"k": 2}, align_cache=align_cache)
    q = one_step(ens)
    # SmolLM2: all mass on " Absol"; it holds " Abs" and " the" with no mass. Gemma: " Absol" -> " Abs".
    gem = {b" Absol": 0.25 / 1.25, b" Abs": 0.25 / 1.25, b" the": 0.75 / 1.25}
    assert q == pytest.approx({k: (v + (1.0 if k == b" Absol" else 0.0)) / 2 for k, v in gem.items()}, abs=1e-6)


def test_each_member_is_renormalised_over_the_candidates(fixed, align_cache):
    a = fixed("qwen", {b" a": 0.5, b" b": 0.3, b" c": 0.2})
    b = fixed("smollm2", {b" b": 0.9, b" d": 0.1})
    ens = Ensemble([a, b], method="unite", params={"k": 2}, align_cache=align_cache)
    seq = ens.open("x")
    view = ens.decider.view([seq], [0, 1], ens.decider.forward([0, 1], [seq]))
    cands = ens.combiner.candidates(view)
    assert [ens.union.pieces[e] for e in cands[0]] == sorted([b" a", b" b", b" d"])
    for i in (0, 1):
        p = ens.combiner.member_probs(view, i, cands)
        assert p.sum() == pytest.approx(1.0)
    pa = ens.combiner.member_probs(view, 0, cands)[0]
    # ratios are the member's own: " a" : " b" = 0.5 : 0.3 (" c" is not a candidate)
    assert pa[0] / pa[1] == pytest.approx(0.5 / 0.3)


def test_candidate_order_is_independent_of_member_order(fixed, align_cache):
    a = fixed("qwen", {b" cat": 0.7, b" dog": 0.3})
    b = fixed("gemma3", {b" dog": 0.6, b" cow": 0.4})
    one = one_step(Ensemble([a, b], method="unite", params={"k": 2}, align_cache=align_cache))
    two = one_step(Ensemble([b, a], method="unite", params={"k": 2}, align_cache=align_cache))
    assert list(one) == list(two) == sorted(one)
    assert one == pytest.approx(two)


def test_weights_behave_as_in_gac(fixed, align_cache):
    a = fixed("qwen", {b" cat": 0.7, b" dog": 0.3}, weight=3.0)
    b = fixed("gemma3", {b" dog": 0.6, b" cat": 0.4}, weight=1.0)
    q = one_step(Ensemble([a, b], method="unite", params={"k": 2}, align_cache=align_cache))
    assert q[b" cat"] == pytest.approx((3 * 0.7 + 0.4) / 4)
    assert q[b" dog"] == pytest.approx((3 * 0.3 + 0.6) / 4)
    q = one_step(Ensemble([a, b], method="unite", params={"k": 2}, weights=[3.0, 0.0], align_cache=align_cache))
    assert q == pytest.approx({b" cat": 0.7, b" dog": 0.3})


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen"])
def test_self_ensemble_reproduces_the_single_model(make_tiny, one_thread, family):
    m1 = make_tiny(family, seed=3, name="a")
    m2 = make_tiny(family, seed=3, name="b")
    alone = Ensemble([m1]).generate("The weather today", max_new_tokens=12, )
    for skip in (True, False):
        both = Ensemble([m1, m2], method="unite", agreement_skip=skip).generate("The weather today",
                                                                                  max_new_tokens=12)
        assert both.output == alone.output
        assert both.skipped_steps == (both.steps if skip else 0)  # identical members always agree


def test_unite_k_is_validated():
    from tokenfuse.combiners import get_combiner

    with pytest.raises(ConfigError, match="k must be a positive integer"):
        get_combiner("unite", k=0)
    with pytest.raises(ConfigError, match="unexpected keyword"):
        get_combiner("unite", kk=3)


# ---------------------------------------------------------------- agreement skip
@pytest.mark.parametrize("method", ["gac", "unite"])
def test_agreement_skips_only_when_all_agree(fixed, align_cache, method):
    agree = [fixed("qwen", {b" cat": 0.7, b" dog": 0.3}), fixed("gemma3", {b" cat": 0.55, b" cow": 0.45})]
    ens = Ensemble(agree, method=method, align_cache=align_cache)
    g = ens.generate("x", max_new_tokens=1)
    assert (g.text, g.skipped_steps, g.ensembled_steps) == (" cat", 1, 1)
    differ = [fixed("qwen", {b" cat": 0.7, b" dog": 0.3}), fixed("gemma3", {b" dog": 0.6, b" cow": 0.4})]
    g = Ensemble(differ, method=method, align_cache=align_cache).generate("x", max_new_tokens=1)
    assert g.skipped_steps == 0
    assert g.text == " dog"  # (0.3 + 0.6) / 2 > 0.7 / 2


def test_agreement_checks_entries_held_under_several_ids(fixed, codecs, align_cache):
    # Gemma holds some byte strings under two ids; their summed mass can beat its top single id.
    gemma = codecs["gemma3"]
    seen: dict[bytes, list[int]] = {}
    for i, b in enumerate(gemma.token_bytes):
        if b:
            seen.setdefault(b, []).append(i)
    dup = next(b for b, ids in sorted(seen.items()) if len(ids) == 2 and b.strip())
    g = fixed("gemma3", {b" cat": 0.4})
    ids = seen[dup]
    g.lp[ids[0]] = math.log(0.3)
    g.lp[ids[1]] = math.log(0.3)  # the duplicate entry has 0.6 in all
    q = fixed("qwen", {b" cat": 0.9, dup: 0.1} if dup in set(codecs["qwen"].token_bytes) else {b" cat": 1.0})
    out = {}
    for skip in (True, False):
        r = Ensemble([g, q], method="gac", agreement_skip=skip, align_cache=align_cache).generate("x", max_new_tokens=1)
        out[skip] = r.output
        assert r.skipped_steps == 0  # both members' top *ids* say " cat", but Gemma's top *entry* differs
    assert out[True] == out[False]


@pytest.mark.parametrize("method", ["gac", "unite"])
def test_exact_tie_goes_to_the_primary(fixed, align_cache, method):
    a = fixed("qwen", {b" cat": 0.75, b" dog": 0.25}, name="a")
    b = fixed("qwen", {b" cat": 0.25, b" dog": 0.75}, name="b")
    assert Ensemble([a, b], method=method, primary="a", align_cache=align_cache).generate(
        "x", max_new_tokens=1).text == " cat"
    assert Ensemble([a, b], method=method, primary="b", align_cache=align_cache).generate(
        "x", max_new_tokens=1).text == " dog"
    with pytest.raises(ConfigError, match="primary"):
        Ensemble([a, b], primary="c", align_cache=align_cache)


def test_primary_defaults_to_highest_score():
    from tokenfuse.config import parse_config

    cfg = parse_config({"members": [{"name": "a", "score": 0.3}, {"name": "b", "score": 0.6}, {"name": "c"}]})
    assert cfg.primary_name == "b"
    assert parse_config({"members": [{"name": "a"}, {"name": "b"}]}).primary_name == "a"
    assert parse_config({"members": [{"name": "a", "score": 0.9}, {"name": "b"}], "primary": "b"}).primary_name == "b"
    with pytest.raises(ConfigError, match="primary"):
        parse_config({"members": [{"name": "a"}], "primary": "z"})


@pytest.mark.real
@pytest.mark.parametrize("method", ["gac", "unite"])
def test_agreement_skip_changes_no_greedy_output_on_real_members(llamacpp_members, method):
    members = list(llamacpp_members.values())
    prompts = ["Question: What is the capital of France?\nAnswer:", "def fibonacci(n):",
               "Once upon a time, in a small village by the sea,"]
    runs = {}
    for skip in (True, False):
        ens = Ensemble(members, method=method, agreement_skip=skip)
        runs[skip] = ens.generate(prompts, max_new_tokens=16)
    assert [g.output for g in runs[True]] == [g.output for g in runs[False]]
    skipped = sum(g.skipped_steps for g in runs[True])
    steps = sum(g.ensembled_steps for g in runs[True])
    assert 0 < skipped < steps  # the test covers both paths
    assert sum(g.skipped_steps for g in runs[False]) == 0


# ---------------------------------------------------------------- DeePEn through the engine
def test_deepen_self_ensemble_keeps_the_members_greedy_choice(make_tiny, one_thread, tmp_path):
    a, b = make_tiny("qwen", seed=4, name="a"), make_tiny("qwen", seed=4, name="b")
    alone = Ensemble([a]).generate("The weather today", max_new_tokens=6)
    ens = Ensemble([a, b], method="deepen", align_cache=tmp_path)
    assert ens.options.agreement_skip is None and not ens.combiner.exact_agreement
    both = ens.generate("The weather today", max_new_tokens=6)
    assert both.output == alone.output
    assert both.skipped_steps == 0  # agreement skip is off for deepen by default


def test_deepen_params_are_validated(make_tiny, tmp_path):
    a, b = make_tiny("qwen", seed=4, name="a"), make_tiny("gemma3", seed=4, name="b")
    with pytest.raises(ConfigError, match="params.main"):
        Ensemble([a, b], method="deepen", params={"main": "zz"}, align_cache=tmp_path)
    with pytest.raises(ConfigError, match="unexpected keyword"):
        Ensemble([a, b], method="deepen", params={"stepz": 3}, align_cache=tmp_path)
    with pytest.raises(ConfigError, match="accuracies"):
        Ensemble([a, b], method="deepen", params={"accuracies": {"a": 0.5}}, align_cache=tmp_path)
    ens = Ensemble([a, b], method="deepen", params={"accuracies": {"a": 0.75, "b": 0.5}, "n_choices": 4},
                   align_cache=tmp_path)
    assert ens.combiner.alpha == pytest.approx({"a": 0.5 / 0.75, "b": 0.25 / 0.75})
