"""The llama.cpp backend on the three real bundled GGUF files."""

from __future__ import annotations

import contextlib
import ctypes

import pytest

from tokenfuse import Ensemble
from tokenfuse.members.llamacpp import BLOCK, LlamaCppMember
from tokenfuse.members.llamacpp_shared import AUTO_SLOTS, resolve_multi_seq

pytestmark = pytest.mark.real

PROMPTS = ["Question: What is the capital of France?\nAnswer:", "def fibonacci(n):", "The quick brown fox"]
N = 16
# Greedy continuations of the quantised llama.cpp model and of the dequantised fp32 transformers
# model agree token for token, except where the quantised arithmetic (llama.cpp multiplies Q4
# blocks directly; transformers multiplies the dequantised fp32 weights) tips a near-tie. Where a
# near-tie tips depends on the build (setup.sh compiles llama.cpp for the CPU it runs on: an
# earlier build diverged on qwen's prompt 2 at piece 5, an AMD EPYC build on its prompt 0 at piece 7
# and not on prompt 2), so the test pins no positions: at the first divergence each path's own
# numbers must rank the other path's piece within QUANT_TIE (probability) of its own pick. Measured
# gaps: 0.032 / 0.045 (smollm2, prompt 1, piece 13: llama.cpp / transformers), 0.012 / 0.011 (qwen,
# prompt 0, piece 7).
QUANT_TIE = 0.1
# After a rollback, the next-token distribution equals a fresh prefill's up to this (probability
# space, max over the vocabulary) and has the same argmax; measured: 0 / 0.017 / 0.0045.
ROLLBACK_TOL = 0.05


def token_piece(m: LlamaCppMember, token_id: int) -> bytes:
    """llama.cpp's own bytes for a token id of the member's model (text tokens; specials give b""),
    through llama-cpp-python's bindings."""
    import llama_cpp

    buf = ctypes.create_string_buffer(256)
    vocab = llama_cpp.llama_model_get_vocab(m.llm.model)
    n = llama_cpp.llama_token_to_piece(vocab, token_id, buf, len(buf), 0, False)
    return buf.raw[:n] if n >= 0 else b""


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen"])
def test_every_token_has_llama_cpps_own_bytes(llamacpp_members, family):
    m = llamacpp_members[family]
    assert isinstance(m, LlamaCppMember)
    checked = 0
    for i, b in enumerate(m.codec.token_bytes):
        if b is not None:
            assert b == token_piece(m, i), (i, b)
            checked += 1
    assert checked > 0.9 * m.n_vocab - 7000
    assert all(m.codec.token_bytes[i] is None for i in m._control_ids())


