"""Remote members (``backend: openai``): a mock server for the protocol details, and a real
third-party server (llama-cpp-python's ``python -m llama_cpp.server``) on a bundled GGUF."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from tokenfuse.config import parse_config
from tokenfuse.engine import Ensemble
from tokenfuse.errors import ConfigError, MemberUnavailableError, TokenfuseError
from tokenfuse.members.fasttok import FastTokenizer
from tokenfuse.members.remote import RemoteMember


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def smol_tok(tokenizer_dirs):
    return FastTokenizer(tokenizer_dirs["smollm2"])


def mock_member(smol_tok, align_cache, handler, **kw) -> RemoteMember:
    client = httpx.Client(transport=httpx.MockTransport(handler))
    return RemoteMember("r", smol_tok, base_url="http://mock/v1", model="m", client=client,
                        align_cache=align_cache, **kw)


def test_token_id_answers_and_floor(smol_tok, align_cache):
    seen = []

    def handler(request):
        body = json.loads(request.content)
        seen.append(body)
        top = {"token_id:5": -0.5, "token_id:7": -2.5, "token_id:9": -3.0}
        return httpx.Response(200, json={"choices": [{"text": "x", "logprobs": {"top_logprobs": [top]}}]})

    m = mock_member(smol_tok, align_cache, handler, top_k=3)
    st = m.new_state(m.encode_prompt("Hello"))
    lp, ids = m.next_topk([st], 3)
    assert ids.tolist() == [[5, 7, 9]] and torch.allclose(lp, torch.tensor([[-0.5, -2.5, -3.0]]))
    assert seen[0]["prompt"] == st.all_ids()  # token ids first (prompt_format auto)
    assert seen[0]["max_tokens"] == 1 and seen[0]["temperature"] == 0 and seen[0]["logprobs"] == 3
    assert set(seen[0]["logit_bias"]) == {str(i) for i in m.codec.end_ids}
    # ids outside the top-k share the remaining mass evenly, below the k-th
    other = m.token_logprobs([st], torch.tensor([[5, 1000]]))
    rest = 1 - sum(torch.tensor([-0.5, -2.5, -3.0]).exp().tolist())
    assert other[0, 0] == pytest.approx(-0.5)
    assert other[0, 1] == pytest.approx(float(torch.tensor(rest / (m.vocab_size - 3)).log()), rel=1e-5)
    m.next_topk([st], 3)
    assert len(seen) == 1  # same ids: no new request


def test_text_fallback_and_string_keys(smol_tok, align_cache):
    seen = []
    paris = smol_tok("Paris", add_special_tokens=False)["input_ids"]
    assert len(paris) == 1

    def handler(request):
        body = json.loads(request.content)
        seen.append(body)
        if isinstance(body["prompt"], list):
            return httpx.Response(400, json={"error": {"message": "prompt must be a string"}})
        top = {"Paris": -0.2, "": -2.0}
        return httpx.Response(200, json={"choices": [{"text": "Paris", "logprobs": {"top_logprobs": [top]}}]})

    m = mock_member(smol_tok, align_cache, handler)
    st = m.new_state(m.encode_prompt("The capital of France is "))
    lp, ids = m.next_topk([st], 2)
    assert seen[-1]["prompt"] == "The capital of France is " and m.prompt_format == "text"
    assert ids[0, 0] == paris[0] and ids[0, 1] == min(m.codec.end_ids)  # "" is END
    m.next_topk([m.new_state(m.encode_prompt("x"))], 2)
    assert isinstance(seen[-1]["prompt"], str)  # text from now on, no second try with ids


def test_unreachable_server_is_a_clear_error(smol_tok, align_cache):
    m = RemoteMember("down", smol_tok, base_url=f"http://127.0.0.1:{free_port()}/v1", model="m", retries=1,
                     timeout=2, align_cache=align_cache)
    st = m.new_state(m.encode_prompt("Hello"))
    with pytest.raises(MemberUnavailableError, match="'down' is unavailable.*ConnectError.*2 attempts"):
        m.next_topk([st], 5)
    t = time.perf_counter()
    with pytest.raises(MemberUnavailableError, match="cool-down"):  # fails fast for a while
        m.next_topk([st], 5)
    assert time.perf_counter() - t < 0.1


def test_config_validation():
    ok = parse_config({"members": [{"name": "a", "backend": "openai", "base_url": "http://127.0.0.1:1/v1"}],
                       "method": "unite"})
    assert ok.members[0].backend == "openai"
    with pytest.raises(ConfigError, match="base_url"):
        parse_config({"members": [{"name": "a", "backend": "openai"}], "method": "unite"})
    with pytest.raises(ConfigError, match="only top-k.*topk_fill"):
        parse_config({"members": [{"name": "a", "backend": "openai", "base_url": "http://x/v1"}]})
    with pytest.raises(ConfigError, match="base_url: only for `backend: openai`"):
        parse_config({"members": [{"name": "a", "base_url": "http://x/v1"}]})
    parse_config({"members": [{"name": "a", "backend": "openai", "base_url": "http://x/v1", "topk_fill": "uniform"}]})


def test_member_failure_in_server(make_tiny, smol_tok, align_cache, one_thread):
    """A dead remote member: `error` gives a 503 with the member's name; `skip` answers without it
    (same text as with its weight at 0) and says so."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from tokenfuse.server import ServerSettings, create_app

    a = make_tiny("qwen", seed=1, name="A")
    url = f"http://127.0.0.1:{free_port()}/v1"
    dead = RemoteMember("dead", smol_tok, base_url=url, model="m", retries=0, timeout=2, align_cache=align_cache)
    ens = Ensemble([a, dead], method="unite", align_cache=align_cache)
    silent = Ensemble([a, RemoteMember("dead", smol_tok, base_url=url, model="m", weight=0, align_cache=align_cache)],
                      method="unite", union=ens.union)
    expected = silent.generate("Hello", max_new_tokens=6).text
    req = {"prompt": "Hello", "max_tokens": 6}
    with TestClient(create_app(ens)) as c:
        r = c.post("/v1/completions", json=req)
        assert r.status_code == 503 and r.json()["error"]["code"] == "member_unavailable"
        assert "'dead'" in r.json()["error"]["message"]
    with TestClient(create_app(ens, settings=ServerSettings(on_member_failure="skip"))) as c:
        for stream in (False, True):
            r = c.post("/v1/completions", json={**req, "stream": stream, "stream_options": {"include_usage": True}})
            assert r.status_code == 200, r.text
            if stream:
                chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
                text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
                summary = chunks[-1]["tokenfuse"]
            else:
                text, summary = r.json()["choices"][0]["text"], r.json()["tokenfuse"]
            assert text == expected and summary["unavailable_members"] == ["dead"]


