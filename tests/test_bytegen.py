"""The ``byte`` method (engine/bytegen.py, combiners/bytemix.py): exact choices against an independent
computation from ``score_bytes``, whole UTF-8 characters, stops, the trace, the CLI and the server, on
tiny random-weight members with the real tokenizers."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from tokenfuse.alignment.byteview import TokenBytes, score_bytes
from tokenfuse.combiners import get_combiner
from tokenfuse.combiners.bytemix import ByteParams
from tokenfuse.engine import Ensemble
from tokenfuse.engine.bytegen import choose, inverse_cdf, utf8_allowed
from tokenfuse.engine.prompt import prompt_ids
from tokenfuse.engine.sampling import Sampling, sampled_probs
from tokenfuse.engine.sync import incomplete_tail
from tokenfuse.engine.text_features import Rows
from tokenfuse.errors import ConfigError

PROMPT = "Hello"
PROBES = [0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF]  # continuation bytes enough to complete any valid prefix


def completable(out: bytes, room: int) -> bool:
    """``out`` can still become whole UTF-8 text within ``room`` more bytes (by brute force)."""
    for n in range(min(room, 3) + 1):
        for tail in itertools.product(PROBES, repeat=n):
            try:
                (out + bytes(tail)).decode("utf-8")
                return True
            except UnicodeDecodeError:
                pass
    return False


@pytest.fixture(scope="module")
def pair(make_tiny, one_thread):
    return [make_tiny("smollm2", seed=3, name="A", weight=1.0), make_tiny("qwen", seed=4, name="B", weight=2.0)]


@pytest.fixture(scope="module")
def byte_ens(pair, align_cache):
    return Ensemble(pair, method="byte", align_cache=align_cache)


class Reference:
    """Each member's next-symbol distribution recomputed from scratch with ``score_bytes`` (its rows read
    from a fresh state each and kept), and the masked mixture — the byte method's definition, computed
    without ``ByteState``."""

    def __init__(self, members, prompt: str, **prune) -> None:
        defaults = ByteParams().model_dump(exclude={"mix"})  # the byte method's views, unless given
        self.members, self.prune = members, defaults | prune
        self.rows = [Rows.from_member(m, prompt_ids(m, prompt)) for m in members]
        self.tokens = [TokenBytes(m.codec.token_bytes) for m in members]
        self.memo: dict = {}

    def _take(self, k):
        def take(lists, ids):
            out = []
            for lst, x in zip(lists, ids):
                key = (k, tuple(lst))
                if key not in self.memo:
                    self.memo[key] = self.rows[k].fn([lst])[0].numpy().astype(np.float64)
                out.append(self.memo[key][np.asarray(x, dtype=np.int64)])
            return out
        return take

    def member(self, k: int, out: bytes) -> np.ndarray:
        rows, tokens, take = self.rows[k], self.tokens[k], self._take(k)
        q = np.empty(257)
        for b in range(256):
            q[b] = np.exp(score_bytes(out + bytes([b]), tokens, rows.start, take, **self.prune).logprobs[-1])
        q[256] = np.exp(score_bytes(out, tokens, rows.start, take, end=True, **self.prune).end)
        return q

    def mixture(self, out: bytes, room: int) -> np.ndarray:
        w = np.array([m.weight for m in self.members]) / sum(m.weight for m in self.members)
        q = sum(wk * self.member(k, out) for k, wk in enumerate(w))
        ok = np.array([completable(out + bytes([b]), room - 1) for b in range(256)] + [completable(out, 0)])
        q = np.where(ok, q, 0.0)
        return q / q.sum()


# ---------------------------------------------------------------------------------------- the pieces
@settings(max_examples=200, deadline=None)
@given(text=hs.text(max_size=3), cut=hs.integers(0, 3), extra=hs.integers(1, 5))
def test_property_the_mask_is_what_keeps_utf8_whole(text, cut, extra):
    """After any valid prefix of UTF-8 text (with room left for its unfinished character, as generation
    leaves), a byte is allowed exactly when the output can still be completed to whole text within the
    bytes left, and the end exactly when the text is whole."""
    data = text.encode("utf-8")
    out = data[:max(0, len(data) - cut)]
    tail = out[len(out) - incomplete_tail(out):]
    room = (1 + (tail[0] >= 0xE0) + (tail[0] >= 0xF0) - len(tail) + extra) if tail else extra
    ok = utf8_allowed(tail, room)
    want = [completable(out + bytes([b]), room - 1) for b in range(256)] + [completable(out, 0)]
    assert ok.tolist() == want


@settings(max_examples=200, deadline=None)
@given(p=hs.lists(hs.floats(0, 1), min_size=1, max_size=9).filter(lambda p: sum(p) > 0), u=hs.floats(0, 1, exclude_max=True))
def test_property_inverse_cdf(p, u):
    p = np.array(p)
    k = inverse_cdf(p, u)
    c = np.cumsum(p)
    assert p[k] > 0
    assert k == min(int(np.flatnonzero(c > u * c[-1])[0]) if (c > u * c[-1]).any() else len(p), int(np.flatnonzero(p)[-1]))


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0, seed=0), Sampling(temperature=0.7, top_p=0.8, seed=1),
                                      Sampling(temperature=1.3, top_k=5, seed=2)])
def test_a_draw_is_the_inverse_cdf_of_the_shaped_mixture_at_the_generators_uniform(sampling):
    rng = np.random.default_rng(0)
    for _ in range(20):
        q = rng.dirichlet(np.full(257, 0.1))
        a = torch.Generator().manual_seed(sampling.seed)
        b = torch.Generator().manual_seed(sampling.seed)
        for _ in range(5):
            u = float(torch.rand((), generator=b, dtype=torch.float64))
            assert choose(q, sampling, a) == inverse_cdf(sampled_probs(torch.from_numpy(q), sampling).numpy(), u)


def test_greedy_is_the_argmax():
    q = np.zeros(257)
    q[[7, 9, 256]] = [0.3, 0.4, 0.3]
    assert choose(q, Sampling(), None) == 9


def test_mixture_and_product():
    lp = [np.log(np.full(257, 1 / 257)), np.log(np.r_[np.full(256, 0.5 / 256), 0.5])]
    mix = get_combiner("byte").mix(lp, [1.0, 3.0])
    assert np.isclose(mix[256], 0.25 / 257 + 0.75 * 0.5) and np.isclose(mix.sum(), 1.0)
    prod = get_combiner("byte", mix="product").mix(lp, [1.0, 1.0])
    want = np.sqrt(np.exp(lp[0]) * np.exp(lp[1]))
    np.testing.assert_allclose(prod, want / want.sum(), rtol=1e-12)
    assert np.array_equal(get_combiner("byte").mix(lp, [0.0, 1.0]), np.exp(lp[1]) / np.exp(lp[1]).sum())


# ---------------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("reserve", [True, False])
def test_greedy_is_the_argmax_chain_of_the_mixture(pair, align_cache, reserve):
    """Greedy ``byte`` output equals the argmax chain of an independent computation of the masked
    mixture (every member's 257 numbers from ``score_bytes`` of the output and each next byte), under
    either rule for the pruned mass."""
    n = 6
    ens = Ensemble(pair, method="byte", params={"reserve": reserve}, align_cache=align_cache)
    g = ens.generate(PROMPT, max_new_tokens=n)
    ref, out = Reference(pair, PROMPT, reserve=reserve), b""
    for step in range(n):
        q = ref.mixture(out, n - step)
        b = int(np.argmax(q))
        if b == 256:
            break
        out += bytes([b])
    assert g.output == out
    assert g.steps == len(out) and g.output.decode("utf-8") == g.text


def test_sampling_is_exactly_the_mixture(byte_ens, pair):
    """Seeded sampling at temperature 1: each byte is the inverse CDF of the independently computed
    masked mixture at the sequence generator's next uniform."""
    n, seed = 5, 11
    g = byte_ens.generate(PROMPT, max_new_tokens=n, sampling=Sampling(temperature=1.0, seed=seed))
    ref, out = Reference(pair, PROMPT), b""
    gen = torch.Generator().manual_seed(seed)
    for step in range(n):
        q = ref.mixture(out, n - step)
        b = inverse_cdf(q, float(torch.rand((), generator=gen, dtype=torch.float64)))
        if b == 256:
            break
        out += bytes([b])
    assert g.output == out


@pytest.mark.parametrize("seed", range(6))
def test_the_output_is_whole_utf8_and_the_limit_counts_bytes(byte_ens, seed):
    sp = Sampling(temperature=1.5, seed=seed)
    g = byte_ens.generate(PROMPT, max_new_tokens=7, sampling=sp)
    assert g.output.decode("utf-8") == g.text and len(g.output) <= 7 and g.steps == len(g.output)
    assert g.finish_reason in ("length", "end")
    pieces = list(byte_ens.stream(PROMPT, max_new_tokens=7, sampling=sp))
    assert "".join(pieces) == g.text and all(p.encode("utf-8") for p in pieces)


def test_a_batch_is_its_sequences_alone(byte_ens):
    sp = [Sampling(), Sampling(temperature=1.0, seed=5)]
    both = byte_ens.generate([PROMPT, "def f(x):"], max_new_tokens=6, sampling=sp)
    assert [g.output for g in both] == [byte_ens.generate(p, max_new_tokens=6, sampling=s).output
                                        for p, s in zip([PROMPT, "def f(x):"], sp)]


def test_stop_strings_are_trimmed(byte_ens):
    full = byte_ens.generate(PROMPT, max_new_tokens=12)
    assert len(full.text) >= 3
    stop = full.text[2:4]
    g = byte_ens.generate(PROMPT, max_new_tokens=12, stop=[stop])
    assert g.finish_reason == "stop" and g.text == full.text[:full.text.index(stop)] and stop not in g.text
    assert "".join(byte_ens.stream(PROMPT, max_new_tokens=12, stop=[stop])) == g.text


def test_the_trace_has_a_step_per_byte(byte_ens):
    g = byte_ens.generate(PROMPT, max_new_tokens=6, trace=True, trace_k=3)
    plain = byte_ens.generate(PROMPT, max_new_tokens=6)
    assert g.output == plain.output and "".join(s.text for s in g.trace) == g.text
    assert all(len(s.raw) == 1 for s in g.trace if not s.end) and len(g.trace) >= g.steps
    for s in g.trace:
        assert s.top[0].prob >= s.prob > 0 and s.ensembled and [m.name for m in s.members] == ["A", "B"]
        assert all(m.computed and len(m.top) == 3 and 0 < m.piece_prob <= 1 for m in s.members)
    assert json.dumps([s.to_dict() for s in g.trace])


@pytest.mark.parametrize("reserve", [True, False])
def test_the_state_matches_score_bytes_on_a_tiny_transformer(pair, reserve):
    """On whole rows of a real (tiny) model, the byte method's member states give each generated byte
    the probability ``score_bytes`` gives it (either rule)."""
    from tokenfuse.alignment.bytestate import ByteState, ByteTable

    m = pair[1]
    rows = Rows.from_member(m, prompt_ids(m, PROMPT))
    tokens = TokenBytes(m.codec.token_bytes)
    data = "né, ab".encode()
    with rows.reader() as take:
        st = ByteState(ByteTable(tokens), rows.start, take, reserve=reserve)
        got = []
        for b in data:
            got.append(st.next_distribution()[b])
            st.advance(b)
    want = score_bytes(data, tokens, rows.start, rows.entries, reserve=reserve)
    np.testing.assert_allclose(got, want.logprobs, rtol=0, atol=1e-5)  # float32 rows, other read orders


def test_product_and_weights(pair, align_cache):
    ens = Ensemble(pair, method="byte", params={"mix": "product", "width": 1}, align_cache=align_cache)
    g = ens.generate(PROMPT, max_new_tokens=5)
    assert g.output.decode("utf-8") == g.text and ens.describe()["params"] == {"mix": "product", "width": 1}
    solo = ens.variant(weights={"A": 0}).generate(PROMPT, max_new_tokens=5)
    alone = Ensemble(pair[1:], method="byte", params={"mix": "product", "width": 1}, align_cache=align_cache)
    assert solo.output == alone.generate(PROMPT, max_new_tokens=5).output


@pytest.mark.parametrize("fields, where", [
    (dict(params={"mix": "sum"}), "params.mix"), (dict(params={"keep": 1.5}), "params.keep"),
    (dict(params={"select": True}), "params.select"), (dict(gate="A", threshold=0.5), "gate:"),
    (dict(speculative={"k": 2}), "speculative:")])
def test_bad_options_name_their_field(pair, align_cache, fields, where):
    with pytest.raises(ConfigError, match=where):
        Ensemble(pair, method="byte", align_cache=align_cache, **fields)


def test_scoring_is_refused(byte_ens):
    with pytest.raises(ConfigError, match="method: byte"):
        byte_ens.loglikelihood([("a", "b")])


# ---------------------------------------------------------------------------------------- entry points
def test_cli_generates_with_byte(capsys, monkeypatch, make_tiny, align_cache, one_thread):
    import tokenfuse.load
    from tokenfuse.cli import main

    tiny = {"smollm2": make_tiny("smollm2", seed=0, name="smollm2"), "qwen": make_tiny("qwen", seed=1, name="qwen")}
    monkeypatch.setattr(tokenfuse.load, "load_ensemble",
                        lambda cfg, progress=True: Ensemble([tiny[m.name] for m in cfg.members], cfg.options,
                                                            align_cache=align_cache))
    code = main(["generate", "Hi", "--models", "smollm2,qwen", "--method", "byte", "--max-new-tokens", "6", "--json"])
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert code == 0 and data["method"] == "byte" and len(data["text"].encode()) == data["steps"] <= 6
    code = main(["generate", "Hi", "--models", "smollm2,qwen", "--method", "byte", "--max-new-tokens", "4", "--trace"])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err
    code = main(["generate", "Hi", "--models", "smollm2,qwen", "--method", "byte", "--param", "mix=product",
                 "--max-new-tokens", "4", "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["params"] == {"mix": "product"}
    code = main(["generate", "Hi", "--models", "smollm2,qwen", "--method", "byte", "--param", "mix=sum"])
    out, err = capsys.readouterr()
    assert code == 2 and "params.mix" in err and "Traceback" not in err
    code = main(["generate", "Hi", "--models", "smollm2,qwen", "--method", "byte", "--gate", "qwen", "--threshold", "0.5"])
    out, err = capsys.readouterr()
    assert code == 2 and "gate: not available with method byte" in err and "Traceback" not in err


def test_server_serves_byte(members, align_cache):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from tokenfuse.server import ServerSettings, create_app

    ens = Ensemble(members[:2], align_cache=align_cache)
    want = Ensemble(members[:2], method="byte", align_cache=align_cache).generate(PROMPT, max_new_tokens=6)
    with TestClient(create_app(ens, settings=ServerSettings(max_tokens=64))) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "tokenfuse": {"method": "byte"}})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                                 "logprobs": True, "top_logprobs": 2, "tokenfuse": {"method": "byte"}})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1,
                                            "tokenfuse": {"method": "byte"}})
        assert r.status_code == 400 and "method: byte" in r.json()["error"]["message"]