def first_difference(a: list[bytes], b: list[bytes]) -> int | None:
    """The first step at which two runs chose different pieces (``None``: none within the shorter)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def assert_near_tie(step, other: bytes, tol: float, what: str) -> None:
    """``step`` (a traced step) chose its piece; ``other`` is within ``tol`` of it in its numbers."""
    p_other = next((t.prob for t in step.top if bytes.fromhex(t.bytes) == other), 0.0)
    assert step.prob - p_other <= tol, f"{what}: {step.raw!r} {step.prob:.4f} vs {other!r} {p_other:.4f}"


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen"])
def test_greedy_matches_transformers_up_to_a_near_tie(llamacpp_members, real_members, family):
    lc, tf = llamacpp_members[family], real_members[family]
    for k, prompt in enumerate(PROMPTS):
        a = Ensemble([lc]).generate(prompt, max_new_tokens=N, trace=True, trace_k=5)
        b = Ensemble([tf]).generate(prompt, max_new_tokens=N, trace=True, trace_k=5)
        first = first_difference([s.raw for s in a.trace], [s.raw for s in b.trace])
        if first is None:
            assert a.member_ids[lc.name] == b.member_ids[tf.name], f"{family} prompt {k}"
            continue
        where = f"{family} prompt {k}, piece {first}"
        assert_near_tie(a.trace[first], b.trace[first].raw, QUANT_TIE, f"{where}, llama.cpp")
        assert_near_tie(b.trace[first], a.trace[first].raw, QUANT_TIE, f"{where}, transformers")


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen"])
def test_rollback_equals_fresh_prefill(llamacpp_members, family):
    m = llamacpp_members[family]
    prompt = m.encode_prompt(PROMPTS[0])
    ext = m.codec.encode_text(" Paris is the capital city of France")[:8]
    st = m.new_state(prompt)
    m.next_logprobs([st])
    st.ids = list(ext)
    m.next_logprobs([st])
    st.n_valid = len(prompt) + 3  # roll back 5 positions: the next forward crops and refeeds them
    st.logprobs = None
    rolled = m.next_logprobs([st])[0]
    fresh_state = m.new_state(prompt)
    fresh_state.ids = list(ext)
    fresh = m.next_logprobs([fresh_state])[0]
    assert (rolled.exp() - fresh.exp()).abs().max().item() <= ROLLBACK_TOL
    assert int(rolled.argmax()) == int(fresh.argmax())
    m.release(st)
    m.release(fresh_state)


def test_llamacpp_ensemble_in_sync_and_batch_equals_single(llamacpp_members, monkeypatch):
    members = list(llamacpp_members.values())
    for m in members:  # exact equality holds without prefix reuse (reuse changes the split of a prefill)
        monkeypatch.setattr(m, "prefix_cache", False)
    ens = Ensemble(members)
    batch = ens.generate(PROMPTS, max_new_tokens=N)
    for prompt, g in zip(PROMPTS, batch):
        alone = ens.generate(prompt, max_new_tokens=N)
        assert alone.output == g.output
        for m in members:
            assert m.codec.decode(g.member_ids[m.name]) == g.output


CONTEXT = "Question: Which of these is a mammal? Options: whale, shark, trout, squid.\nAnswer:"
OPTIONS = [" whale", " shark", " trout", " squid"]
SHOTS = ("Question: Which of these is a bird? Options: eagle, bat, bee, fly.\nAnswer: eagle\n\n"
         "Question: Which of these is a fish? Options: cod, seal, crab, frog.\nAnswer: cod\n\n")


def _fresh(m, text):
    return _fresh_ids(m, m.encode_prompt(text))


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen"])
def test_prefix_cache_reuses_a_released_sequences_prefix(llamacpp_members, family):
    m = llamacpp_members[family]
    first = m.new_state(m.encode_prompt(SHOTS + CONTEXT + OPTIONS[0]))
    m.next_logprobs([first])
    m.release(first)
    ids = m.encode_prompt(SHOTS + CONTEXT + OPTIONS[1])
    shared = next(i for i, (a, b) in enumerate(zip(first.all_ids(), ids)) if a != b)
    before = dict(m.prefix_stats)
    st = m.new_state(ids)
    reused = m.next_logprobs([st])[0]
    m.release(st)
    reuse = min(shared, len(ids) - BLOCK) // BLOCK * BLOCK  # whole blocks, at least one block fed
    assert reuse >= 16
    assert m.prefix_stats["reused"] == before["reused"] + 1
    assert m.prefix_stats["fed"] - before["fed"] == len(ids) - reuse  # only the tail is fed
    fresh = _fresh(m, SHOTS + CONTEXT + OPTIONS[1])
    assert bool((reused == fresh).all())  # the very numbers of a fresh prefill


def test_prefix_cache_copies_a_live_sequences_cache(llamacpp_members):
    """Options of one question forwarded together: the first is prefilled, the others copy its cache."""
    m = llamacpp_members["gemma3"]
    states = [m.new_state(m.encode_prompt(SHOTS + CONTEXT + o)) for o in OPTIONS]
    before = dict(m.prefix_stats)
    out = m.next_logprobs(states)
    for st in states:
        m.release(st)
    assert m.prefix_stats["copied"] - before["copied"] >= len(OPTIONS) - 1
    for o, lp in zip(OPTIONS, out):
        assert bool((lp == _fresh(m, SHOTS + CONTEXT + o)).all())


def test_prefix_cache_copies_no_cache_longer_than_the_sliding_window(llamacpp_members):
    """Gemma-3's sliding-window layers (512 positions): prompts of over 600 ids sharing their shots,
    forwarded together then stepped 4 ids one per call, give each prompt's own numbers (a fresh
    prefill, then the same calls). A copied cache past the window differed by up to 1.5."""
    m = llamacpp_members["gemma3"]
    prompts = [m.encode_prompt(SHOTS * 14 + CONTEXT + o) for o in OPTIONS]
    more = m.codec.encode_text(" it breathes air through its lungs")[:4]
    assert min(map(len, prompts)) > 600 and len(more) == 4

    def stepped(states):
        rows = [m.next_logprobs(states)]
        for tid in more:
            for st in states:
                st.ids.append(tid)
            rows.append(m.next_logprobs(states))
        for st in states:
            m.release(st)
        return [[r[k] for r in rows] for k in range(len(states))]

    before = dict(m.prefix_stats)
    together = stepped([m.new_state(p) for p in prompts])
    assert m.prefix_stats["copied"] == before["copied"]
    with _prefix_cache_off(m):
        alone = [stepped([m.new_state(p)])[0] for p in prompts]
    assert all(bool((a == b).all()) for t, o in zip(together, alone) for a, b in zip(t, o))


def test_likelihood_options_past_the_sliding_window_reuse_the_prompt_in_place(llamacpp_members):
    """One-forward scoring of several options of a prompt longer than Gemma-3's window, scored
    together: each request hands its cache back as soon as its rows are read, so the next option
    reuses the prompt's cache in place (no copy, which past the window is not exact) — and every
    option's log-likelihood is the one it gets scored alone with the prefix cache off."""
    m = llamacpp_members["gemma3"]
    context = SHOTS * 14 + CONTEXT
    assert len(m.encode_prompt(context)) > 600
    ens = Ensemble([m])
    requests = [(context, o) for o in OPTIONS]
    before = dict(m.prefix_stats)
    together = ens.loglikelihood(requests, stepwise=False)
    assert m.prefix_stats["copied"] == before["copied"]
    assert m.prefix_stats["reused"] - before["reused"] >= len(OPTIONS) - 1
    assert m.prefix_stats["fed"] - before["fed"] < 2 * len(m.encode_prompt(context))  # the prompt fed about once
    with _prefix_cache_off(m):
        alone = [ens.loglikelihood([r], stepwise=False)[0] for r in requests]
    assert [t.piece_logprobs for t in together] == [a.piece_logprobs for a in alone]


