"""The step trace (``Ensemble.generate(..., trace=True)``, ``tokenfuse generate --trace``, the server's
``tokenfuse.trace``) on tiny random-weight members: the same output with and without it, pieces that
concatenate to the output, and each field checked against the members computed directly."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import tokenfuse.load
from tokenfuse.cli import main
from tokenfuse.engine import Ensemble
from tokenfuse.engine import decide as decide_module
from tokenfuse.engine.flags import StepFlags
from tokenfuse.engine.trace import StepRecord, Trace, TraceOptions, end_text

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time"]
STEP_KEYS = {"step", "text", "bytes", "token", "end", "cut", "prob", "top", "gated", "ensembled", "skipped",
             "speculative", "members"}

pytestmark = pytest.mark.usefixtures("one_thread")


def same_generation(a, b) -> None:
    assert (a.text, a.output, a.steps, a.ensembled_steps, a.skipped_steps, a.finish_reason, a.member_ids) == \
           (b.text, b.output, b.steps, b.ensembled_steps, b.skipped_steps, b.finish_reason, b.member_ids)


def check_concatenates(g) -> None:
    assert "".join(s.text for s in g.trace) == g.text
    assert b"".join(s.raw for s in g.trace) == g.output
    assert [s.step for s in g.trace] == list(range(len(g.trace)))
    assert len(g.trace) == g.steps + (g.finish_reason == "end")


@pytest.mark.parametrize("options", [
    {}, {"method": "unite", "params": {"k": 4}}, {"gate": "A", "threshold": 0.02},
    {"agreement_skip": False},
])
def test_trace_leaves_the_output_alone_and_concatenates(members, align_cache, options):
    ens = Ensemble(members, align_cache=align_cache, **options)
    for prompt in PROMPTS:
        plain = ens.generate(prompt, max_new_tokens=10)
        traced = ens.generate(prompt, max_new_tokens=10, trace=True, trace_k=3)
        assert plain.trace is None
        same_generation(plain, traced)
        check_concatenates(traced)
        for s in traced.trace:
            assert set(s.to_dict()) == STEP_KEYS and s.speculative is False
            assert [m.name for m in s.members] == ["A", "B", "C"]
            assert len(s.top) == 3 and all(len(m.top) == 3 for m in s.members if m.computed)
            assert s.token == s.text and not s.end and not s.cut
            assert s.top[0].prob == max(t.prob for t in s.top)
            # greedy: the chosen piece is the combined distribution's most likely one
            assert s.prob == s.top[0].prob and s.bytes == s.top[0].bytes
        assert sum(s.ensembled for s in traced.trace) == traced.ensembled_steps
        assert sum(s.skipped for s in traced.trace) == traced.skipped_steps
        assert sum(s.gated for s in traced.trace) == (traced.steps - traced.ensembled_steps if "gate" in options else 0)


def test_single_member_trace_is_the_model_itself(make_tiny, align_cache):
    """One member: the step's probability is its own (renormalised over text + END ids), its top-k is
    ``torch.topk`` of the model's own next-token distribution, computed here without the engine."""
    m = make_tiny("smollm2", seed=3, name="solo")
    ens = Ensemble([m], align_cache=align_cache)
    g = ens.generate(PROMPTS[0], max_new_tokens=6, trace=True, trace_k=4)
    check_concatenates(g)
    ids = m.encode_prompt(PROMPTS[0])
    text_or_end = torch.tensor([b is not None or i in m.codec.end_ids for i, b in enumerate(m.codec.token_bytes)])
    # The engine's member computes with its KV cache, the reference here without: the same distribution
    # up to float rounding, which depends on the CPU's kernels (1.02e-5 relative on an AVX-512 machine;
    # within 1e-5 on earlier ones), so the tolerance is the project's float-rounding one, 1e-4 (docs/evaluation.md)
    rel = 1e-4
    for s, tid in zip(g.trace, g.member_ids["solo"]):
        with torch.inference_mode():
            lp = torch.log_softmax(m.model(input_ids=torch.tensor([ids], device=m.device)).logits[0, -1].float().cpu(), -1)
        p = lp.exp()
        (ms,) = s.members
        assert ms.computed and ms.holds_piece and s.members[0].name == "solo"
        assert ms.piece_prob == pytest.approx(float(p[tid]), rel=rel)
        assert s.prob == pytest.approx(float(p[tid] / p[text_or_end[: len(p)]].sum()), rel=rel)
        top = torch.topk(lp, 4)
        assert [t.id for t in ms.top] == top.indices.tolist()
        assert [t.prob for t in ms.top] == pytest.approx(top.values.exp().tolist(), rel=rel)
        assert [t.text for t in ms.top] == [m.codec.token_bytes[i].decode("utf-8", "replace") for i in top.indices]
        assert s.bytes == m.codec.token_bytes[tid].hex() and not s.skipped and not s.ensembled
        ids.append(tid)


