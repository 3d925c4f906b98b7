"""Likelihood of a given continuation under the token-level ensemble (teacher forcing)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from tokenfuse import Ensemble

CONTEXT = "Question: Which city is the capital of France?\nAnswer:"
CONTS = [" Paris", " Lyon, the city of lights", " 東京"]


def direct(member, context: str, continuation: str) -> float:
    """The member's own log-likelihood of its tokens of ``continuation``, each step renormalised
    over its text + END ids (what the engine's projection does), computed by one plain forward. A
    piece the vocabulary spells with several ids (Gemma has a few) counts with all of them."""
    ctx = member.encode_prompt(context)
    cont = member.codec.encode_text(continuation)
    ids = torch.tensor([ctx + cont], device=member.device)
    with torch.no_grad():
        logits = member.model(ids).logits[0].float().cpu()
    lp = torch.log_softmax(logits, -1)
    text = torch.tensor([b is not None for b in member.codec.token_bytes] + [False] * (lp.shape[-1] - len(member.codec.token_bytes)))
    text[sorted(member.codec.end_ids)] = True
    total = 0.0
    for j, t in enumerate(cont):
        row = lp[len(ctx) + j - 1]
        same = [i for i, b in enumerate(member.codec.token_bytes) if b == member.codec.token_bytes[t]]
        total += float(row[same].logsumexp(-1) - row[text].logsumexp(-1))
    return total


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen"])
def test_single_member_likelihood_is_its_own(make_tiny, one_thread, family):
    m = make_tiny(family, seed=5)
    got = Ensemble([m]).loglikelihood([(CONTEXT, c) for c in CONTS])
    for c, g in zip(CONTS, got):
        assert g.logprob == pytest.approx(direct(m, CONTEXT, c), abs=1e-4)
        assert g.pieces == len(m.codec.encode_text(c))
        assert g.bytes == len(c.encode())


@pytest.mark.parametrize("method", ["gac", "unite"])
def test_self_ensemble_gives_the_single_models_likelihood(make_tiny, one_thread, method):
    a, b = make_tiny("gemma3", seed=5, name="a"), make_tiny("gemma3", seed=5, name="b")
    alone = Ensemble([a]).loglikelihood([(CONTEXT, c) for c in CONTS])
    both = Ensemble([a, b], method=method, params={"k": 5} if method == "unite" else None)
    pair = both.loglikelihood([(CONTEXT, c) for c in CONTS])
    for x, y in zip(alone, pair):
        if method == "gac":
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
        else:  # UniTE renormalises over top-k + the piece: never below the full-vocabulary value
            assert y.logprob >= x.logprob - 1e-6


def test_mixed_ensemble_likelihood_is_finite_and_batch_independent(make_tiny, one_thread):
    ms = [make_tiny("smollm2", seed=1), make_tiny("gemma3", seed=2), make_tiny("qwen", seed=3)]
    ens = Ensemble(ms, primary=ms[1].name)
    batch = ens.loglikelihood([(CONTEXT, c) for c in CONTS])
    one = [ens.loglikelihood([(CONTEXT, c)])[0] for c in CONTS]
    assert [x.logprob for x in batch] == pytest.approx([x.logprob for x in one], abs=1e-5)
    assert all(math.isfinite(x.logprob) and x.logprob < 0 for x in batch)
    # pieces follow the primary member's tokenization
    assert [x.pieces for x in batch] == [len(ms[1].codec.encode_text(c)) for c in CONTS]


def test_empty_context_starts_from_bos_or_eos(make_tiny, one_thread):
    ms = [make_tiny("smollm2", seed=1), make_tiny("qwen", seed=3)]  # neither adds a BOS by itself
    for m in ms:
        assert m.encode_prompt("") == [m.tokenizer.bos_token_id if m.tokenizer.bos_token_id is not None
                                       else m.tokenizer.eos_token_id]
    got = Ensemble(ms).loglikelihood([("", "Hello world")])[0]
    assert math.isfinite(got.logprob) and got.logprob < 0
    assert Ensemble(ms).generate("", max_new_tokens=3).steps >= 1


def test_gated_likelihood_is_the_gates_where_confident_and_gacs_elsewhere(make_tiny, one_thread):
    ms = [make_tiny("smollm2", seed=1), make_tiny("gemma3", seed=2), make_tiny("qwen", seed=3)]
    gate = ms[1].name
    requests = [(CONTEXT, c) for c in CONTS]
    alone = Ensemble([ms[1]]).loglikelihood(requests)
    full = Ensemble(ms, primary=gate).loglikelihood(requests)
    always = Ensemble(ms, primary=gate, gate=gate, threshold=0.0).loglikelihood(requests)  # gate always sure
    never = Ensemble(ms, primary=gate, gate=gate, threshold=1.0).loglikelihood(requests)  # gate never sure
    assert [x.logprob for x in always] == pytest.approx([x.logprob for x in alone], abs=1e-5)
    assert [x.logprob for x in never] == pytest.approx([x.logprob for x in full], abs=1e-5)
    assert [x.ensembled for x in always] == [0] * len(CONTS)
    assert [x.ensembled for x in never] == [x.pieces for x in never] == [x.ensembled for x in full]


# ---------------------------------------------------------------------------- one-forward scoring
STRADDLE = [" Paris", " naïve café 😀 東京", "Hello, world!\n\n  indented", " 1234567 + 89 = ?", ""]


def _ensemble(ms, method: str, **kw):
    params = {"unite": {"k": 5}}.get(method)
    if method == "gac-gated":
        return Ensemble(ms, primary=ms[1].name, gate=ms[1].name, threshold=0.05, **kw)
    return Ensemble(ms, method=method, params=params, primary=ms[1].name, **kw)


@pytest.mark.parametrize("method", ["gac", "unite", "deepen", "gac-gated"])
def test_one_forward_scoring_equals_the_stepwise_path(make_tiny, one_thread, method, tmp_path):
    ms = [make_tiny("smollm2", seed=1), make_tiny("gemma3", seed=2), make_tiny("qwen", seed=3)]
    kw = {"align_cache": tmp_path} if method == "deepen" else {}
    ens = _ensemble(ms, method, **kw)
    requests = [(CONTEXT, c) for c in STRADDLE] + [("", "Hello world")]
    fast = ens.loglikelihood(requests)
    slow = ens.loglikelihood(requests, stepwise=True)
    for f, s in zip(fast, slow):
        assert f.logprob == pytest.approx(s.logprob, abs=1e-4)
        assert [round(x, 4) for x in f.piece_logprobs] == pytest.approx([round(x, 4) for x in s.piece_logprobs], abs=2e-4)
        assert (f.pieces, f.bytes, f.ensembled, f.piece_bytes) == (s.pieces, s.bytes, s.ensembled, s.piece_bytes)
    assert b"".join(fast[1].piece_bytes) == STRADDLE[1].encode()


def test_one_forward_scoring_feeds_each_member_in_few_forwards(make_tiny, one_thread, monkeypatch):
    """Runs of pieces along which a member's ids only grow take one forward; the stepwise path one per piece."""
    ms = [make_tiny("smollm2", seed=1), make_tiny("gemma3", seed=2)]
    ens = Ensemble(ms, primary=ms[1].name)
    calls = {m.name: 0 for m in ms}
    for m in ms:
        original = m._forward_at_many
        monkeypatch.setattr(m, "_forward_at_many", lambda sts, ends, m=m, f=original, **kw: calls.__setitem__(m.name, calls[m.name] + 1) or f(sts, ends, **kw))
    text = " the cat sat on the mat and looked at the dog"
    (got,) = ens.loglikelihood([(CONTEXT, text)])
    assert got.pieces == len(ms[1].codec.encode_text(text)) > 8
    assert calls == {ms[0].name: 1, ms[1].name: 1}  # plain English: no member re-tokenises earlier pieces


@settings(max_examples=25, deadline=None, derandomize=True)
@given(text=st.text(alphabet=st.sampled_from(list("ab cdé😀東京,.\n-0123")), min_size=1, max_size=24))
def test_one_forward_equals_stepwise_on_any_text(tiny_trio, text):
    ens = tiny_trio
    (fast,) = ens.loglikelihood([("Q:", text)])
    (slow,) = ens.loglikelihood([("Q:", text)], stepwise=True)
    assert fast.logprob == pytest.approx(slow.logprob, abs=1e-4)
    assert fast.piece_bytes == slow.piece_bytes


@pytest.fixture(scope="module")
def tiny_trio(make_tiny, one_thread):
    ms = [make_tiny("smollm2", seed=1), make_tiny("gemma3", seed=2), make_tiny("qwen", seed=3)]
    return Ensemble(ms, primary=ms[0].name)


def _head_is_shape_invariant(member) -> bool:
    """Whether ``member``'s last row is the same bits computed alone and with three rows before it: where it
    is not, a row's bits depend on which other rows its forward kept (docs/evaluation.md, "One-forward
    scoring"), and so do the memo's."""
    ids = member.encode_prompt(CONTEXT)
    rows = []
    for ends in ([len(ids) - 3, len(ids) - 2, len(ids) - 1, len(ids)], [len(ids)]):
        st = member.new_state(ids)
        try:
            rows.append(member.logprobs_at(st, ends)[-1])
        finally:
            member.release(st)
    return torch.equal(rows[0], rows[1])


def test_row_memo_shares_the_members_forwards_and_changes_no_number(make_tiny, one_thread, monkeypatch, tmp_path):
    """Rows scoring the same requests with one memo (as ``tokenfuse eval`` does per batch): a member
    fed the same ids (same primary's cuts) computes once; every likelihood is the one computed alone."""
    from tokenfuse.engine import RowMemo

    ms = [make_tiny("smollm2", seed=1), make_tiny("gemma3", seed=2), make_tiny("qwen", seed=3)]
    rows = [Ensemble.single(ms[1]), _ensemble(ms, "gac"), _ensemble(ms, "unite"),
            _ensemble(ms, "deepen", align_cache=tmp_path), _ensemble(ms, "gac-gated"), Ensemble.single(ms[0])]
    requests = [(CONTEXT, c) for c in STRADDLE]
    exact = all(_head_is_shape_invariant(m) for m in ms)
    calls = {m.name: 0 for m in ms}
    for m in ms:
        original = m._forward_at_many
        monkeypatch.setattr(m, "_forward_at_many", lambda sts, ends, m=m, f=original, **kw: calls.__setitem__(m.name, calls[m.name] + 1) or f(sts, ends, **kw))
    alone, each = [], []
    for ens in rows:
        before = dict(calls)
        alone.append(ens.loglikelihood(requests))
        each.append({k: calls[k] - before[k] for k in calls})
    calls.update(dict.fromkeys(calls, 0))
    memo = RowMemo()
    shared = [ens.loglikelihood(requests, memo=memo) for ens in rows]
    if exact:
        assert shared == alone  # exactly: the memo's rows are the ones the same forward gives
    else:  # this CPU's matrix kernels give a row other bits when the call keeps other rows' logits too
        for got, want in zip(shared, alone):
            assert [g.piece_bytes for g in got] == [w.piece_bytes for w in want]
            assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)
    # the primary ms[1] computes once for the five rows cutting by it; ms[2] once for the four
    # ensembles; ms[0] once for them and, alone (its own cuts), again where its ids differ
    assert each[0][ms[1].name] > 0 and each[1][ms[0].name] > 0 and each[5][ms[0].name] > 0
    assert (calls[ms[1].name], calls[ms[2].name]) == (each[0][ms[1].name], each[1][ms[2].name])
    assert each[1][ms[0].name] < calls[ms[0].name] <= each[1][ms[0].name] + each[5][ms[0].name]
    assert memo.hits + memo.misses == 14 * len(requests) and len(memo) == memo.misses <= 4 * len(requests)


