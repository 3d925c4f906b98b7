"""Speculative ensemble decoding: the same greedy output as plain decoding, fewer rounds.

Tiny random-weight members on the three real tokenizers: their numbers do not depend on how ids are
cut into forward calls (to float rounding), so speculative decoding must give byte-identical output,
steps, counters and member ids for any prompt, drafter, ``k`` and method.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenfuse.config import parse_config
from tokenfuse.engine import Ensemble, Sampling
from tokenfuse.errors import ConfigError

TEXT = st.lists(st.sampled_from(list("abc XYZ.,\n") + ["é", "日本", "🙂", " the", "def ", "("]), max_size=8).map("".join)
VARIANTS = {
    "gac": {},
    "unite": {"method": "unite"},
    "gated": {"gate": "A", "threshold": 0.5},
    "select": {"threshold": 0.4, "params": {"boundary": True}},
    "conf": {"params": {"confidence": "entropy"}},
}


@pytest.fixture(scope="module")
def plain(members, align_cache):
    return {name: Ensemble(members, align_cache=align_cache, **kw) for name, kw in VARIANTS.items()}


def speculative(members, align_cache, variant: str, **options) -> Ensemble:
    return Ensemble(members, align_cache=align_cache, speculative=options, **VARIANTS[variant])


def same_generation(a, b) -> None:
    assert b.output == a.output
    assert (b.steps, b.ensembled_steps, b.skipped_steps, b.vetoed_steps, b.finish_reason) == \
        (a.steps, a.ensembled_steps, a.skipped_steps, a.vetoed_steps, a.finish_reason)
    assert b.member_ids == a.member_ids


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=TEXT, draft=st.sampled_from(["A", "B", "C"]), k=st.integers(1, 6),
       variant=st.sampled_from(sorted(VARIANTS)), max_new=st.integers(1, 20),
       stop=st.sampled_from([(), ("e",), (".", "\n")]))
def test_greedy_output_is_plain_decodings(members, align_cache, plain, prompt, draft, k, variant, max_new, stop):
    spec = speculative(members, align_cache, variant, draft=draft, k=k)
    a = plain[variant].generate(prompt, max_new_tokens=max_new, stop=stop)
    b = spec.generate(prompt, max_new_tokens=max_new, stop=stop)
    same_generation(a, b)
    assert 0 <= b.accepted <= b.drafted


def test_a_batch_and_a_stream_give_plain_decodings(members, align_cache, plain):
    prompts = ["Hello", "The capital of France is", "日本語", "def f(x):"]
    spec = speculative(members, align_cache, "gac", draft="C", k=3)
    for a, b in zip(plain["gac"].generate(prompts, max_new_tokens=16), spec.generate(prompts, max_new_tokens=16)):
        same_generation(a, b)
    assert "".join(spec.stream("Hello", max_new_tokens=16)) == plain["gac"].generate("Hello", max_new_tokens=16).text


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(TEXT, min_size=2, max_size=5), draft=st.sampled_from(["A", "B", "C"]), k=st.integers(1, 5),
       variant=st.sampled_from(sorted(VARIANTS)), max_new=st.integers(1, 14))
def test_sequences_stepped_together_give_each_ones_plain_decoding(members, align_cache, plain, prompts, draft, k,
                                                                  variant, max_new):
    """Rounds of several sequences run together (one drafter forward per drafted position, one
    verifying call per member): each sequence's generation is its plain decoding alone."""
    spec = speculative(members, align_cache, variant, draft=draft, k=k)
    for prompt, b in zip(prompts, spec.generate(prompts, max_new_tokens=max_new)):
        same_generation(plain[variant].generate(prompt, max_new_tokens=max_new), b)