def test_prefix_cache_reuses_only_what_a_fresh_prefill_computes_alike(llamacpp_members):
    """A cache filled one token per call (generation) is not reused past its prefill; the result is
    bit-identical to a fresh prefill either way."""
    m = llamacpp_members["gemma3"]
    prompt = m.encode_prompt(CONTEXT)
    st = m.new_state(prompt)
    m.next_logprobs([st])
    for tid in m.codec.encode_text(" whale, because it breathes air and feeds its young with milk"):  # as generation
        st.ids.append(tid)
        m.next_logprobs([st])
    full = st.all_ids()
    m.release(st)
    st = m.new_state(full)
    before = dict(m.prefix_stats)
    got = m.next_logprobs([st])[0]
    m.release(st)
    assert m.prefix_stats["fed"] - before["fed"] == len(full) - min(len(prompt), len(full) - BLOCK) // BLOCK * BLOCK
    assert bool((got == _fresh_ids(m, full)).all())


def _fresh_ids(m, ids):
    st = m.new_state(ids)
    with _prefix_cache_off(m):
        try:
            return m.next_logprobs([st])[0]
        finally:
            m.release(st)


@contextlib.contextmanager
def _prefix_cache_off(m):
    """``m`` with its prefix cache off inside the block (every sequence prefilled from scratch)."""
    saved, m.prefix_cache = m.prefix_cache, False
    try:
        yield m
    finally:
        m.prefix_cache = saved


