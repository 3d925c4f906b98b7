"""The ``byte`` method (engine/bytegen.py, combiners/bytemix.py): exact choices against an independent
computation from ``score_bytes``, whole UTF-8 characters, stops, the trace, the CLI and the server, on
tiny random-weight members with the real tokenizers."""

from __future__ import annotations

import itertools
import math
import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs
from pydantic import ValidationError

import tokenfuse.engine
from tokenfuse.alignment.bytemodel import ByteModel, Pruning
from tokenfuse.alignment.bytetree import TokenBytes
from tokenfuse.alignment.byteview import score_bytes
from tokenfuse.combiners import StepView, combiner_class, get_combiner
from tokenfuse.combiners.base import FEATURES
from tokenfuse.bundled import DEFAULT_ENSEMBLE
from tokenfuse.combiners.bytemix import ByteParams, load_fit
from tokenfuse.combiners.mixers import Fitted, mixed_logprobs
from tokenfuse.engine import Ensemble, RowMemo
from tokenfuse.engine.bytegen import ByteDecider, choose, inverse_cdf, utf8_allowed
from tokenfuse.engine.decide import Decider
from tokenfuse.engine.options import EnsembleOptions
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
    without ``ByteModel``'s next_distribution (each byte scored alone)."""

    def __init__(self, members, prompt: str, **prune) -> None:
        defaults = ByteParams().model_dump(include={"keep", "width", "rule", "smooth"})  # the byte method's views, unless given
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

    def mixture(self, out: bytes, room: int, w: np.ndarray | None = None) -> np.ndarray:
        """The masked mixture after ``out`` at weights ``w`` (default: the members' own, normalised)."""
        if w is None:
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
@pytest.mark.parametrize("mix", ["switch", "gate", "online"])
def test_greedy_under_a_mixer_with_a_state_follows_the_reference(pair, align_cache, tmp_path, mix, byte_fit):
    """``mix: switch`` and ``gate``: each step mixes at the weights the mixer has after the output so far
    (updated with every member's probability of each byte taken): the greedy chain and each byte's
    traced probability are the reference's masked mixture at those weights."""
    n = 6
    params = {"mix": mix, "rule": "top", "keep": 0.05}
    params |= {"alpha": 0.3} if mix == "switch" else {"fit": byte_fit([m.name for m in pair])}
    ens = Ensemble(pair, method="byte", params=params, align_cache=align_cache)
    g = ens.generate(PROMPT, max_new_tokens=n, trace=True)
    mixer = ens.combiner.new_mixer([m.weight for m in pair])
    ref, out, probs = Reference(pair, PROMPT, rule="top", keep=0.05), b"", []
    for step in range(n):
        q = ref.mixture(out, n - step, mixer.weights())
        b = int(np.argmax(q))
        probs.append(q[b])
        if b == 256:
            break
        mixer.update(np.array([ref.member(k, out)[b] for k in range(len(pair))]))
        out += bytes([b])
    assert g.output == out
    # (rtol: generation reads rows on kept sequence states, the reference on fresh ones; a cache against a
    # prefill differs in float rounding, ~1e-7 here)
    np.testing.assert_allclose([s.prob for s in g.trace], probs[:len(g.trace)], rtol=1e-6)
    plain = Ensemble(pair, method="byte", params={"rule": "top", "keep": 0.05}, align_cache=align_cache)
    assert [s.prob for s in plain.generate(PROMPT, max_new_tokens=n, trace=True).trace] != [s.prob for s in g.trace]


