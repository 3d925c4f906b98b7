"""llama.cpp members with ``exact_calls``: a sequence's numbers do not depend on how its ids are cut
into decode calls, so the fast paths (one-forward scoring, speculative decoding, the prefix cache)
give the plain path's numbers bit for bit on the three real bundled GGUF files.

``exact_members`` are configured as a user would (``multi_seq: auto``: one shared context with a KV
stream per sequence, batched calls); ``context_members`` run the same files with a context per
sequence (``multi_seq: 0``), the reference for "one by one"."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from tokenfuse import Ensemble
from tokenfuse.members.llamacpp import LARGE, SMALL, LlamaCppMember
from tokenfuse.members.llamacpp_shared import AUTO_SLOTS
from tokenfuse.members.llamacpp_cache import Stream

pytestmark = pytest.mark.real

FAMILIES = ["smollm2", "gemma3", "qwen"]
TEXT = (" The whale is the mammal; it breathes air and feeds its young with milk. Sharks and tuna are"
        " fish, and the trout lives in rivers and lakes.")
PROMPTS = ["Question: What is the capital of France?\nAnswer:", "def fibonacci(n):", "The quick brown fox",
           "Q: Name three colours of the rainbow.\nA:"]


@pytest.fixture(scope="module")
def exact_members():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup.sh installs it)")
    from conftest import SHORT
    from tokenfuse.config import MemberConfig
    from tokenfuse.load import load_member

    members = {short: load_member(MemberConfig(name=short, source=full, backend="llamacpp", exact_calls=True),
                                  progress=False) for short, full in SHORT.items()}
    assert all(m.multi_seq == AUTO_SLOTS for m in members.values())  # multi_seq "auto" with exact_calls
    return members


@pytest.fixture(scope="module")
def context_members(exact_members):
    """The same models with a llama.cpp context per sequence (``multi_seq: 0``)."""
    return {f: LlamaCppMember(m.name, m.path, m.tokenizer, multi_seq=0, exact_calls=True)
            for f, m in exact_members.items()}


def _fresh(m, prompt_ids, ids=()):
    """Next-token log-probabilities after ``prompt_ids`` then ``ids`` fed one id per call, no prefix cache."""
    saved, m.prefix_cache = m.prefix_cache, False
    st = m.new_state(prompt_ids)
    try:
        rows = [m.next_logprobs([st])[0]]
        for tid in ids:
            st.ids.append(tid)
            rows.append(m.next_logprobs([st])[0])
        return rows
    finally:
        m.release(st)
        m.prefix_cache = saved


def _same(a, b) -> bool:
    return bool((a == b).all())


@pytest.mark.parametrize("family", FAMILIES)
def test_output_ids_in_one_call_give_one_id_calls_numbers(exact_members, family):
    """``logprobs_at`` feeds 30 output ids in calls of at most SMALL: every row equals feeding them one
    id per call, bit for bit."""
    m = exact_members[family]
    prompt, ids = m.encode_prompt(PROMPTS[0]), m.codec.encode_text(TEXT)[:30]
    one_by_one = _fresh(m, prompt, ids)
    st = m.new_state(prompt)
    m.next_logprobs([st])
    st.ids = list(ids)
    rows = m.logprobs_at(st, list(range(len(prompt) + 1, len(prompt) + len(ids) + 1)))
    m.release(st)
    assert len(ids) > 3 * SMALL
    assert all(_same(a, b) for a, b in zip(rows, one_by_one[1:]))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_reuse_gives_a_fresh_prefill_numbers(exact_members, family):
    """Prompts longer than a block: a new prompt sharing part of a released one, and a prompt that is a
    released sequence's prompt plus its generated ids, reuse the cache and get a fresh prefill's numbers."""
    m = exact_members[family]
    long = m.encode_prompt(PROMPTS[0] + TEXT * 5)
    gen = m.codec.encode_text(" It is Paris, the largest city")
    full = long + gen
    other = long[: LARGE + 10] + m.codec.encode_text(" Unrelated words follow here instead, many of them" * 3)
    cases = (full, full[:-3], other, long[:LARGE + 3])
    assert len(long) > 2 * LARGE and len(long) % LARGE and len(full) // LARGE == len(long) // LARGE
    fresh = [_fresh(m, ids)[0] for ids in cases]  # first: a fresh prefill takes a pooled context and clears it
    after_gen = _fresh(m, long, gen)[-1]
    st = m.new_state(long)
    m.next_logprobs([st])
    for tid in gen:  # as generation: one id per call
        st.ids.append(tid)
        m.next_logprobs([st])
    m.release(st)
    st = m.new_state(long)  # the same sequence again: everything but the last id is reused
    st.ids = list(gen)
    fed = m.prefix_stats["fed"]
    got = m.next_logprobs([st])[0]
    m.release(st)
    assert m.prefix_stats["fed"] - fed == 1
    assert _same(got, after_gen)
    reused = []
    for ids, want in zip(cases, fresh):
        fed = m.prefix_stats["fed"]
        st = m.new_state(ids)
        got = m.next_logprobs([st])[0]
        m.release(st)
        reused.append(len(ids) - (m.prefix_stats["fed"] - fed))
        assert _same(got, want)
    # all of the shared ids where the prompts' blocks end alike (rows past the blocks came from short calls
    # in both: generated ids, the tail of ``other``'s prompt), else up to a block boundary
    assert reused == [len(full) - 1, len(full) - 4, LARGE, LARGE + 2]


@pytest.mark.parametrize("family", FAMILIES)
def test_thread_count_does_not_change_the_numbers(exact_members, family):
    m = exact_members[family]
    prompt, ids = m.encode_prompt(PROMPTS[1] + TEXT), m.codec.encode_text(TEXT)[:10]
    got = []
    for n in (1, 2):
        m.share_cores(n)
        got.append(_fresh(m, prompt, ids))
    m.share_cores(2)
    assert all(_same(a, b) for a, b in zip(*got))


@pytest.mark.parametrize("family", FAMILIES)
def test_past_512_cached_positions_neither_cut_nor_threads_change_the_numbers(exact_members, context_members,
                                                                             family):
    """A sequence past 512 cached positions (where llama.cpp's attention splits a one-id call's
    positions among the threads if the KV cache is F16): output ids fed in calls of at most SMALL, one
    id per call on one thread and on two, and fed in shared stream calls beside a short sequence,
    give the same numbers bit for bit."""
    m, streams = context_members[family], exact_members[family]
    prompt, ids = m.encode_prompt(PROMPTS[0] + TEXT * 17), m.codec.encode_text(TEXT)[:12]
    assert len(prompt) > 512
    per_thread = []
    for n in (1, 2):
        m.share_cores(n)
        per_thread.append(_fresh(m, prompt, ids))
    assert all(_same(a, b) for a, b in zip(*per_thread))
    st = m.new_state(prompt)
    m.next_logprobs([st])
    st.ids = list(ids)
    rows = m.logprobs_at(st, list(range(len(prompt) + 1, len(prompt) + len(ids) + 1)))
    m.release(st)
    assert all(_same(a, b) for a, b in zip(rows, per_thread[1][1:]))
    short = m.encode_prompt(PROMPTS[1])
    states = [streams.new_state(prompt), streams.new_state(short)]
    streams.next_logprobs(states)
    for st in states:
        st.ids = list(ids[:3])
    together = streams.next_logprobs(states)
    for st in states:
        streams.release(st)
    assert _same(together[0], per_thread[1][3]) and _same(together[1], _fresh(m, short, ids[:3])[-1])


@pytest.mark.parametrize("method", ["gac", "unite", "gated"])
def test_one_forward_scoring_equals_the_stepwise_path_bit_for_bit(exact_members, method):
    ms = [exact_members[f] for f in FAMILIES]
    kw = {"gate": ms[0].name, "threshold": 0.5} if method == "gated" else {"method": method}
    ens = Ensemble(ms, **kw)
    context = "Question: Which of these animals is a mammal that lives in the sea?\nAnswer:"
    requests = [(context, c) for c in (" the whale", " a shark, which breathes through its gills", " tuna")]
    requests.append(("The quick brown fox jumps over the lazy dog." * 8, " And then it ran away into the forest."))
    one, step = ens.loglikelihood(requests), ens.loglikelihood(requests, stepwise=True)
    assert [r.logprob for r in one] == [r.logprob for r in step]
    assert [r.piece_logprobs for r in one] == [r.piece_logprobs for r in step]


@pytest.mark.parametrize(("method", "ks"), [("gac", (2, 6)), ("unite", (4,))])
def test_speculative_decoding_equals_plain_decoding_bit_for_bit(exact_members, method, ks):
    ms = [exact_members[f] for f in FAMILIES]
    plain = Ensemble(ms, method=method)
    specs = [Ensemble(ms, method=method, speculative={"k": k}) for k in ks]
    for prompt in PROMPTS:
        a = plain.generate(prompt, max_new_tokens=24)
        for spec in specs:
            b = spec.generate(prompt, max_new_tokens=24)
            assert (b.output, b.member_ids, b.steps, b.finish_reason) == (a.output, a.member_ids, a.steps, a.finish_reason)
            assert 0 < b.accepted <= b.drafted


def test_concurrent_batch_equals_one_by_one(exact_members, context_members):
    """The default with ``exact_calls`` (``multi_seq: auto``): a batch of 4 prompts goes through the
    shared context's batched calls and gives each prompt's one-by-one output and every member's
    probabilities at every step (the traces' member entries: the piece's and the top ones) bit for
    bit — the same models one prompt at a time, each sequence in a context of its own. (The combined
    probabilities are the combiner's, computed on the batch's rows together: equal up to float
    rounding.)"""
    ms = [exact_members[f] for f in FAMILIES]
    ens = Ensemble(ms)
    own = {m.name: len(m._free) + len(m._busy) for m in ms}
    batch = ens.generate(PROMPTS, max_new_tokens=16, trace=True)
    for m in ms:  # the shared context ran them (no context of their own made) and got its ids back
        assert m._multi is not None and len(m._streams) == AUTO_SLOTS and len(m._free) + len(m._busy) == own[m.name]
    alone = Ensemble([context_members[f] for f in FAMILIES])
    for p, g in zip(PROMPTS, batch, strict=True):
        ref = alone.generate(p, max_new_tokens=16, trace=True)
        assert (g.output, g.member_ids, g.steps) == (ref.output, ref.member_ids, ref.steps)
        members = [[m.to_dict() for m in t.members] for t in g.trace]
        assert members == [[m.to_dict() for m in t.members] for t in ref.trace]
        assert all(m["top"] for t in members for m in t)


@pytest.mark.parametrize("family", FAMILIES)
def test_streams_batched_give_one_by_one_numbers(exact_members, context_members, family):
    """Four sequences (one with a prompt over two blocks) fed together, then 1, 3, 9 and 2 more ids
    each in shared calls: every row equals the sequence's own one-id calls in its own context."""
    m, alone = exact_members[family], context_members[family]
    prompts = [alone.encode_prompt(p) for p in PROMPTS[:3]] + [alone.encode_prompt(PROMPTS[3] + TEXT * 5)]
    assert len(prompts[3]) > 2 * LARGE
    more = [alone.codec.encode_text(TEXT)[:n] for n in (1, 3, 9, 2)]
    states = [m.new_state(p) for p in prompts]
    first = m.next_logprobs(states)
    for st, ids in zip(states, more):
        st.ids = list(ids)
    second = m.next_logprobs(states)
    assert all(isinstance(st.cache, Stream) for st in states)
    for st in states:
        m.release(st)
    assert not m._streams_busy and len(m._streams) == AUTO_SLOTS
    for p, ids, a, b in zip(prompts, more, first, second):
        ref = _fresh(alone, p, ids)
        assert _same(a, ref[0]) and _same(b, ref[-1])


