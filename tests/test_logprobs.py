"""``logprobs`` / ``top_logprobs`` / ``echo`` in the OpenAI-compatible API, on tiny random-weight members:
every value is the engine's own (its step trace, ``Ensemble.loglikelihood``), and lm-evaluation-harness's
own ``local-completions`` model scores a local multiple-choice task against a running server."""

from __future__ import annotations

import json
import math
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi", reason="the server extra is not installed (pip install -e '.[server]')")

from fastapi.testclient import TestClient  # noqa: E402

from tokenfuse.engine import Ensemble  # noqa: E402
from tokenfuse.server import ServerSettings, create_app  # noqa: E402

PROMPTS = ["The capital of France is", "def fib(n):", "Question: What is 2+2?\nAnswer: 4"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def client(ens):
    with TestClient(create_app(ens, settings=ServerSettings(max_tokens=64, max_n=4))) as c:
        yield c


def sse(text: str) -> list:
    return [json.loads(b[6:]) for b in text.split("\n\n") if b.startswith("data: {")]


def lp(p: float) -> float:
    return math.log(p) if p > 0 else -9999.0


def legacy_expected(steps, n: int) -> dict:
    """The legacy ``logprobs`` object the trace ``steps`` should give (every step has bytes here)."""
    offsets, at = [], 0
    for s in steps:
        offsets.append(at)
        at += len(s.text)
    return {"tokens": [s.token if s.end else s.text for s in steps],
            "token_logprobs": [lp(s.prob) for s in steps],
            "top_logprobs": [{t.text: lp(t.prob) for t in s.top[:n]} for s in steps],
            "text_offset": offsets}


# ---------------------------------------------------------------------------------------- completions

@pytest.mark.parametrize("n", [0, 1, 3, 20])
def test_completion_logprobs_are_the_combined_distribution(client, ens, n):
    g = ens.generate(PROMPTS[0], max_new_tokens=8, trace=True, trace_k=n)
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "logprobs": n})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["text"] == g.text
    assert choice["logprobs"] == legacy_expected(g.trace, n)
    assert "".join(choice["logprobs"]["tokens"]) == g.text
    assert all(len(t) == n for t in choice["logprobs"]["top_logprobs"])  # random tiny models: no duplicate texts
    # greedy: the chosen piece is the top one (lm-eval's is_greedy test)
    if n:
        assert all(v == max(t.values()) for v, t in zip(choice["logprobs"]["token_logprobs"],
                                                        choice["logprobs"]["top_logprobs"]))
    assert "trace" not in r.json()["tokenfuse"]


def test_completion_logprobs_stream(client, ens):
    g = ens.generate(PROMPTS[1], max_new_tokens=10, trace=True, trace_k=2)
    chunks = sse(client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 10, "logprobs": 2,
                                                      "stream": True}).text)
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for c in chunks:
        (ch,) = c["choices"]
        if ch["text"]:
            assert "".join(ch["logprobs"]["tokens"]) == ch["text"]
            assert ch["logprobs"]["text_offset"][0] == len(text)
            text += ch["text"]
            for k in merged:
                merged[k] += ch["logprobs"][k]
        else:
            assert ch["logprobs"] is None
    assert text == g.text and merged == legacy_expected(g.trace, 2)


def test_chat_logprobs(client, ens):
    messages = [{"role": "user", "content": "Name a colour."}]
    g = ens.generate(messages, max_new_tokens=6, chat=True, trace=True, trace_k=4)
    expected = {"content": [{"token": s.text, "logprob": lp(s.prob), "bytes": list(s.raw),
                             "top_logprobs": [{"token": t.text, "logprob": lp(t.prob),
                                               "bytes": list(bytes.fromhex(t.bytes))} for t in s.top[:4]]}
                            for s in g.trace]}
    body = {"messages": messages, "max_tokens": 6, "logprobs": True, "top_logprobs": 4}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["message"]["content"] == g.text and choice["logprobs"] == expected
    # without top_logprobs: the chosen pieces only
    r = client.post("/v1/chat/completions", json={**body, "top_logprobs": None})
    assert [e["top_logprobs"] for e in r.json()["choices"][0]["logprobs"]["content"]] == [[]] * len(g.trace)
    # streamed: the same entries, each with its chunk's text
    content = []
    for c in sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text):
        ch = c["choices"][0]
        if ch["delta"].get("content"):
            assert "".join(e["token"] for e in ch["logprobs"]["content"]) == ch["delta"]["content"]
            content += ch["logprobs"]["content"]
    assert {"content": content} == expected
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6})
    assert r.json()["choices"][0]["logprobs"] is None