# ---------------------------------------------------------------------------- a real server

def _server_deps() -> list[str]:
    mods = ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")
    return [m for m in mods if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    """llama-cpp-python's OpenAI-compatible server on SmolLM2's bundled GGUF, on a free local port.

    A small context: with ``logprobs`` that server log-softmaxes its whole ``n_ctx x vocab`` logits
    buffer on every request, so the request time grows with ``n_ctx``."""
    missing = _server_deps()
    if missing:
        pytest.skip(f"llama_cpp.server needs {', '.join(missing)} (scripts/setup.sh installs them)")
    from tokenfuse.bundled import BUNDLED
    from tokenfuse.paths import cache_dir

    gguf = BUNDLED["smollm2-135m-instruct"].gguf_path(cache_dir())
    port = free_port()
    log = (tmp_path_factory.mktemp("llama-server") / "log.txt").open("wb")  # a pipe would fill up and block it
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
         "--n_ctx", "512", "--n_threads", "1", "--model_alias", "smol"],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama_cpp.server exited: {open(log.name, 'rb').read().decode()[-2000:]}")
            try:
                if httpx.get(f"{base}/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail("llama_cpp.server did not start within 90 s")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.mark.real
def test_llama_cpp_server_member(llama_server, llamacpp_members, align_cache):
    """The remote member's top-k equals the same GGUF run in-process; a UniTE ensemble of the remote
    SmolLM2 and a local Gemma gives the text of the all-local ensemble."""
    from tokenfuse.config import MemberConfig
    from tokenfuse.load import load_member

    remote = load_member(MemberConfig(name="smol", backend="openai", base_url=llama_server, model="smol", n_ctx=512,
                                      tokenizer="smollm2-135m-instruct"), progress=False)
    local = llamacpp_members["smollm2"]
    for prompt in ("The capital of France is", "def fib(n):"):
        sr, sl = remote.new_state(remote.encode_prompt(prompt)), local.new_state(local.encode_prompt(prompt))
        (lr, ir), (ll, il) = remote.next_topk([sr], 10), local.next_topk([sl], 10)
        assert ir.tolist() == il.tolist()
        assert torch.allclose(lr, ll, atol=1e-3)
        local.release(sl)
    assert remote.prompt_format == "text"  # llama-cpp-python's server takes strings only
    gemma = llamacpp_members["gemma3"]
    both_local = Ensemble([local, gemma], method="unite", align_cache=align_cache)
    mixed = Ensemble([remote, gemma], method="unite", align_cache=align_cache)
    prompt = "Question: What is 2+2?\nAnswer:"
    t = time.perf_counter()
    expected = both_local.generate(prompt, max_new_tokens=6).text
    t_local = time.perf_counter() - t
    t = time.perf_counter()
    assert mixed.generate(prompt, max_new_tokens=6).text == expected
    print(f"6 pieces: local {t_local:.2f} s, with the remote member {time.perf_counter() - t:.2f} s")


def test_member_contract_of_a_remote_and_a_local_member(make_tiny, smol_tok, align_cache):
    """What other layers ask of every member: context length, chat template, default weight, input
    embeddings (a score is the ensemble's, never a member's)."""

    def handler(request):
        raise AssertionError("no request expected")

    remote = mock_member(smol_tok, align_cache, handler, context_length=512)
    local = make_tiny("smollm2", seed=3)
    assert (remote.context_length, local.context_length) == (512, 2048)  # tiny model: max_position_embeddings
    assert mock_member(smol_tok, align_cache, handler).context_length is None
    assert remote.has_chat_template and local.has_chat_template  # SmolLM2-Instruct's tokenizer has one
    assert remote.weight == local.weight == 1.0 and not hasattr(remote, "score") and not hasattr(local, "score")
    e = local.input_embeddings()
    assert e.dtype == torch.float32 and tuple(e.shape) == (len(local.tokenizer), 32)
    assert e.data_ptr() == local.model.get_input_embeddings().weight.data_ptr()  # the model's own table
    with pytest.raises(TokenfuseError, match="'r' .*DeePEn needs local weights"):
        remote.input_embeddings()
    assert not hasattr(remote, "_forward") and not hasattr(remote, "_forward_batch")


def test_ensemble_from_members_takes_the_config_weights_and_scores(make_tiny, one_thread):
    from tokenfuse.load import ensemble_from_members

    a, b = make_tiny("smollm2", seed=4, name="a"), make_tiny("qwen", seed=4, name="b")
    cfg = parse_config({"members": [{"name": "a", "source": "smollm2-135m-instruct", "score": 0.75},
                                    {"name": "b", "source": "qwen2.5-coder-0.5b-instruct"}]})
    ens = ensemble_from_members(cfg, [a, b])
    assert ens.scores == [0.75, None] and ens.weights == [1.0, 1.0] and ens.describe()["primary"] == "a"
    assert not hasattr(a, "score") and not hasattr(b, "score")  # the members are not written