def test_streams_ensemble_batch_equals_one_by_one(exact_members, context_members):
    ms = [exact_members[f] for f in FAMILIES]
    plain = Ensemble([context_members[f] for f in FAMILIES])
    prompts = PROMPTS + [PROMPTS[0] + TEXT * 3]
    batch = Ensemble(ms).generate(prompts[:4], max_new_tokens=16)
    for p, g in zip(prompts, batch):
        ref = plain.generate(p, max_new_tokens=16)
        assert (g.output, g.steps) == (ref.output, ref.steps)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=hst.lists(hst.sampled_from(["the", " whale", " 42", "é", " sea", ",", "\n", " fish", "ing", " Ω"]),
                      min_size=1, max_size=12),
       cuts=hst.lists(hst.integers(1, 12), min_size=1, max_size=6), n_out=hst.integers(1, 24))
def test_any_cut_of_the_output_gives_one_id_calls_numbers(exact_members, words, cuts, n_out):
    """Gemma-3 (the file whose numbers depend most on the cut): a random prompt, then random output ids
    fed in runs of random length (each one ``logprobs_at`` over every position of the run)."""
    m = exact_members["gemma3"]
    prompt = m.encode_prompt("".join(words))
    ids = m.codec.encode_text(TEXT * 2)[:n_out]
    ref = _fresh(m, prompt, ids)
    state = m.new_state(prompt)
    rows = [m.next_logprobs([state])[0]]
    done, k = 0, 0
    while done < len(ids):
        run = ids[done : done + cuts[k % len(cuts)]]
        state.ids = ids[: done + len(run)]
        rows += list(m.logprobs_at(state, [len(prompt) + done + j + 1 for j in range(len(run))]))
        done, k = done + len(run), k + 1
    m.release(state)
    assert len(rows) == len(ref) and all(_same(a, b) for a, b in zip(rows, ref))