def test_members_and_flags(members, align_cache):
    ens = Ensemble(members, align_cache=align_cache)
    g = ens.generate(PROMPTS[1], max_new_tokens=12, trace=True)
    space = ens.space
    for s in g.trace:
        entry = space.union.pieces.index(s.raw)
        for i, ms in enumerate(s.members):
            assert ms.computed and len(ms.top) == 5
            assert ms.holds_piece == (space.member_id(i, entry) >= 0)
            assert (ms.piece_prob is not None) == ms.holds_piece
            assert all((t.bytes == "") == (t.id in members[i].codec.special_ids) for t in ms.top)
            if ms.holds_piece and any(t.bytes == s.bytes for t in ms.top):
                assert ms.piece_prob >= next(t.prob for t in ms.top if t.bytes == s.bytes) * (1 - 1e-6)
        if s.skipped:  # agreement: every member's most likely text token is the chosen piece
            assert all(next(t for t in ms.top if t.bytes).bytes == s.bytes for ms in s.members)


def test_gated_steps_show_the_gate_alone(members, align_cache):
    for threshold in (0.02, 0.03, 0.05, 0.08, 0.13, 0.2):  # one where the gate decides some steps, not all
        ens = Ensemble(members, gate="B", threshold=threshold, align_cache=align_cache)
        g = ens.generate(PROMPTS[2], max_new_tokens=16, trace=True)
        gated = [s for s in g.trace if s.gated]
        if 0 < len(gated) < len(g.trace):
            break
    assert 0 < len(gated) < len(g.trace)
    for s in gated:
        assert [m.computed for m in s.members] == [False, True, False] and not s.ensembled
        assert s.members[0].top is None and s.members[0].piece_prob is None
        assert s.members[1].top[0].prob > threshold  # the gate was confident
    for s in g.trace:
        if not s.gated:
            assert all(m.computed for m in s.members) and s.ensembled


def test_unite_trace_shows_members_beyond_the_combiner_k(members, align_cache):
    ens = Ensemble(members, method="unite", params={"k": 2}, align_cache=align_cache)
    plain = ens.generate(PROMPTS[0], max_new_tokens=8)
    g = ens.generate(PROMPTS[0], max_new_tokens=8, trace=True, trace_k=6)
    same_generation(plain, g)  # the members' wider top-k reaches the trace, not the combiner
    assert all(len(m.top) == 6 for s in g.trace for m in s.members)
    assert all(len(s.top) <= 6 for s in g.trace)  # candidates: the union of the members' top-2


def test_stop_cut_and_stream(ens):
    full = ens.generate(PROMPTS[2], max_new_tokens=20)
    stop = full.text[7:11]
    g = ens.generate(PROMPTS[2], max_new_tokens=20, stop=[stop], trace=True)
    assert g.finish_reason == "stop" and g.text == full.text[: full.text.index(stop)]
    check_concatenates(g)
    cuts = [s.cut for s in g.trace]
    assert cuts[-1] and cuts == sorted(cuts)  # the stop string's pieces, at the end
    assert all(s.raw == s.token.encode() for s in g.trace if not s.cut)
    assert all(len(s.raw) < len(s.token.encode()) for s in g.trace if s.cut)
    streamed = list(ens.stream(PROMPTS[2], max_new_tokens=20, stop=[stop], trace=True))
    assert tuple(streamed) == g.trace
    assert "".join(ens.stream(PROMPTS[2], max_new_tokens=20, stop=[stop])) == g.text


def test_end_is_a_step_with_the_end_token(make_tiny, align_cache, monkeypatch):
    """A member pushed to END after three pieces: the fourth step is END, written as its end token."""
    m = make_tiny("smollm2", seed=4, name="ender")
    start = len(m.encode_prompt(PROMPTS[0]))
    forward = m._forward_batch
    eos = sorted(m.codec.end_ids)

    def end(st, lp):
        if st.length >= start + 3:
            lp = torch.log_softmax(lp + 40.0 * torch.isin(torch.arange(len(lp)), torch.tensor(eos)), -1)
        return lp

    monkeypatch.setattr(m, "_forward_batch", lambda states: [end(st, lp) for st, lp in zip(states, forward(states))])
    g = Ensemble([m], align_cache=align_cache).generate(PROMPTS[0], max_new_tokens=10, trace=True)
    assert g.finish_reason == "end" and g.steps == 3 and len(g.trace) == 4
    last = g.trace[-1]
    assert last.end and last.text == "" and last.bytes == "" and last.token == end_text(m)
    assert last.token == m.tokenizer.eos_token and last.top[0].end and last.top[0].text == last.token
    assert last.members[0].top[0].end and last.members[0].top[0].id in m.codec.end_ids
    check_concatenates(g)