def test_prefix_cache_keeps_only_ids_still_valid_after_a_rollback(llamacpp_members):
    m = llamacpp_members["smollm2"]
    prompt = m.encode_prompt(CONTEXT)
    st = m.new_state(prompt)
    st.ids = m.codec.encode_text(" whale and shark")
    m.next_logprobs([st])
    st.ids = m.codec.encode_text(" trout")  # re-sync replaced the output; only the prompt is still valid
    st.n_valid = len(prompt)
    slot = st.cache
    m.release(st)
    assert slot.ids == prompt and slot.n == len(prompt)


def test_without_prefix_cache_every_sequence_is_prefilled_exactly(llamacpp_members, monkeypatch):
    m = llamacpp_members["qwen"]
    monkeypatch.setattr(m, "prefix_cache", False)
    ids = m.encode_prompt(CONTEXT + OPTIONS[2])
    runs, fed = [], m.prefix_stats["fed"]
    for _ in range(2):
        st = m.new_state(ids)
        runs.append(m.next_logprobs([st])[0])
        m.release(st)
    assert m.prefix_stats["fed"] - fed == 2 * len(ids)
    assert bool((runs[0] == runs[1]).all())


def test_sequential_and_parallel_forward_agree(llamacpp_members):
    members = list(llamacpp_members.values())
    a = Ensemble(members, parallel=True).generate(PROMPTS[0], max_new_tokens=N)
    b = Ensemble(members, parallel=False).generate(PROMPTS[0], max_new_tokens=N)
    assert a.output == b.output and a.member_ids == b.member_ids


def test_multi_seq_auto_is_a_shared_context_with_exact_calls_only(llamacpp_members):
    """``multi_seq: "auto"`` (the default): ``AUTO_SLOTS`` sequence ids with ``exact_calls`` (batched
    calls then give the one-by-one numbers), 0 without (a context per sequence); a number as given."""
    assert (resolve_multi_seq("auto", True), resolve_multi_seq("auto", False)) == (AUTO_SLOTS, 0) and AUTO_SLOTS > 1
    assert (resolve_multi_seq(0, True), resolve_multi_seq(3, False)) == (0, 3)
    for bad in ("many", -1, True, 2.0):
        with pytest.raises(ValueError, match="multi_seq"):
            resolve_multi_seq(bad, True)
    assert all(m.multi_seq == 0 for m in llamacpp_members.values())  # loaded from the default config


def test_multi_seq_mode_stays_in_sync(llamacpp_members):
    from tokenfuse.members.llamacpp import LlamaCppMember

    base = llamacpp_members["gemma3"]
    m = LlamaCppMember("gemma3-multi", base.path, base.tokenizer, multi_seq=3)
    ens = Ensemble([m])
    batch = ens.generate(PROMPTS, max_new_tokens=N)
    for g in batch:
        assert g.steps > 0 and m.codec.decode(g.member_ids[m.name]) == g.output
    assert not m._streams_busy and len(m._streams) == 3  # every sequence id came back
    alone = ens.generate(PROMPTS[0], max_new_tokens=N)  # a single sequence is exact: same as contexts
    assert alone.output == Ensemble([base]).generate(PROMPTS[0], max_new_tokens=N).output