@pytest.mark.parametrize("family", FAMILIES)
def test_streams_logprobs_at_gives_one_id_calls_numbers(exact_members, context_members, family):
    """``logprobs_at`` on a stream member (one-forward scoring, speculative verification): 30 output ids
    after a prompt over a block, every position kept = one id per call in a context of its own."""
    m, alone = exact_members[family], context_members[family]
    prompt, ids = alone.encode_prompt(PROMPTS[0] + TEXT * 5), alone.codec.encode_text(TEXT)[:30]
    state = m.new_state(prompt)
    state.ids = list(ids)
    rows = m.logprobs_at(state, list(range(len(prompt), len(prompt) + len(ids) + 1)))
    m.release(state)
    assert len(prompt) > LARGE
    assert all(_same(a, b) for a, b in zip(rows, _fresh(alone, prompt, ids), strict=True))


def test_streams_speculative_and_scoring_equal_the_plain_paths(exact_members, context_members):
    ms = [exact_members[f] for f in FAMILIES]
    plain = Ensemble([context_members[f] for f in FAMILIES])
    spec = Ensemble(ms, speculative={"k": 4})
    for prompt in PROMPTS[:2]:
        a, b = plain.generate(prompt, max_new_tokens=16), spec.generate(prompt, max_new_tokens=16)
        assert (b.output, b.steps) == (a.output, a.steps) and b.accepted > 0
    requests = [("Question: Which of these animals is a mammal?\\nAnswer:", c) for c in (" the whale", " a trout")]
    assert [r.logprob for r in Ensemble(ms).loglikelihood(requests)] == [r.logprob for r in plain.loglikelihood(requests, stepwise=True)]