def test_end_is_the_end_token(make_tiny, align_cache, monkeypatch):
    m = make_tiny("smollm2", seed=4, name="ender")
    start = len(m.encode_prompt(PROMPTS[0]))
    forward = m._forward_batch
    eos = torch.tensor(sorted(m.codec.end_ids))

    def end(st, out):  # END after three pieces
        return torch.log_softmax(out + 40.0 * torch.isin(torch.arange(len(out)), eos), -1) \
            if st.length >= start + 3 else out

    monkeypatch.setattr(m, "_forward_batch", lambda states: [end(st, lp) for st, lp in zip(states, forward(states))])
    with TestClient(create_app(Ensemble([m], align_cache=align_cache))) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "logprobs": 1})
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                    "max_tokens": 8, "logprobs": True, "top_logprobs": 1})
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "stop" and len(choice["logprobs"]["tokens"]) == 4
    assert choice["logprobs"]["tokens"][-1] == "<|im_end|>" == m.tokenizer.eos_token
    assert choice["logprobs"]["top_logprobs"][-1] == {"<|im_end|>": choice["logprobs"]["token_logprobs"][-1]}
    assert choice["logprobs"]["text_offset"][-1] == len(choice["text"])
    last = chat.json()["choices"][0]["logprobs"]["content"][-1]
    assert last["token"] == "<|im_end|>" and last["bytes"] == list(b"<|im_end|>")


def test_stop_trims_the_entries(client, ens):
    full = ens.generate(PROMPTS[2], max_new_tokens=20).text
    stop = full[6:9]
    g = ens.generate(PROMPTS[2], max_new_tokens=20, stop=[stop], trace=True, trace_k=1)
    r = client.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 20, "stop": [stop], "logprobs": 1})
    lps = r.json()["choices"][0]["logprobs"]
    kept = [s for s in g.trace if s.raw]  # a piece the stop string removed entirely has no entry
    assert lps == legacy_expected(kept, 1) and "".join(lps["tokens"]) == g.text


# ---------------------------------------------------------------------------------------- echo: scoring the prompt

def test_echo_scores_the_prompt(client, ens):
    prompt = PROMPTS[2]
    pieces = ens.prompt_logprobs(prompt)
    codec = ens.space.codecs[ens.primary]
    ids = codec.encode_text(prompt)
    assert [b for b, _ in pieces] == [codec.token_bytes[t] for t in ids]  # the primary's segmentation
    first = pieces[0][0].decode()
    (lk,) = ens.loglikelihood([(first, prompt[len(first):])])  # teacher forcing from the first piece
    assert pieces == [(pieces[0][0], None), *zip(lk.piece_bytes, lk.piece_logprobs)]

    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "logprobs": 1, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    out = choice["logprobs"]
    assert out["tokens"] == [b.decode() for b, _ in pieces] and "".join(out["tokens"]) == prompt
    assert out["token_logprobs"] == [x for _, x in pieces] and out["token_logprobs"][0] is None
    assert out["top_logprobs"][0] is None
    scored = ens.score_prompt(prompt, top=1)
    assert [(p.bytes, p.logprob) for p in scored] == pieces
    assert out["top_logprobs"][1:] == [{p.top[0].text: math.log(p.top[0].prob)} for p in scored[1:]]
    assert out["text_offset"] == [sum(len(b) for b, _ in pieces[:k]) for k in range(len(pieces))]  # ASCII

    # with generated pieces after it (lm-eval asks max_tokens 1), streamed or not
    g = ens.generate(prompt, max_new_tokens=3, trace=True, trace_k=1)
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "logprobs": 1, "echo": True})
    out = r.json()["choices"][0]["logprobs"]
    assert r.json()["choices"][0]["text"] == prompt + g.text
    n = len(pieces)
    assert out["token_logprobs"][:n] == [x for _, x in pieces]
    tail = legacy_expected(g.trace, 1)
    assert out["tokens"][n:] == tail["tokens"] and out["token_logprobs"][n:] == tail["token_logprobs"]
    assert out["text_offset"][n:] == [len(prompt) + o for o in tail["text_offset"]]
    chunks = sse(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "logprobs": 1, "echo": True,
                                                      "stream": True}).text)
    merged = {k: [] for k in out}
    for c in chunks:
        if c["choices"] and c["choices"][0]["logprobs"]:
            for k in merged:
                merged[k] += c["choices"][0]["logprobs"][k]
    assert merged == out
    assert chunks[0]["choices"][0]["text"] == prompt


def test_echo_of_a_split_first_character(client, ens):
    """A prompt whose first character is several byte pieces of the primary: the context grows to the
    end of that character (those pieces have no log-probability); tokens carry whole characters."""
    prompt = "肺癌 x"
    pieces = ens.prompt_logprobs(prompt)
    assert [b for b, _ in pieces] == [bytes([c]) for c in "肺癌".encode()] + [b" x"]  # SmolLM2's byte pieces
    (lk,) = ens.loglikelihood([("肺", "癌 x")])
    assert pieces[3:] == list(zip(lk.piece_bytes, lk.piece_logprobs))
    assert [x for _, x in pieces[:3]] == [None] * 3
    out = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "logprobs": 1,
                                               "echo": True}).json()["choices"][0]["logprobs"]
    assert out["tokens"] == ["", "", "肺", "", "", "癌", " x"] and out["text_offset"] == [0, 0, 0, 1, 1, 1, 2]
    assert out["token_logprobs"] == [x for _, x in pieces] and out["top_logprobs"][:3] == [None] * 3