def test_rounds_of_a_batch_share_the_forwards(members, align_cache, monkeypatch):
    """Four sequences' rounds: every drafter forward and every verifying call of the first round
    carries all four (the members batch them: one forward for the rows of a call)."""
    spec = speculative(members, align_cache, "gac", draft="C", k=3)
    prompts = ["Hello", "The capital of France is", "日本語", "def f(x):"]
    seqs = [spec.open(p, sampling=Sampling(), max_new_tokens=12, index=i) for i, p in enumerate(prompts)]
    spec.step(seqs)  # the prefill's step (plain)
    calls: dict[str, list[int]] = {"draft": [], "verify": []}
    for m in members:
        for name, kind in (("next_logprobs", "draft"), ("logprobs_at_many", "verify")):
            real = getattr(m, name)
            monkeypatch.setattr(m, name, lambda states, *a, _real=real, _kind=kind, **kw:
                                calls[_kind].append(len(states)) or _real(states, *a, **kw))
    events = spec.step(seqs)
    assert {e.index for e in events} == {s.index for s in seqs}
    assert calls["draft"] and set(calls["draft"][:1]) == {4}  # the first drafted position: all four together
    assert calls["verify"] and set(calls["verify"]) == {4}  # one call per verifying member, all four
    assert len(calls["verify"]) == 2  # A and B verify (C drafts)
    for s in seqs:
        spec.close(s)


def test_a_member_with_itself_accepts_every_draft(make_tiny, align_cache, one_thread):
    """Copies of one model: the drafter's choice is the ensemble's, so every drafted piece is taken and
    a round emits k + 1 pieces (the last one before the limit is never drafted)."""
    a, b = make_tiny("gemma3", seed=3, name="A"), make_tiny("gemma3", seed=3, name="B")
    spec = Ensemble([a, b], align_cache=align_cache, speculative={"draft": "A", "k": 4})
    s = spec.open("Once upon a time", max_new_tokens=11)
    sizes = []
    while s.finished is None:
        sizes.append(len(spec.step([s])))
    g = s.result()
    spec.close(s)
    assert g.output == Ensemble.single(a, align_cache=align_cache).generate("Once upon a time", max_new_tokens=11).output
    assert sizes == [5, 5, 1]  # 4 drafted + 1, 4 + 1, then nothing left to draft before the limit
    assert g.drafted == g.accepted == 8


def test_k_adapts_to_what_is_accepted(members, align_cache):
    spec = speculative(members, align_cache, "gac", draft="B", k=6)
    s = spec.open("The weather today", max_new_tokens=30)
    while s.finished is None:
        before = s.counts.accepted
        spec.step([s])
        assert s.draft_k == max(1, min(6, s.counts.accepted - before + 1))
        assert (s.accepted, s.drafted, s.ensembled) == (s.counts.accepted, s.counts.drafted, s.counts.ensembled)
    spec.close(s)
    fixed = speculative(members, align_cache, "gac", draft="B", k=2, adapt=False)
    g = fixed.generate("The weather today", max_new_tokens=30)
    assert g.drafted >= 2 * (g.steps // 3)  # every round drafts 2 while room is left


def test_sampling_and_traced_sequences_are_decoded_plainly(members, align_cache, plain):
    spec = speculative(members, align_cache, "gac", draft="A", k=4)
    sampling = Sampling(temperature=0.9, seed=5)
    a = plain["gac"].generate("Hello", max_new_tokens=12, sampling=sampling)
    b = spec.generate("Hello", max_new_tokens=12, sampling=sampling)
    assert b.output == a.output and b.drafted == 0
    t = spec.generate("Hello", max_new_tokens=12, trace=True)
    assert t.drafted == 0 and t.output == plain["gac"].generate("Hello", max_new_tokens=12).output


def test_the_default_drafter_is_the_smallest_member(members, align_cache):
    spec = Ensemble(members, align_cache=align_cache, speculative={})
    sizes = [m.weight_bytes for m in members]
    assert spec.speculator.draft == sizes.index(min(sizes))
    assert spec.describe()["speculative"]["k"] == 4


def test_bad_speculative_options_name_the_field(members, align_cache):
    with pytest.raises(ConfigError, match=r"speculative.draft: 'Z' is not a member \(members: A, B, C\)"):
        Ensemble(members, align_cache=align_cache, speculative={"draft": "Z"})
    with pytest.raises(ConfigError, match="speculative.draft: 'Z' is not a member"):
        parse_config({"members": [{"name": "A"}, {"name": "B"}], "speculative": {"draft": "Z"}})
    with pytest.raises(ConfigError, match="speculative.k"):
        parse_config({"members": [{"name": "A"}], "speculative": {"k": 0}})
    with pytest.raises(ConfigError, match="speculative.draft: 'B' does not run in this process"):
        parse_config({"members": [{"name": "A"}, {"name": "B", "backend": "openai", "base_url": "http://x/v1"}],
                      "method": "unite", "speculative": {"draft": "B"}})