def test_streams_speculative_batch_equals_one_by_one(exact_members, context_members):
    """Four sequences' speculative rounds run together on the shared context (each drafted position
    one drafter call for all, each member's verification one call for all): every output is the
    prompt's plain output alone, bit for bit (member ids and steps too)."""
    ms = [exact_members[f] for f in FAMILIES]
    plain = Ensemble([context_members[f] for f in FAMILIES])
    batch = Ensemble(ms, speculative={"k": 4}).generate(PROMPTS, max_new_tokens=16)
    for p, g in zip(PROMPTS, batch, strict=True):
        ref = plain.generate(p, max_new_tokens=16)
        assert (g.output, g.member_ids, g.steps) == (ref.output, ref.member_ids, ref.steps)
        assert g.accepted > 0


def test_more_sequences_than_slots_get_contexts_of_their_own(exact_members, context_members):
    """``multi_seq: 2`` with 5 live sequences: the first 2 new ones take the shared context's ids, the
    others contexts of their own (nothing waits or fails), every row the one-by-one row; once the
    first two are released, a new sequence takes a freed id again."""
    base, alone = exact_members["smollm2"], context_members["smollm2"]
    m = LlamaCppMember("smol-2", base.path, base.tokenizer, multi_seq=2, exact_calls=True)
    prompts = [m.encode_prompt(p) for p in PROMPTS] + [m.encode_prompt(PROMPTS[0] + TEXT)]
    more = m.codec.encode_text(TEXT)[:3]
    states = [m.new_state(p) for p in prompts]
    first = m.next_logprobs(states)
    assert [isinstance(st.cache, Stream) for st in states] == [True, True, False, False, False]
    for st in states:
        st.ids = list(more)
    second = m.next_logprobs(states)
    states[4].drop_cache_after(len(prompts[4]))  # scoring its output again, in its own context
    rows = m.logprobs_at(states[4], [len(prompts[4]) + 1, len(prompts[4]) + 3])
    for p, a, b in zip(prompts, first, second, strict=True):
        ref = _fresh(alone, p, more)
        assert _same(a, ref[0]) and _same(b, ref[-1])
    assert _same(rows[0], ref[1]) and _same(rows[1], ref[3])
    for st in states[:2]:
        m.release(st)
    late = m.new_state(prompts[1])
    assert _same(m.next_logprobs([late])[0], first[1]) and isinstance(late.cache, Stream)
    for st in [*states[2:], late]:
        m.release(st)
    assert not m._streams_busy and not m._busy
    m.unload()