@pytest.mark.parametrize("mix", ["mixture", "gate", "online"])
def test_generation_uses_the_probabilities_scoring_gives(pair, align_cache, tmp_path, mix, byte_fit):
    """After an empty prompt (every byte model at its start ids in both), each generated byte's traced
    probability is the one scoring gives that byte of the output (``score_prompt``: the mixture of the
    byte models of the text, the mixer over every byte) renormalised over the outcomes generation allows
    (whole UTF-8 within the length left), the mixture's mass on the others read from its 257 entries."""
    params = {"mix": mix, "rule": "top", "keep": 0.05}
    if mix in ("gate", "online"):
        params["fit"] = byte_fit([m.name for m in pair])
    ens = Ensemble(pair, method="byte", params=params, align_cache=align_cache)
    n = 6
    g = ens.generate("", max_new_tokens=n, trace=True)
    out = g.output
    pieces = ens.score_prompt(out.decode("utf-8"), top=257)
    assert len(out) >= 1 and len(pieces) == len(out)
    for t, (step, piece) in enumerate(zip(g.trace, pieces)):
        tail = out[:t][len(out[:t]) - incomplete_tail(out[:t]):]
        ok = utf8_allowed(tail, n - t)
        barred = sum(e.prob for e in piece.top if not ok[256 if e.end else int(e.bytes, 16)])
        # (rel: the first row comes from generation's prompt prefill there, from a reader's forward here:
        # float rounding, 2e-6; the later ones agree to 1e-9)
        assert step.prob == pytest.approx(math.exp(piece.logprob) / (1 - barred), rel=1e-5)


def test_a_mixer_fit_is_checked_against_the_members(pair, align_cache, tmp_path, byte_fit):
    """``gate`` without a fit for these members, a fit for other members, a file that is no fit: each a
    ``ConfigError`` naming ``params.fit``; the bundled members' fit ships with the package."""
    with pytest.raises(ConfigError, match="params.fit: the bundled members' fit is for members smollm2-135m-instruct"):
        Ensemble(pair, method="byte", params={"mix": "gate"}, align_cache=align_cache)
    other = byte_fit(["A", "C"])
    with pytest.raises(ConfigError, match=r"params.fit: .*fit.json is for members A, C; this ensemble is A, B"):
        Ensemble(pair, method="byte", params={"mix": "gate", "fit": other}, align_cache=align_cache)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="params.fit: .*bad.json is no text-bytes fit"):
        Ensemble(pair, method="byte", params={"mix": "switch", "fit": str(bad)}, align_cache=align_cache)
    fit = load_fit(None, list(DEFAULT_ENSEMBLE))
    assert set(fit["fitted"]) >= {"byte-mix", "byte-switch", "byte-gate", "byte-online"} and fit["rule"] == "defer"


@pytest.mark.parametrize("rule", ["reserve", "top", "defer"])
def test_greedy_is_the_argmax_chain_of_the_mixture(pair, align_cache, rule):
    """Greedy ``byte`` output equals the argmax chain of an independent computation of the masked
    mixture (every member's 257 numbers from ``score_bytes`` of the output and each next byte), under
    every rule for the pruned mass."""
    n = 6
    ens = Ensemble(pair, method="byte", params={"rule": rule, "keep": 0.05}, align_cache=align_cache)
    g = ens.generate(PROMPT, max_new_tokens=n)
    ref, out = Reference(pair, PROMPT, rule=rule, keep=0.05), b""
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


@pytest.mark.parametrize("rule", ["reserve", "top", "defer"])
def test_the_state_matches_score_bytes_on_a_tiny_transformer(pair, rule):
    """On whole rows of a real (tiny) model, the byte method's member states give each generated byte
    the probability ``score_bytes`` gives it (every rule)."""
    m = pair[1]
    rows = Rows.from_member(m, prompt_ids(m, PROMPT))
    tokens = TokenBytes(m.codec.token_bytes)
    data = "né, ab".encode()
    with rows.reader() as take:
        st = ByteModel(tokens, rows.start, take, Pruning(rule=rule, keep=0.05))
        got = []
        for b in data:
            got.append(st.next_distribution()[b])
            st.advance(b)
    want = score_bytes(data, tokens, rows.start, rows.entries, rule=rule, keep=0.05)
    np.testing.assert_allclose(got, want.logprobs, rtol=0, atol=1e-5)  # float32 rows, other read orders