def test_batched_members_score_the_requests_together(make_tiny, one_thread, monkeypatch):
    """A batched transformers member (``scores_together``) gets every request of one scoring call in
    one ``logprobs_at_many``; each likelihood is the request's scored alone, to float rounding (the
    batch's forward pads the rows), and an unbatched member scores one request after another."""
    ms = [make_tiny("smollm2", seed=1), make_tiny("gemma3", seed=2)]
    ens = Ensemble(ms)
    requests = [(CONTEXT, c) for c in STRADDLE if c]
    sizes = {m.name: [] for m in ms}
    for m in ms:
        real = m.logprobs_at_many
        monkeypatch.setattr(m, "logprobs_at_many", lambda sts, ends, _m=m, _real=real, **kw:
                            sizes[_m.name].append(len(sts)) or _real(sts, ends, **kw))
    together = ens.loglikelihood(requests)
    assert all(m.scores_together and sizes[m.name][0] == len(requests) for m in ms)
    for request, got in zip(requests, together):
        alone = ens.loglikelihood([request])[0]
        assert got.pieces == alone.pieces and got.logprob == pytest.approx(alone.logprob, rel=1e-5, abs=1e-5)
    monkeypatch.setattr(ms[0], "batched", False)
    sizes[ms[0].name].clear()
    ens.loglikelihood(requests)
    assert not ms[0].scores_together and set(sizes[ms[0].name]) == {1}