def test_a_shared_prompt_past_the_sliding_window_is_copied_exactly(exact_members, context_members):
    """Gemma-3 (sliding-window layers, window 512): three new sequences with the same prompt of over
    512 ids in one batch — the later two copy the first's stream once its blocks are fed (a whole-stream
    copy, cell for cell) — and one after the batch reusing a released stream: each gets a fresh
    prefill's numbers."""
    m, alone = exact_members["gemma3"], context_members["gemma3"]
    prompt = m.encode_prompt(PROMPTS[2] + TEXT * 17)
    assert len(prompt) > m.swa_window > 0 and len(prompt) % LARGE
    ref = _fresh(alone, prompt)[0]
    before = dict(m.prefix_stats)
    states = [m.new_state(prompt) for _ in range(3)]
    got = m.next_logprobs(states)
    for st in states:
        m.release(st)
    again = m.new_state(prompt)
    got = [*got, m.next_logprobs([again])[0]]
    m.release(again)
    assert m.prefix_stats["copied"] - before["copied"] == 2 and m.prefix_stats["reused"] - before["reused"] == 3
    assert m.prefix_stats["fed"] - before["fed"] == len(prompt) + 2 * (len(prompt) % LARGE) + 1  # blocks fed once
    assert all(_same(g, ref) for g in got)


def test_scoring_takes_the_picked_entries_bit_for_bit_in_the_shared_context(exact_members):
    """``Rows.logprobs_of`` on the shared context's streams (``exact_calls``): the whole rows' entries."""
    from test_text_score import picked_equals_whole_rows

    text = "The quick brown fox jumps over the lazy dog; 안녕하세요, ünïcode.\n" * 8
    for m in exact_members.values():
        assert picked_equals_whole_rows(m, text) > 64