def test_the_old_reserve_spelling_is_the_rule(pair, align_cache):
    """``params.reserve: true|false`` (before ``rule``) still works, as ``rule: reserve|top``, with a warning
    naming the new spelling; both at once are refused."""
    with pytest.warns(FutureWarning, match="rule: top"):
        old = Ensemble(pair, method="byte", params={"reserve": False}, align_cache=align_cache)
    assert old.combiner.params.rule == "top"
    new = Ensemble(pair, method="byte", params={"rule": "top"}, align_cache=align_cache)
    assert old.generate(PROMPT, max_new_tokens=4).output == new.generate(PROMPT, max_new_tokens=4).output
    with pytest.raises(ConfigError, match="reserve"):
        Ensemble(pair, method="byte", params={"reserve": True, "rule": "top"}, align_cache=align_cache)


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


# ---------------------------------------------------------------------------------------- likelihood on bytes
def _member_bytes(m, text: str, **prune) -> np.ndarray:
    """Member ``m``'s byte model of ``text`` from its start ids, each row read on a fresh state."""
    rows, data = Rows.from_member(m), text.encode()
    p = Pruning(**(ByteParams().model_dump(include={"keep", "width", "rule", "smooth"}) | prune))
    return score_bytes(data, TokenBytes(m.codec.token_bytes), rows.start, rows.entries, pruning=p).logprobs


@pytest.mark.parametrize("mix", ["mixture", "switch", "gate", "online", "mixture-fit"])
def test_loglikelihood_is_the_mixed_byte_models_of_the_whole_text(pair, align_cache, tmp_path, mix, byte_fit):
    """Each option's log-likelihood is the sum over its bytes of the mixer's conditionals, the mixer having
    read the context's bytes too, from each member's byte model of context + option from its start ids
    (recomputed here on fresh states); a request split in two adds up (chain rule)."""
    params = {"mix": mix.split("-")[0]} | ({"alpha": 0.3} if mix == "switch" else {})
    if mix in ("gate", "online", "mixture-fit"):  # mixture with a fit: at the fit's weights, not the members'
        params["fit"] = byte_fit([m.name for m in pair])
    ens = Ensemble(pair, method="byte", params=params, align_cache=align_cache)
    ctx, opts = "Q: ab ba?\nA:", [" ab", " ba ab", " b\u00e9"]
    got = ens.loglikelihood([(ctx, o) for o in opts])
    w = np.array([m.weight for m in pair])
    fitted = {"gate": ens.combiner.fitted, "online": ens.combiner.fitted,
              "mixture-fit": Fitted(weights=np.array([0.9, 0.1]))}.get(
        mix, Fitted(weights=w / w.sum(), alpha=0.3))
    for o, lk in zip(opts, got):
        p = np.exp(np.stack([_member_bytes(m, ctx + o) for m in pair], axis=1))
        want = mixed_logprobs(mix.split("-")[0], p, fitted)[len(ctx.encode()):]
        assert lk.bytes == lk.pieces == len(o.encode()) and lk.ensembled == len(o.encode())
        np.testing.assert_allclose(lk.piece_logprobs, want, rtol=0, atol=1e-5)
        assert lk.logprob == pytest.approx(sum(lk.piece_logprobs), abs=1e-12)
    head, tail = ens.loglikelihood([(ctx, " ba"), (ctx + " ba", " ab")])
    assert head.logprob + tail.logprob == pytest.approx(got[1].logprob, abs=1e-5)


def test_byte_rows_sharing_a_memo_run_each_member_once_and_give_the_same_numbers(pair, align_cache, tmp_path, byte_fit):
    """The rows that differ only in their mixer, scoring the same requests with one ``RowMemo``: each
    member's byte models of a context's continuations are made once (the first row's misses, then hits),
    and every row's numbers are those it gives alone."""
    fit = byte_fit([m.name for m in pair])
    rows = [Ensemble(pair, method="byte", params={"mix": mix} | ({"fit": fit} if mix != "mixture" else {}),
                     align_cache=align_cache) for mix in ("mixture", "gate", "online")]
    requests = [("Q: ab?\nA:", " ab"), ("Q: ab?\nA:", " ba"), ("Q: b?\nA:", " b")]
    alone = [ens.loglikelihood(requests) for ens in rows]
    memo = RowMemo()
    shared = [ens.loglikelihood(requests, memo=memo) for ens in rows]
    assert (memo.misses, memo.hits) == (2 * len(pair), 2 * 2 * len(pair))  # 2 contexts × members, then twice hits
    for a, b in zip(alone, shared):
        assert [x.piece_logprobs for x in a] == [x.piece_logprobs for x in b]
    assert len({tuple(x.logprob for x in got) for got in shared}) == 3  # three mixers, three answers