def test_echoed_prompt_alternatives_are_the_next_step_distribution(make_tiny, align_cache):
    """With ``echo``, a prompt piece's ``top_logprobs`` are the ensemble's most likely entries at that
    point: for one member, what generation from the prompt so far shows as its first step."""
    solo = Ensemble([make_tiny("smollm2", seed=5, name="solo")], align_cache=align_cache)
    prompt = "The sky is blue today and"
    scored = solo.score_prompt(prompt, top=3)
    for j in (1, len(scored) - 1):
        context = b"".join(p.bytes for p in scored[:j]).decode()
        (step,) = solo.generate(context, max_new_tokens=1, trace=True, trace_k=3).trace
        assert [t.text for t in scored[j].top] == [t.text for t in step.top]
        assert [t.prob for t in scored[j].top] == pytest.approx([t.prob for t in step.top], abs=1e-5)
    with TestClient(create_app(solo)) as c:
        out = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "logprobs": 3,
                                             "echo": True}).json()["choices"][0]["logprobs"]
    assert out["top_logprobs"][1:] == [{t.text: math.log(t.prob) for t in p.top} for p in scored[1:]]


def test_echo_of_one_member_is_its_own_likelihood(make_tiny, align_cache):
    """One member: the echoed continuation's log-probabilities sum to ``loglikelihood(context, continuation)``
    (for several members the server, seeing one prompt, forces the context piece by piece instead of
    encoding it as each member's prompt, so the two may differ slightly)."""
    solo = Ensemble([make_tiny("smollm2", seed=5, name="solo")], align_cache=align_cache)
    for context, continuation in [("Question: What is 2+2?\nAnswer:", " 4"), ("The sky is", " blue today")]:
        pieces = solo.prompt_logprobs(context + continuation)
        (lk,) = solo.loglikelihood([(context, continuation)])
        tail = pieces[len(pieces) - lk.pieces:]
        assert [b for b, _ in tail] == list(lk.piece_bytes)
        assert sum(x for _, x in tail) == pytest.approx(lk.logprob, abs=1e-4)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
])
def test_completion_errors(client, body, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_chat_errors(client, body, param):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------------------------------- lm-evaluation-harness

MC = [{"question": "What is 2+2?", "choices": ["4", "5", "22"], "gold": 0},
      {"question": "Color of the sky?", "choices": ["green", "blue"], "gold": 1},
      {"question": "Opposite of hot?", "choices": ["cold", "warm"], "gold": 0}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(members, align_cache):
    """``tokenfuse serve`` on two tiny members (uvicorn in a thread, a free loopback port)."""
    import uvicorn

    pair = Ensemble([members[0], members[2]], align_cache=align_cache)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(pair), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield pair, f"http://127.0.0.1:{port}/v1/completions"
    server.should_exit = True
    thread.join(10)


def echo_score(ens: Ensemble, context: str, continuation: str) -> float:
    """The continuation's score as the server gives it for the prompt ``context + continuation``:
    ``Ensemble.loglikelihood`` of the prompt's pieces after its first one, summed (as lm-eval sums)
    over the pieces that start after the context."""
    whole = context + continuation
    codec = ens.space.codecs[ens.primary]
    first = codec.token_bytes[codec.encode_text(whole)[0]].decode()
    (lk,) = ens.loglikelihood([(first, whole[len(first):])])
    total, at = 0, len(first.encode())
    for b, x in zip(lk.piece_bytes, lk.piece_logprobs):
        if at >= len(context.encode()):
            total += x
        at += len(b)
    return total


def test_lm_eval_local_completions(served, tokenizer_dirs, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api] (tenacity)")
    import lm_eval
    from lm_eval.tasks import TaskManager

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    ens, url = served
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in MC), encoding="utf-8")
    (tmp_path / "tf_mc.yaml").write_text(
        f"task: tf_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{gold}}\"\nmetric_list:\n  - metric: acc\n",
        encoding="utf-8")
    model_args = (f"model=tokenfuse,base_url={url},tokenizer_backend=huggingface,tokenizer={tokenizer_dirs['smollm2']},"
                  "tokenized_requests=False,num_concurrent=1,max_retries=1,timeout=120")
    out = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=["tf_mc"],
                                  task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
                                  bootstrap_iters=0)
    samples = out["samples"]["tf_mc"]
    assert len(samples) == len(MC)
    correct = []
    for s in samples:
        doc = s["doc"]
        scores = [resp[0][0] for resp in s["resps"]]
        context = f"Question: {doc['question']}\nAnswer:"
        expected = [echo_score(ens, context, " " + c) for c in doc["choices"]]
        assert scores == expected, (scores, expected)
        correct.append(max(range(len(scores)), key=scores.__getitem__) == doc["gold"])
    assert out["results"]["tf_mc"]["acc,none"] == sum(correct) / len(MC)