def test_cli_default_ensemble_prints_its_text(llamacpp_members):
    """The README's main command, end to end in a fresh process: members load in threads and the
    output must still reach stdout (llama.cpp's load-time fd redirection once swallowed it)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tokenfuse.cli", "generate", PROMPTS[0], "--max-new-tokens", "6",
                          "--json", "--quiet"], capture_output=True, text=True, timeout=300, check=True)
    import json

    result = json.loads(out.stdout)
    assert result["steps"] > 0 and result["text"].strip()
    assert [m["name"] for m in result["members"]] == [
        "smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"]


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen"])
def test_member_declares_its_context_and_chat_template(llamacpp_members, family):
    m = llamacpp_members[family]
    assert m.context_length == m.llm.n_ctx() == 4096  # MemberConfig's n_ctx: each sequence's own context
    assert m.has_chat_template is bool(m.tokenizer.chat_template)
    assert m.has_chat_template is (family != "gemma3")  # gemma3-270m is the base model
    assert not hasattr(m, "score")  # a score is the ensemble's (``Ensemble.scores``), never a member's


def test_load_member_takes_weight_and_context_from_the_config():
    from tokenfuse.config import MemberConfig
    from tokenfuse.load import load_member

    m = load_member(MemberConfig(name="smol", source="smollm2-135m-instruct", backend="llamacpp", n_ctx=512,
                                 weight=2.0, score=0.625), progress=False)
    assert (m.weight, m.context_length, m.llm.n_ctx()) == (2.0, 512, 512)
    assert not hasattr(m, "score")  # the config's score is the ensemble's (``load.ensemble_from_members``)


def test_input_embeddings_are_the_gguf_table(llamacpp_members):
    """``input_embeddings()`` is ``token_embd.weight`` dequantised exactly as the gguf library does it,
    and it is what DeePEn's relative space reads."""
    import gguf
    import numpy as np
    import torch


    m = llamacpp_members["smollm2"]
    e = m.input_embeddings()
    t = next(t for t in gguf.GGUFReader(m.path).tensors if t.name == "token_embd.weight")
    want = gguf.quants.dequantize(t.data, t.tensor_type)
    assert e.dtype == torch.float32 and tuple(e.shape) == (m.n_vocab, 576) == want.shape
    assert np.array_equal(e.numpy(), want)
    rows = m.embedding_rows()
    ids = [0, 17, m.n_vocab - 1]
    assert (rows.n_rows, rows.dim) == (m.n_vocab, 576) and torch.equal(rows.take(ids), e[ids])


@pytest.mark.real
def test_a_build_with_amx_kernels_runs_members_with_exact_calls_and_says_how_to_rebuild(llamacpp_members,
                                                                                        monkeypatch, caplog):
    """llama.cpp's AMX matrix multiply crashes when two contexts decode at once (an ensemble's members
    do): a member of a build that reports AMX runs with ``exact_calls`` (weights as stored, so no AMX
    weights) and logs how to rebuild, once per process; other builds load as configured."""
    import logging
    import threading

    import llama_cpp
    import torch

    from tokenfuse.members import llamacpp as lc
    from tokenfuse.members import llamacpp_lib

    base = llamacpp_members["smollm2"]
    info = llama_cpp.llama_print_system_info()
    seen = []

    def spy(lib, on):
        seen.append(on)
        return real(lib, on)

    real = lc.weights_as_stored
    monkeypatch.setattr(lc, "weights_as_stored", spy)
    monkeypatch.setattr(llamacpp_lib, "AMX_WARNED", threading.Event())
    plain = LlamaCppMember("smol-plain", base.path, base.tokenizer)
    monkeypatch.setattr(llama_cpp, "llama_print_system_info",
                        lambda: info.replace(b"AMX_INT8 = 1 | ", b"") + b"AMX_INT8 = 1 | ")
    with caplog.at_level(logging.WARNING, logger="tokenfuse.llama_cpp"):
        amx = [LlamaCppMember(f"smol-amx{i}", base.path, base.tokenizer) for i in range(2)]
    assert seen == [False, True, True]
    assert not plain.exact_calls and all(m.exact_calls for m in amx)
    assert plain.multi_seq == 0 and all(m.multi_seq == AUTO_SLOTS for m in amx)  # "auto" follows exact_calls
    advice = [r for r in caplog.records if "AMX" in r.getMessage()]
    assert len(advice) == 1 and advice[0].levelno == logging.WARNING and "scripts/setup.sh" in advice[0].getMessage()
    exact = LlamaCppMember("smol-exact", base.path, base.tokenizer, exact_calls=True)
    for m in (amx[0], exact):  # the same numbers as a member configured with exact_calls
        st = m.new_state(m.encode_prompt("Hi"))
        seen.append(m.next_logprobs([st])[0])
        m.release(st)
    assert torch.equal(seen[-1], seen[-2])


