"""The OpenAI-compatible server, in-process (httpx), on tiny random-weight members.

Every generation is compared byte for byte with the engine called directly: served alone,
streamed, batched with concurrent requests, or with per-request ensemble options.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

pytest.importorskip("fastapi", reason="the server extra is not installed (pip install -e '.[server]')")

from fastapi.testclient import TestClient  # noqa: E402

from tokenfuse.engine import Ensemble  # noqa: E402
from tokenfuse.engine.sampling import Sampling  # noqa: E402
from tokenfuse.server import ServerSettings, create_app  # noqa: E402

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "1 + 1 =", "Hello", "import numpy as"]


@pytest.fixture(scope="module")
def app(ens):
    return create_app(ens, settings=ServerSettings(max_tokens=256, max_body_bytes=20_000, max_n=4))


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as c:
        yield c


def sse(text: str) -> list:
    """The data payloads of an SSE body (``[DONE]`` kept as a string)."""
    out = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block or block.startswith(":"):
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_health_and_models(client, ens):
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = client.get("/v1/models")
    body = r.json()
    assert r.status_code == 200 and body["object"] == "list"
    card = body["data"][0]
    assert card["id"] == "tokenfuse" and card["object"] == "model" and {"created", "owned_by"} <= set(card)
    assert [m["name"] for m in card["tokenfuse"]["members"]] == [m.name for m in ens.members]
    assert client.get("/v1/models/tokenfuse").status_code == 200
    assert client.get("/v1/models/other").status_code == 404


def test_completion_matches_engine(client, ens):
    g = ens.generate(PROMPTS[0], max_new_tokens=12)
    r = client.post("/v1/completions", json={"model": "tokenfuse", "prompt": PROMPTS[0], "max_tokens": 12,
                                             "temperature": 0})
    body = r.json()
    assert r.status_code == 200, body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == g.text and choice["index"] == 0
    assert choice["finish_reason"] == ("length" if g.finish_reason == "length" else "stop")
    primary = ens.members[ens.primary]
    assert body["usage"]["prompt_tokens"] == len(primary.encode_prompt(PROMPTS[0]))
    assert body["usage"]["completion_tokens"] == g.steps
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + g.steps
    assert body["tokenfuse"]["ensembled_steps"] == g.ensembled_steps


def test_chat_matches_engine(client, ens):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    g = ens.generate(messages, max_new_tokens=10, chat=True)
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10})
    body = r.json()
    assert r.status_code == 200, body
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": g.text}
    # content given as text parts is the same message
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    r2 = client.post("/v1/chat/completions", json={"messages": parts, "max_completion_tokens": 10})
    assert r2.json()["choices"][0]["message"]["content"] == g.text


def test_stream_completion(client, ens):
    g = ens.generate(PROMPTS[1], max_new_tokens=15)
    r = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 15, "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == g.steps
    assert all(c["usage"] is None for c in chunks[:-1])
    texts = [c["choices"][0]["text"] for c in chunks[:-1]]
    assert "".join(texts) == g.text
    reasons = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert reasons[-1] in ("stop", "length") and all(x is None for x in reasons[:-1])


def test_stream_chat(client, ens):
    messages = [{"role": "user", "content": "Tell me a story."}]
    g = ens.generate(messages, max_new_tokens=12, chat=True)
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "stream": True})
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == g.text
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] is not None


def test_stop_n_and_prompt_lists(client, ens):
    full = ens.generate(PROMPTS[2], max_new_tokens=20).text
    stop = full[5:8]
    g = ens.generate(PROMPTS[2], max_new_tokens=20, stop=[stop])
    r = client.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 20, "stop": stop, "n": 2})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["text"] == g.text and c["finish_reason"] == "stop" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 2 * g.steps
    r = client.post("/v1/completions", json={"prompt": PROMPTS[:2], "max_tokens": 6, "echo": True})
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts == [p + ens.generate(p, max_new_tokens=6).text for p in PROMPTS[:2]]


def test_seeded_sampling(client, ens):
    g = ens.generate(PROMPTS[3], max_new_tokens=10, sampling=Sampling(temperature=0.9, top_p=0.9, seed=7))
    req = {"prompt": PROMPTS[3], "max_tokens": 10, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    a = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    b = client.post("/v1/completions", json={**req, "stream": True}).text
    assert a == g.text
    assert "".join(c["choices"][0]["text"] for c in sse(b)[:-1]) == g.text


def test_tokenfuse_options(client, members, align_cache):
    unite = Ensemble(members, method="unite", params={"k": 5}, align_cache=align_cache)
    g = unite.generate(PROMPTS[4], max_new_tokens=10)
    r = client.post("/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": 10,
                                             "tokenfuse": {"method": "unite", "params": {"k": 5}}})
    assert r.json()["choices"][0]["text"] == g.text
    gated = Ensemble(members, gate="A", threshold=0.3, align_cache=align_cache)
    g = gated.generate(PROMPTS[4], max_new_tokens=10)
    r = client.post("/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": 10,
                                             "tokenfuse": {"gate": "A", "threshold": 0.3}})
    assert r.json()["choices"][0]["text"] == g.text
    assert r.json()["tokenfuse"]["ensembled_steps"] == g.ensembled_steps
    # weights: member C silent equals the ensemble of A and B (C kept in sync only)
    ab = Ensemble(members[:2], align_cache=align_cache)
    r = client.post("/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": 10,
                                             "tokenfuse": {"weights": {"C": 0}}})
    assert r.json()["choices"][0]["text"] == ab.generate(PROMPTS[4], max_new_tokens=10).text


@pytest.mark.parametrize("request_body, status, param", [
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": "x", "n": 5}, 400, "n"),
    ({"prompt": [1, 2, 3]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "x", "tokenfuse": {"method": "nope"}}, 400, "tokenfuse"),
    ({"prompt": "x", "tokenfuse": {"gate": "A"}}, 400, "tokenfuse"),
    ({"prompt": "", "tokenfuse": {"weights": {"\n": None}}}, 400, "tokenfuse.weights.\\n"),
    ({"prompt": "x", "tokenfuse": {"weights": [1, 2]}}, 400, "tokenfuse"),
    ({"prompt": "x", "tokenfuse": {"colour": "red"}}, 400, "tokenfuse.colour"),
    ({"prompt": "x", "tokenfuse": {"params": {"k": 0}, "method": "unite"}}, 400, "tokenfuse"),
    ({"prompt": "x", "tokenfuse": {"parallel": False}}, 400, "tokenfuse.parallel"),
    ({"prompt": "x", "tokenfuse": {"scoring": "piecewise"}}, 400, "tokenfuse.scoring"),
    ({"prompt": "x", "tokenfuse": {"speculative": {"k": 0}}}, 400, "tokenfuse.speculative.k"),
    ({"prompt": "x", "tokenfuse": {"speculative": {"draft": "Z"}}}, 400, "tokenfuse"),
    ({"prompt": "x " * 2100, "max_tokens": 8}, 400, "prompt"),
    ({"prompt": "x " * 2100, "max_tokens": 8, "stream": True}, 400, "prompt"),
])
def test_errors(client, request_body, status, param):
    r = client.post("/v1/completions", json=request_body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and "\n" not in err["message"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


def test_scoring_and_speculative_per_request(client, ens, members, align_cache):
    """``scoring`` and ``speculative`` are per-request options too (built from the options' declarations);
    ``parallel`` is the server's own and refused by name."""
    spec = Ensemble(members, align_cache=align_cache, speculative={"draft": "C", "k": 2})
    g = spec.generate(PROMPTS[2], max_new_tokens=8)
    r = client.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 8,
                                             "tokenfuse": {"speculative": {"draft": "C", "k": 2}}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == g.text == ens.generate(PROMPTS[2], max_new_tokens=8).text
    r = client.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 4, "tokenfuse": {"speculative": True}})
    assert r.status_code == 200, r.text
    stepwise = Ensemble(members, align_cache=align_cache, scoring="stepwise").score_prompt(PROMPTS[1], top=2)
    r = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 0, "echo": True, "logprobs": 2,
                                             "tokenfuse": {"scoring": "stepwise"}})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert got[1:] == pytest.approx([p.logprob for p in stepwise][1:], abs=1e-4)
    r = client.post("/v1/completions", json={"prompt": "x", "tokenfuse": {"parallel": False}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "tokenfuse.parallel: parallel: not taken by the server's per-request options")


def test_error_shapes(client):
    r = client.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post("/v1/completions", json={"prompt": "x" * 30_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x " * 2100}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert client.get("/v1/nothing").status_code == 404
    assert client.get("/v1/completions").status_code == 405
    assert "error" in client.get("/v1/completions").json()


def test_api_key(ens):
    app = create_app(ens, settings=ServerSettings(api_key="sekrit"))
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200


def test_truncation(ens):
    app = create_app(ens, settings=ServerSettings(truncate_prompt=True))
    long = "word " * 2100 + "The end."
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": long, "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["tokenfuse"]["truncated"]
        assert r.json()["usage"]["prompt_tokens"] + 4 <= 2048


async def _concurrent(app, requests: list[dict]) -> list[dict]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
        async def one(req):
            r = await c.post("/v1/completions", json=req)
            assert r.status_code == 200, r.text
            if req.get("stream"):
                return "".join(x["choices"][0]["text"] for x in sse(r.text)[:-1] if x["choices"])
            return r.json()["choices"][0]["text"]

        return await asyncio.gather(*(one(r) for r in requests))


def test_concurrent_requests_identical_to_sequential(ens, members, align_cache):
    """Requests with different lengths, options and sampling share steps; each greedy answer is
    the one the same request gets alone."""
    app = create_app(ens)
    requests = [{"prompt": p, "max_tokens": 6 + 3 * i, "stream": i % 2 == 1} for i, p in enumerate(PROMPTS)]
    requests.append({"prompt": PROMPTS[0], "max_tokens": 9, "tokenfuse": {"method": "unite"}})
    requests.append({"prompt": PROMPTS[1], "max_tokens": 9, "temperature": 0.7, "seed": 3})
    unite = Ensemble(members, method="unite", align_cache=align_cache)
    expected = [ens.generate(r["prompt"], max_new_tokens=r["max_tokens"]).text for r in requests[:-2]]
    expected.append(unite.generate(PROMPTS[0], max_new_tokens=9).text)
    expected.append(ens.generate(PROMPTS[1], max_new_tokens=9, sampling=Sampling(temperature=0.7, seed=3)).text)
    sched = app.state.scheduler
    got = asyncio.run(_concurrent(app, requests))
    assert got == expected
    solo_steps = sum(r["max_tokens"] for r in requests)
    assert sched.steps < solo_steps  # the requests did share steps
    assert sched.active == 0
    sched.stop()


def test_a_speculative_ensemble_serves_plain_decodings(ens, members, align_cache):
    """A server on a speculative ensemble: several pieces per step for greedy requests (streamed or
    not, concurrent), the same texts as plain decoding; a sampled request shares the steps."""
    spec = Ensemble(members, align_cache=align_cache, speculative={"draft": "C", "k": 3})
    app = create_app(spec)
    assert app.state.server.config.speculative.draft == "C"
    requests = [{"prompt": p, "max_tokens": 5 + 4 * i, "stream": i % 2 == 0} for i, p in enumerate(PROMPTS[:4])]
    requests.append({"prompt": PROMPTS[1], "max_tokens": 9, "temperature": 0.7, "seed": 3})
    expected = [ens.generate(r["prompt"], max_new_tokens=r["max_tokens"]).text for r in requests[:-1]]
    expected.append(ens.generate(PROMPTS[1], max_new_tokens=9, sampling=Sampling(temperature=0.7, seed=3)).text)
    assert asyncio.run(_concurrent(app, requests)) == expected
    app.state.scheduler.stop()


def _scope(payload: bytes) -> dict:
    """The ASGI scope of ``POST /v1/completions`` with a JSON body."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json"),
                                         (b"content-length", str(len(payload)).encode())],
            "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 80)}


def _asgi_stream(app, body: dict, *, disconnect_after: int) -> tuple[list[bytes], float]:
    """Call the ASGI app directly; the client disconnects after ``disconnect_after`` body chunks.
    Returns the chunks received and the time of the disconnect."""
    sent: list[bytes] = []
    gone = {}

    async def run():
        payload = json.dumps(body).encode()
        got_body = asyncio.Event()
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await got_body.wait()
            gone["t"] = time.perf_counter()
            return {"type": "http.disconnect"}

        async def send(msg):
            if msg["type"] == "http.response.body" and msg.get("body"):
                sent.append(msg["body"])
                if len(sent) >= disconnect_after:
                    got_body.set()

        await asyncio.wait_for(app(_scope(payload), receive, send), 60)

    asyncio.run(run())
    return sent, gone.get("t", 0.0)


def test_disconnect_stops_the_sequence(ens, members):
    """A streaming client that goes away: its sequence is closed (caches freed) within a step or two,
    long before max_tokens."""
    app = create_app(ens)
    sched = app.state.scheduler
    released = []
    orig = members[0].release

    def spy(state):
        released.append(state)
        return orig(state)

    members[0].release = spy
    try:
        chunks, _ = _asgi_stream(app, {"prompt": PROMPTS[5], "max_tokens": 200, "stream": True}, disconnect_after=3)
        deadline = time.time() + 10
        # the scheduler thread releases the caches, then counts the sequence closed: wait for both
        while (sched.active or not released or not sched.closed) and time.time() < deadline:
            time.sleep(0.01)
    finally:
        del members[0].release
    assert sched.active == 0 and sched.closed == 1 and released
    assert released[0].cache is None  # the member's cache for that sequence is freed
    assert 2 <= sched.steps < 20  # it stopped far before 200 steps
    assert not any(b"[DONE]" in c for c in chunks)
    sched.stop()


def test_disconnect_non_streaming(ens):
    app = create_app(ens)
    sched = app.state.scheduler

    async def run():
        payload = json.dumps({"prompt": PROMPTS[0], "max_tokens": 2000}).encode()
        delivered = False
        left = asyncio.Event()
        asyncio.get_running_loop().call_later(0.3, left.set)  # the client leaves after 0.3 s

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            pass

        await asyncio.wait_for(app(_scope(payload), receive, send), 60)

    asyncio.run(run())
    deadline = time.time() + 10
    while (sched.active or not sched.closed) and time.time() < deadline:  # counted closed after release
        time.sleep(0.01)
    assert sched.active == 0 and sched.closed == 1 and sched.steps < 2000  # cancelled, not finished
    sched.stop()
