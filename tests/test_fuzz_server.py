"""Bad input to the server: validation errors answer 400 in OpenAI's error shape, and both
generation endpoints are fuzzed from the server's own OpenAPI schema (schemathesis, in-process
ASGI) on tiny random-weight members: every answer is a 2xx or a 4xx OpenAI error, never a 5xx,
never a hang."""

from __future__ import annotations

import json
import signal
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi", reason="the server extra is not installed (pip install -e '.[server]')")
schemathesis = pytest.importorskip("schemathesis", reason="the test extra is not installed (pip install -e '.[test]')")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, event, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance  # noqa: E402

from tokenfuse.engine import Ensemble  # noqa: E402
from tokenfuse.server import ServerSettings, create_app  # noqa: E402
from tokenfuse.server.ensembles import config_of  # noqa: E402
from tokenfuse.server.errors import VALIDATION_CODES  # noqa: E402

# Generations stay tiny: 2 pieces by default, at most 3 on request (more is a 400), short prompts.
SETTINGS = ServerSettings(max_tokens=3, max_prompt_chars=300, max_n=2, max_body_bytes=20_000)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def app(make_tiny, one_thread, align_cache):
    ens = Ensemble([make_tiny("smollm2", seed=0, name="A"), make_tiny("gemma3", seed=2, name="C")],
                   align_cache=align_cache)
    cfg = config_of(ens).with_overrides(decoding={"max_new_tokens": 2})
    app = create_app(ens, config=cfg, settings=SETTINGS)
    yield app
    app.state.scheduler.stop()


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as c:
        yield c