def test_loading_members_in_threads_calls_system_info_one_at_a_time(monkeypatch):
    """``llama_print_system_info`` rebuilds one static std::string in place: two threads in it at once
    corrupt the heap ("munmap_chunk(): invalid pointer" at start-up, before any output). Members load
    in threads (``load_ensemble``) and each checks its build (``amx_build``), so every call must hold
    ``LOAD_LOCK``: a spy in its place sees the lock held and never a second caller inside."""
    import threading
    import time

    import llama_cpp
    from conftest import SHORT

    from tokenfuse.config import EnsembleConfig, MemberConfig
    from tokenfuse.load import load_ensemble
    from tokenfuse.members.llamacpp_lib import LOAD_LOCK

    real, guard, inside, calls = llama_cpp.llama_print_system_info, threading.Lock(), [], []

    def spy():
        with guard:
            inside.append(threading.get_ident())
            calls.append((LOAD_LOCK.locked(), len(inside)))
        time.sleep(0.05)  # a window in which another loader thread's call would be counted
        with guard:
            inside.remove(threading.get_ident())
        return real()

    monkeypatch.setattr(llama_cpp, "llama_print_system_info", spy)
    cfg = EnsembleConfig(members=[MemberConfig(name=n, source=s, backend="llamacpp") for n, s in SHORT.items()])
    with load_ensemble(cfg, progress=False) as ens:
        assert len(ens.members) == 3
    assert len(calls) == 3 and all(locked and alone == 1 for locked, alone in calls), calls


@pytest.mark.real
def test_llama_cpp_log_lines_go_through_logging_not_stderr(llamacpp_members, capfd, caplog):
    """Gemma-3's context creation notice ("using full-size SWA cache") reaches the logger
    ``tokenfuse.llama_cpp`` at DEBUG and nothing is written to stderr by default."""
    import logging

    from tokenfuse.members.llamacpp import LlamaCppMember

    base = llamacpp_members["gemma3"]
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG, logger="tokenfuse.llama_cpp"):
        m = LlamaCppMember("gemma3-logs", base.path, base.tokenizer)
        st = m.new_state(m.encode_prompt("Hi"))
        m.next_logprobs([st])
        m.release(st)
    swa = [r for r in caplog.records if r.name == "tokenfuse.llama_cpp" and "SWA cache" in r.getMessage()]
    assert swa and all(r.levelno == logging.DEBUG for r in swa)
    caplog.clear()
    m2 = LlamaCppMember("gemma3-quiet", base.path, base.tokenizer)  # logging not turned up: silent
    st = m2.new_state(m2.encode_prompt("Hi"))
    m2.next_logprobs([st])
    m2.release(st)
    assert capfd.readouterr().err == ""


# ---------------------------------------------------------------------------- many positions per forward
TEXT = " Paris is the capital city of France, and Lyon is the third largest city of the country after"


def _state_of(m, ids):
    st = m.new_state(ids[:1])
    st.ids = list(ids[1:])
    return st


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen"])
def test_logprobs_at_in_blocks_of_eight_equals_one_chunk(llamacpp_members, family):
    """Any split into calls of a multiple of 8 tokens gives one chunk's numbers (the rule the prefix
    cache relies on; shorter calls differ, docs/evaluation.md)."""
    m = llamacpp_members[family]
    with _prefix_cache_off(m):
        ids = (m.encode_prompt(PROMPTS[0]) + m.codec.encode_text(TEXT + TEXT))[:48]
        st = _state_of(m, ids)
        whole = m.logprobs_at(st, [16, 32, 48])
        m.release(st)
        st = _state_of(m, ids[:16])
        parts = [m.logprobs_at(st, [16])[0]]
        for n in (32, 48):  # 16 more ids per call
            st.ids = list(ids[1:n])
            parts.append(m.logprobs_at(st, [n])[0])
        m.release(st)
        for a, b in zip(whole, parts):
            assert (a - b).abs().max().item() == 0.0


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen"])
def test_thread_count_does_not_change_the_numbers(llamacpp_members, family):
    """The member pool gives a member 1 core when members run side by side and all of them when it
    runs alone (``share_cores``): a one-token decode and a chunk are bit-identical either way."""
    m = llamacpp_members[family]
    ids = m.encode_prompt(CONTEXT + OPTIONS[0])
    got = {}
    for n in (1, 2, 1):
        m.share_cores(n)
        st = m.new_state(ids[:-9])
        m.next_logprobs([st])
        assert st.cache.threads == n
        st.ids = ids[len(ids) - 9:len(ids) - 8]
        one = m.next_logprobs([st])[0]
        st.ids = ids[len(ids) - 9:]
        chunk = m.logprobs_at(st, [len(ids) - 4, len(ids)])
        m.release(st)
        got.setdefault(n, []).append((one, chunk))
    m.share_cores(2)
    (a1, c1), (a2, c2) = got[1][0], got[2][0]
    assert bool((a1 == a2).all()) and bool((c1 == c2).all())
    assert bool((got[1][1][0] == a1).all())