def test_one_byte_continuations_and_the_end_sum_to_one(pair, align_cache):
    """Over every one-byte continuation of a context, the mixture's probabilities and its end's sum to 1:
    a conditional distribution, nothing masked."""
    ens = Ensemble(pair, method="byte", align_cache=align_cache)
    ctx = "ab"
    total = sum(math.exp(lk.logprob) for lk in ens.loglikelihood([(ctx, chr(b)) for b in range(128)]))
    w = np.array([m.weight for m in pair]) / sum(m.weight for m in pair)
    rest = 0.0  # the bytes 128..255 (no whole character alone) and the end, from each member's byte model
    for m, wk in zip(pair, w):
        rows, tb = Rows.from_member(m), TokenBytes(m.codec.token_bytes)
        p = Pruning(**ByteParams().model_dump(include={"keep", "width", "rule", "smooth"}))
        model = ByteModel(tb, rows.start, rows.entries, p)
        for b in ctx.encode():
            model.advance(b)
        q = np.exp(model.next_distribution())
        rest += wk * (q[128:256].sum() + q[256])
    assert total + rest == pytest.approx(1.0, abs=1e-5)


def test_scoring_refuses_product_chat_and_prompt_logprobs(pair, align_cache):
    with pytest.raises(ConfigError, match="params.mix: product scores no bytes"):
        Ensemble(pair, method="byte", params={"mix": "product"}, align_cache=align_cache).loglikelihood([("a", "b")])
    ens = Ensemble(pair, method="byte", align_cache=align_cache)
    with pytest.raises(ConfigError, match="chat: the byte method scores a context's bytes"):
        ens.loglikelihood([("a", "b")], chat=True)
    with pytest.raises(ConfigError, match="give it as text, not chat messages"):
        ens.loglikelihood([([{"role": "user", "content": "a"}], "b")])


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
        assert r.status_code == 200, r.text  # echo: the prompt's bytes, each with its log-probability
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(PROMPT.encode()) + 2 and all(x is not None for x in lp["token_logprobs"])


# ---------------------------------------------------------------------------------------- one decision loop
# ``ByteDecider`` is a ``Decider`` whose members' outputs are next-byte distributions, ``ByteMix.combine``
# its combination, and what cannot apply to byte steps is declared by the combiner (``Combiner.lacks``),
# not checked on a unit in the engine.
def test_the_engine_checks_no_unit():
    root = Path(tokenfuse.engine.__file__).parent
    hits = [f"{p.name}:{n}" for p in sorted(root.rglob("*.py"))
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if re.search(r"unit\s*[!=]=|\.unit\b", line)]
    assert hits == []


def test_prompt_logprobs_are_every_bytes_under_the_mixture(byte_ens):
    """``score_prompt`` with the byte method: every byte a piece, the first too, its log-probability the
    likelihood on bytes of the prompt after nothing, and its top entries the mixture's there."""
    prompt = "ab, ba"
    pieces = byte_ens.score_prompt(prompt, top=3)
    (lk,) = byte_ens.loglikelihood([("", prompt)])
    assert b"".join(p.bytes for p in pieces) == prompt.encode() and all(len(p.bytes) == 1 for p in pieces)
    np.testing.assert_allclose([p.logprob for p in pieces], lk.piece_logprobs, rtol=0, atol=1e-9)
    for p in pieces:
        assert 1 <= len(p.top) <= 3 and sum(t.prob for t in p.top) <= 1 + 1e-9
        assert [t.prob for t in p.top] == sorted((t.prob for t in p.top), reverse=True)
        hit = [t.prob for t in p.top if t.bytes == p.bytes.hex()]
        assert not hit or math.isclose(math.log(hit[0]), p.logprob, abs_tol=1e-6)