def test_split_characters_go_with_the_step_that_completes_them():
    def rec(token: str) -> StepRecord:
        return StepRecord(token=token, end=False, prob=0.5, top=(), flags=StepFlags(gated=False, ensembled=True, skipped=False))

    out = "aé€b".encode()  # a | é split 1+1 | € split 2+1 | b
    spans = [(0, 1), (1, 2), (2, 3), (3, 5), (5, 6), (6, 7)]
    t = Trace(TraceOptions())
    for a, b in spans:
        t.add(rec(out[a:b].decode("utf-8", "replace")), a, b)
    first = t.release(out, 4)  # the stream may show up to byte 4: steps ending there
    assert [s.text for s in first] == ["a", "", "é"]
    rest = t.release(out, None)
    assert [s.text for s in rest] == ["", "€", "b"]
    assert "".join(s.text for s in first + rest) == out.decode()
    assert [s.step for s in t.steps] == list(range(6)) and [s.raw for s in t.steps] == [out[a:b] for a, b in spans]
    # a stop string trimming the output to 4 bytes cuts the pending steps
    t2 = Trace(TraceOptions())
    for a, b in spans:
        t2.add(rec(""), a, b)
    t2.cut(4)
    steps = t2.release(out[:4], None)
    assert [s.raw for s in steps] == [b"a", out[1:2], out[2:3], out[3:4], b"", b""]
    assert [s.cut for s in steps] == [False, False, False, True, True, True]
    assert "".join(s.text for s in steps) == out[:4].decode("utf-8", "replace")