def test_rows_sharing_a_memo_give_the_numbers_each_gives_alone(llamacpp_members):
    """``tokenfuse eval``'s rows share the members' forwards per batch (``RowMemo``): on the real
    members (prefix cache on, as by default) every row's likelihoods are identical to its own run."""
    from tokenfuse.engine import RowMemo

    ms = [llamacpp_members[f] for f in ("smollm2", "gemma3", "qwen")]
    rows = [Ensemble.single(ms[0]), Ensemble(ms), Ensemble(ms, method="unite"),
            Ensemble(ms, gate=ms[0].name, threshold=0.5), Ensemble.single(ms[2]),
            Ensemble(ms, params={"prompt_weights": 0.1})]
    requests = [("Question: Which is a liquid?\nAnswer:", c) for c in (" water", " a rock that melts", " wood")]
    alone = [ens.loglikelihood(requests) for ens in rows]
    memo = RowMemo()
    assert [ens.loglikelihood(requests, memo=memo) for ens in rows] == alone
    # 3 rows cut by ms[0] share; the prompt-weighted row neither shares nor takes rows (its own prefill)
    assert memo.hits + memo.misses == 11 * len(requests) and memo.misses <= 4 * len(requests)


@pytest.mark.parametrize("method", ["gac", "unite"])
def test_speculative_decoding_stays_in_sync_and_departs_from_plain_only_at_a_near_tie(llamacpp_members, method):
    """Speculative rounds roll members back and forth; every member's ids still decode to the output.
    Its verification feeds drafted positions in chunks, whose numbers differ from one-position calls
    on llama.cpp (docs/evaluation.md, "One-forward scoring"), so plain and speculative greedy outputs
    can differ at a near-tie (which prompts do depends on the build: on an AMD EPYC build unite's
    prompts 1 and 2 did, at gaps of 0.0014 and 0.0024 in plain's numbers). At the first piece where
    they differ, plain decoding's own numbers rank the speculative piece within ``ROLLBACK_TOL`` of
    its pick. With ``exact_calls`` they are equal on every prompt (tests/test_exact_calls.py)."""
    members = list(llamacpp_members.values())
    plain = Ensemble(members, method=method)
    spec = Ensemble(members, method=method, speculative={"k": 4})
    assert spec.describe()["speculative"]["draft"] == "smollm2"  # the smallest GGUF file
    for k, prompt in enumerate(PROMPTS):
        a = plain.generate(prompt, max_new_tokens=N, trace=True, trace_k=8)
        seq, pieces = spec.open(prompt, max_new_tokens=N), []
        try:
            while seq.finished is None:
                pieces += [ev.piece for ev in spec.step([seq])]
            b = seq.result()
        finally:
            spec.close(seq)
        assert b"".join(pieces) == b.output
        assert 0 < b.accepted <= b.drafted
        for m in members:
            assert m.codec.decode(b.member_ids[m.name]) == b.output
        first = first_difference([s.raw for s in a.trace], pieces)
        if first is None:
            assert b.output == a.output
        else:
            assert_near_tie(a.trace[first], pieces[first], ROLLBACK_TOL, f"{method} prompt {k}, piece {first}")