def test_what_byte_steps_lack_is_declared():
    byte, gac = combiner_class("byte"), combiner_class("gac")
    assert set(byte.lacks) == set(FEATURES) - {"scoring"} and not gac.lacks
    assert [f for f in FEATURES if byte.can(f)] == ["scoring"] and all(gac.can(f) for f in FEATURES)
    with pytest.raises(ValueError, match="feature"):
        gac.can("gates")
    with pytest.raises(ValidationError, match=r"gate: not available with method byte \(it chooses bytes, not "
                                              r"pieces\); drop gate or use method gac"):
        EnsembleOptions(method="byte", gate="A", threshold=0.5)
    with pytest.raises(ValidationError, match="speculative: not available with method byte"):
        EnsembleOptions(method="byte", speculative={"k": 2})
    assert EnsembleOptions(method="byte", agreement_skip=True).agreement_skip  # accepted, and off (below)


def test_a_byte_step_goes_through_the_decider_with_a_stop_and_a_trace(byte_ens, monkeypatch):
    full = byte_ens.generate(PROMPT, max_new_tokens=10)
    stop = full.text[2:4]
    want = byte_ens.generate(PROMPT, max_new_tokens=10, stop=[stop], trace=True, trace_k=3)
    groups = []
    inner = Decider._decide_group

    def counted(self, seqs, *args, **kwargs):
        groups.append(len(seqs))
        return inner(self, seqs, *args, **kwargs)

    monkeypatch.setattr(Decider, "_decide_group", counted)
    assert isinstance(byte_ens.decider, ByteDecider) and isinstance(byte_ens.decider, Decider)
    assert "decide" not in vars(ByteDecider) and "_decide_group" not in vars(ByteDecider)  # one loop
    g = byte_ens.generate(PROMPT, max_new_tokens=10, stop=[stop], trace=True, trace_k=3)
    assert replace(g, timings={}) == replace(want, timings={})
    assert g.finish_reason == "stop" and g.text == full.text[:full.text.index(stop)]
    assert len(groups) == len(g.trace) >= g.steps and "".join(s.text for s in g.trace) == g.text


def test_agreement_skip_is_off_for_bytes(pair, byte_ens, align_cache):
    on = Ensemble(pair, method="byte", agreement_skip=True, align_cache=align_cache)
    assert on.decider.agreement_skip is False
    g = on.generate(PROMPT, max_new_tokens=6)
    assert g.output == byte_ens.generate(PROMPT, max_new_tokens=6).output and g.skipped_steps == 0
    alone = Ensemble(pair[1:], method="byte", align_cache=align_cache)  # a member alone agrees with itself
    assert alone.generate(PROMPT, max_new_tokens=4).skipped_steps == 0


def test_combine_is_the_masked_mixture_over_the_union_bytes(byte_ens):
    comb, space = byte_ens.combiner, byte_ens.space
    rng = np.random.default_rng(1)
    lps = [np.log(rng.dirichlet(np.ones(257), size=2)) for _ in range(2)]
    allowed = torch.zeros(2, 257, dtype=torch.bool)
    allowed[0, :0x80] = allowed[0, 256] = True
    allowed[1, 0x80:0xC0] = True
    view = StepView(space=space, models=byte_ens.members, states={0: [None, None], 1: [None, None]},
                    computed=[0, 1], weights=[1.0, 2.0], allowed=allowed,
                    logprobs={i: torch.from_numpy(lp) for i, lp in enumerate(lps)})
    dist = comb.combine(view)
    assert dist.probs.dtype == torch.float64 and dist.probs.shape == (2, 257)
    for r in range(2):
        q = comb.mix([lp[r] for lp in lps], [1.0, 2.0])
        ok = allowed[r].numpy() & (dist.index[r] >= 0).numpy()
        want = np.where(ok, q, 0.0)
        np.testing.assert_array_equal(dist.probs[r].numpy(), want / want.sum())
    assert dist.entry(0, 256) == 0 and all(space.piece(dist.entry(0, b)) == bytes([b])
                                           for b in range(256) if dist.index[0, b] >= 0)
    assert get_combiner("byte").lacks == comb.lacks