def close(a, b) -> bool:
    """Equal, floats within rounding (a batched forward's numbers differ from one row's in the last bits)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-7)
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return all(close(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


def test_batch_and_zero_cost_when_off(ens, monkeypatch):
    batch = ens.generate(PROMPTS, max_new_tokens=6, trace=True)
    for p, g in zip(PROMPTS, batch):
        alone = ens.generate(p, max_new_tokens=6, trace=True)
        assert g.output == alone.output and close(g.trace, alone.trace)
    # trace off: no record is built and the members are asked for nothing more than the combiner needs
    monkeypatch.setattr(decide_module, "record_step", lambda *a, **k: pytest.fail("traced an untraced step"))
    seen = []
    forward = ens.pool.forward
    monkeypatch.setattr(ens.pool, "forward", lambda which, states, topk=0: seen.append(topk) or forward(
        which, states, topk=topk))
    g = ens.generate(PROMPTS, max_new_tokens=6)
    assert all(x.trace is None for x in g) and set(seen) == {0}


def test_json_shape(ens):
    g = ens.generate(PROMPTS[0], max_new_tokens=3, trace=True, trace_k=2)
    d = json.loads(json.dumps(g.trace[0].to_dict()))
    assert set(d) == STEP_KEYS
    assert set(d["top"][0]) == {"text", "bytes", "prob", "end"}
    assert set(d["members"][0]) == {"name", "computed", "holds_piece", "piece_prob", "top"}
    assert set(d["members"][0]["top"][0]) == {"id", "text", "bytes", "prob", "end"}
    assert bytes.fromhex(d["bytes"]).decode() == d["text"]


# ---------------------------------------------------------------------------------------- the command line

def test_cli_generate_trace(capsys, monkeypatch, members, align_cache):
    ens = Ensemble(members, align_cache=align_cache)
    monkeypatch.setattr(tokenfuse.load, "load_ensemble", lambda cfg, progress=True: ens)
    code = main(["generate", PROMPTS[0], "--models", "A,B,C", "--max-new-tokens", "5", "--trace", "--trace-k", "2"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    data = json.loads(out)  # --trace implies --json
    g = ens.generate(PROMPTS[0], max_new_tokens=5, trace=True, trace_k=2)
    assert data["text"] == g.text and data["trace"] == [s.to_dict() for s in g.trace]
    code = main(["generate", PROMPTS[0], "--models", "A,B,C", "--trace", "--trace-k", "0"])
    out, err = capsys.readouterr()
    assert code == 2 and err.strip() == "tokenfuse: error: --trace-k: must be at least 1, got 0"


# ---------------------------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def client(ens):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from tokenfuse.server import ServerSettings, create_app

    with TestClient(create_app(ens, settings=ServerSettings(max_tokens=64))) as c:
        yield c


def sse(text: str) -> list:
    return [json.loads(b[6:]) for b in text.split("\n\n") if b.startswith("data: {")]


def test_server_trace(client, ens):
    g = ens.generate(PROMPTS[1], max_new_tokens=8, trace=True, trace_k=3)
    expected = [s.to_dict() for s in g.trace]
    for d in expected:
        d["top"] = d["top"][:3]
    body = {"prompt": PROMPTS[1], "max_tokens": 8, "tokenfuse": {"trace": True, "trace_k": 3}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["choices"][0]["text"] == g.text and data["choices"][0]["logprobs"] is None
    assert data["tokenfuse"]["trace"] == [{"index": 0, "steps": expected}]
    # streamed: each chunk's steps are its text
    chunks = sse(client.post("/v1/completions", json={**body, "stream": True}).text)
    steps = []
    for c in chunks:
        if c["choices"] and c["choices"][0]["text"]:
            (t,) = c["tokenfuse"]["trace"]
            assert t["index"] == 0 and "".join(s["text"] for s in t["steps"]) == c["choices"][0]["text"]
            steps += t["steps"]
    assert steps == expected
    # with more top_logprobs than trace_k the trace still shows trace_k entries
    both = client.post("/v1/completions", json={**body, "logprobs": 7}).json()
    assert both["tokenfuse"]["trace"] == [{"index": 0, "steps": expected}]
    assert all(len(t) == 7 for t in both["choices"][0]["logprobs"]["top_logprobs"])
    # the trace does not make another ensemble: no "tokenfuse" options, no trace, the same text
    plain = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 8}).json()
    assert plain["choices"][0]["text"] == g.text and "trace" not in plain["tokenfuse"]


def test_server_trace_chat_and_errors(client, ens):
    messages = [{"role": "user", "content": "Hi"}]
    g = ens.generate(messages, max_new_tokens=5, chat=True, trace=True)
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "tokenfuse": {"trace": True}})
    assert r.status_code == 200, r.text
    assert r.json()["tokenfuse"]["trace"][0]["steps"] == [s.to_dict() for s in g.trace]
    for bad in ({"trace_k": 0}, {"trace_k": 21}, {"trace": "yes please"}):
        r = client.post("/v1/completions", json={"prompt": "x", "tokenfuse": {"trace": True, **bad}})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("tokenfuse."), r.text


def test_trace_probability_is_finite_log(ens):
    g = ens.generate(PROMPTS[0], max_new_tokens=4, trace=True)
    assert all(math.isfinite(s.logprob) and s.logprob == math.log(s.prob) for s in g.trace)


# ---------------------------------------------------------------------------------------- the real members

@pytest.mark.real
def test_real_members_trace_and_logprobs(llamacpp_members, align_cache, monkeypatch):
    """The three bundled models (llama.cpp): the trace leaves the output alone and concatenates, agreement
    skips are steps where every member's most likely text token is the piece, a GaC step's probability is
    the members' average (each renormalised over its text + END tokens, so within their special-token
    mass of the average of the raw ``piece_prob``), and the server's log-probabilities and echo are the
    engine's."""
    from fastapi.testclient import TestClient

    from tokenfuse.server import create_app

    for m in llamacpp_members.values():  # every sequence computed afresh: a reused prefix (fed in another
        monkeypatch.setattr(m, "prefix_cache", False)  # batch shape) moves llama.cpp's logits slightly
    ens = Ensemble(list(llamacpp_members.values()), align_cache=align_cache)
    prompt = "Question: What is the capital of France?\nAnswer:"
    plain = ens.generate(prompt, max_new_tokens=8)
    g = ens.generate(prompt, max_new_tokens=8, trace=True)
    same_generation(plain, g)
    check_concatenates(g)
    assert any(s.skipped for s in g.trace)
    for s in g.trace:
        if s.skipped:
            assert all(next(t for t in m.top if t.bytes).bytes == s.bytes for m in s.members)
        mean = sum(m.piece_prob or 0.0 for m in s.members) / len(s.members)
        assert s.prob == pytest.approx(mean, rel=0.01)  # measured: within 0.3%
    with TestClient(create_app(ens)) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "logprobs": 5, "echo": True})
    assert r.status_code == 200, r.text
    out = r.json()["choices"][0]["logprobs"]
    pieces = ens.prompt_logprobs(prompt)
    n = len(pieces)
    assert out["token_logprobs"][:n] == [x for _, x in pieces] and out["token_logprobs"][0] is None
    assert all(x is not None and x < 0 for x in out["token_logprobs"][1:])
    assert out["token_logprobs"][n:] == [math.log(s.prob) for s in g.trace]
    assert "".join(out["tokens"]) == prompt + g.text