# ---------------------------------------------------------------------------- eval's generate form
def test_eval_generate_table_gives_each_rows_outputs_as_it_gives_them_alone(llamacpp_members, tmp_path):
    """In the generate form the rows run batch by batch, so a row after the first takes the batch's
    prompts from the caches the previous rows left; its outputs are the ones it gives alone, its
    prompts prefilled fresh (prefix cache off)."""
    import json

    from tokenfuse import Ensemble
    from tokenfuse.config import config_from_models
    from tokenfuse.eval.records import item_file, read_records
    from tokenfuse.eval.runner import EvalSettings, run_eval

    qa = [{"id": f"tq-{i}", "question": q, "answer": a, "aliases": [a]} for i, (q, a) in enumerate([
        ("Which city, on the river Seine, has been the capital of France since the tenth century?", "Paris"),
        ("Which planet of the solar system, the fourth from the sun, is known as the red planet?", "Mars"),
        ("Which element, with the chemical symbol O, makes up about a fifth of the air we breathe?", "Oxygen")])]
    data = tmp_path / "data" / "triviaqa"
    data.mkdir(parents=True)
    for split in ("test", "dev"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in qa), encoding="utf-8")
    members = [llamacpp_members["smollm2"], llamacpp_members["qwen"]]
    cfg = config_from_models([m.name for m in members])
    union = Ensemble(members).union

    def outputs(methods, out):
        settings = EvalSettings(tasks=["triviaqa"], methods=methods, limit=3, data=str(tmp_path / "data"),
                                out=str(tmp_path / out), batch_size=2, num_fewshot=0,
                                max_new_tokens={"triviaqa": 6}, progress=False)
        run_eval(cfg, settings, members=members, union=union, log=lambda msg: None)
        return {i: r["output"] for i, r in read_records(item_file(tmp_path / out, "triviaqa", "generate",
                                                                   "gac")).items()}

    before = [m.prefix_stats["reused"] for m in members]
    table = outputs(["single", "gac"], "table")
    assert all(m.prefix_stats["reused"] - b >= 3 for m, b in zip(members, before))  # gac's 3 prompts at least
    with _prefix_cache_off(members[0]), _prefix_cache_off(members[1]):
        alone = outputs(["gac"], "alone")
    assert table == alone and len(table) == 3 and all(table.values())


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen"])
def test_a_batch_side_by_side_gives_the_numbers_one_after_another_gives(llamacpp_members, family):
    """A batch's sequences run in threads of their own, the member's cores split among them
    (``side_by_side``, the default): every row of every step is bit-identical to forwarding them
    one after another, and seeded samples are the same pieces."""
    from tokenfuse.engine import Sampling

    m = llamacpp_members[family]
    m.share_cores(2)
    prompts = PROMPTS + [PROMPTS[0]]
    rows, outs = {}, {}
    try:
        for side in (True, False):
            m.side_by_side = side
            calls = m.side.side_by_side_calls
            states = [m.new_state(m.encode_prompt(p)) for p in prompts]
            rows[side] = []
            for _ in range(4):
                lp = m.next_logprobs(states)
                rows[side].append(lp)
                for st, row in zip(states, lp):
                    st.ids.append(int(row.argmax()))
            for st in states:
                m.release(st)
            samplings = [Sampling(temperature=0.8, seed=s) for s in (1, 2, 3)] + [Sampling()]
            gens = Ensemble.single(m).generate(prompts, max_new_tokens=N, sampling=samplings)
            outs[side] = [(g.output, g.member_ids) for g in gens]
            assert (m.side.side_by_side_calls > calls) == side
    finally:
        m.side_by_side = True
    assert all(bool((a == b).all()) for a, b in zip(rows[True], rows[False]))
    assert outs[True] == outs[False]


def test_scoring_takes_the_picked_entries_bit_for_bit(llamacpp_members):
    """Scoring a text by its own tokens (``Rows.logprobs_of``: each row's entry taken as llama.cpp's
    row is computed, no whole 262k-entry rows kept) gives the whole rows' entries bit for bit, over
    more than one decode call (n_batch 512)."""
    from test_text_score import picked_equals_whole_rows

    line = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    for m in llamacpp_members.values():
        assert picked_equals_whole_rows(m, line * 4) > 64
    assert picked_equals_whole_rows(llamacpp_members["smollm2"], line * 30) > 512  # two decode calls