def error_of(r) -> dict:
    """The OpenAI error object of a 4xx answer, checked for its exact keys and types."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] is None or isinstance(err["param"], str)
    assert isinstance(err["code"], str) and err["code"]
    return err


@contextmanager
def within(seconds: float):
    """Fail (instead of hanging) when the block runs longer than ``seconds``."""
    def expire(*_):
        raise TimeoutError(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def stream_ok(text: str) -> None:
    """A 200 stream: JSON chunks, none of them an error event (a failure hidden behind the 200), then ``[DONE]``."""
    data = [block.strip().removeprefix("data: ") for block in text.split("\n\n")
            if block.strip() and not block.strip().startswith(":")]
    assert data and data[-1] == "[DONE]", text
    for chunk in data[:-1]:
        assert "error" not in json.loads(chunk), chunk


# ---------------------------------------------------------------------------------------- 400, param, code
@pytest.mark.parametrize("path, body, param, code", [
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens", "invalid_value"),
    ("/v1/completions", {"max_tokens": 1}, "prompt", "missing"),
    ("/v1/completions", {"prompt": 5}, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, "stop.0", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": "maybe"}},
     "stream_options.include_usage", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "tokenfuse": {"colour": "red"}}, "tokenfuse.colour", "unknown_parameter"),
    ("/v1/completions", {"prompt": "x", "tokenfuse": {"weights": {"A": "heavy"}}}, "tokenfuse.weights.A",
     "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0.content", "missing"),
    ("/v1/chat/completions", {"messages": [{"role": "system"}]}, "messages.0.content", "missing"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": None}]},
     "messages.1.content", "missing"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "messages.0.content", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": "a"}]}]},
     "messages.0.content.0.type", "missing"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "a"}]}, "messages.0.role", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"content": "a"}]}, "messages.0.role", "missing"),
    ("/v1/chat/completions", {"messages": []}, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": -1},
     "max_completion_tokens", "invalid_value"),
])
def test_validation_errors_are_400_with_param_and_code(client, path, body, param, code):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"]) == (param, code), err
    assert err["message"].startswith(f"{param}: ")
    assert code in VALIDATION_CODES


def test_assistant_message_may_go_without_content(client):
    r = client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "ok"}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw, code", [
    (b'{"prompt": "x",', "invalid_json"),
    (b"[1, 2]", "invalid_json"),
    (b'"x"', "invalid_json"),
    (b"null", "missing"),
    (b"", "missing"),
    (b"\xff\xfe", "invalid_json"),
])
def test_a_body_that_is_not_a_json_object_is_400(client, raw, code):
    for path in ENDPOINTS:
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = error_of(r)
        assert (err["param"], err["code"]) == (None, code), err


def test_openapi_documents_400_not_422(app):
    spec = app.openapi()
    for path in ENDPOINTS:
        responses = spec["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "4XX"}
        schema = responses["4XX"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/ErrorResponse"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("prompt", ["", "Hi", [""], ["", "Hi"]])
@pytest.mark.parametrize("n", [1, 2])
def test_every_combination_of_the_switches(client, stream, echo, prompt, n):
    """The corners random bodies reach rarely: stream x echo x prompt lists x n (2 x 2 prompts is a 400)."""
    body = {"prompt": prompt, "n": n, "echo": echo, "stream": stream, "max_tokens": 2,
            "stream_options": {"include_usage": True} if stream else None}
    with within(20):
        r = client.post("/v1/completions", json=body)
    prompts = 1 if isinstance(prompt, str) else len(prompt)
    if prompts * n > SETTINGS.max_n:
        assert error_of(r)["param"] == "n"
        return
    assert r.status_code == 200, r.text
    if stream:
        stream_ok(r.text)
    else:
        assert len(r.json()["choices"]) == prompts * n


# ---------------------------------------------------------------------------------------- fuzzing
@pytest.fixture(scope="module")
def api(app):
    return schemathesis.openapi.from_asgi("/openapi.json", app)


FUZZ = settings(max_examples=100, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])


# Fields a random schema-valid body nearly always sets to a value this server refuses by design
# (penalties, logit_bias, tools, another model, more tokens or choices than its limits).
REFUSED = ("model", "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "logprobs", "top_logprobs",
           "best_of", "suffix", "tools", "tool_choice", "response_format", "max_completion_tokens", "n")


def servable(case):
    """A schema-valid case without the refused fields, with ``max_tokens`` within the limit, text
    prompts only (at most ``max_n``) and content in every non-assistant message, so that the fuzz
    reaches generation with random prompts, messages, sampling, stops and options."""
    body = case.body
    if not isinstance(body, dict):
        return case
    for key in REFUSED:
        body.pop(key, None)
    if isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = 1 + body["max_tokens"] % SETTINGS.max_tokens
    if isinstance(body.get("prompt"), list):
        texts = [p for p in body["prompt"] if isinstance(p, str)][:SETTINGS.max_n]
        body["prompt"] = texts or str(body["prompt"])[:40]
    for m in body.get("messages") or []:
        if isinstance(m, dict) and m.get("content") is None and m.get("role") != "assistant":
            m["content"] = ""
    return case


@pytest.mark.parametrize("mode", ["positive", "servable", "negative"])
@pytest.mark.parametrize("path", ENDPOINTS)
def test_fuzzed_requests_get_2xx_or_an_openai_4xx(api, path, mode):
    operation = api[path]["POST"]
    if mode == "negative":
        strategy = operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)
    else:
        strategy = operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
        strategy = strategy.map(servable) if mode == "servable" else strategy
    seen: dict[int, int] = {}

    @FUZZ
    @given(case=strategy)
    def run(case):
        note(f"body: {case.body!r}; media type: {case.media_type}")
        with within(20):
            r = case.call()
        note(f"answer: {r.status_code} {r.text[:300]!r}")
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        event(f"status {r.status_code}")
        case.validate_response(r, checks=[not_a_server_error, status_code_conformance, response_schema_conformance])
        if r.status_code >= 400:
            error_of(r)
        elif any("text/event-stream" in v for v in r.headers.get("content-type", [])):  # lowercase keys, lists
            stream_ok(r.text)
        else:
            assert r.json()["object"] == ("chat.completion" if "chat" in path else "text_completion")

    run()
    assert all(200 <= s < 500 for s in seen), seen
    if mode == "servable":
        assert seen.get(200, 0) >= 10, seen  # the fuzz reached generation, not only refusals
    else:
        assert seen.get(400, 0) > 0, seen


@FUZZ
@given(body=st.dictionaries(st.sampled_from(["prompt", "messages", "max_tokens", "n", "stop", "temperature",
                                              "top_p", "top_k", "seed", "stream", "tokenfuse", "logprobs"]),
                            st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                                         lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                            max_size=3),
                                         max_leaves=6), max_size=5),
       path=st.sampled_from(ENDPOINTS))
def test_arbitrary_json_fields_never_a_5xx(client, body, path):
    """Any JSON value in any known field (the schema's types mixed up; NaN and Infinity too, which
    Python's JSON parser accepts)."""
    with within(20):
        r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    if r.status_code >= 400:
        error_of(r)
    elif body.get("stream") is True:
        assert r.status_code == 200, r.text
        stream_ok(r.text)
    else:
        assert r.status_code == 200 and r.json()["choices"], r.text
