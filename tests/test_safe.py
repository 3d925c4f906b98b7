"""SAFE (``params.safe``, ``tokenfuse.engine.strategies.safe``) as published (arXiv 2510.15346v2,
Alg. 1): the primary drafts chunks, the ensemble decides at the first clean position without
consensus, sharpening moves extensions' mass to the drafter's prefix tokens.

Tiny random-weight members on the three real tokenizers (A SmolLM2, B Qwen, C Gemma-3); B is the
primary (the drafter) throughout. ``reference`` is Algorithm 1 written out plainly (a full forward
per member per position, full tokenisations, its own GaC average and sharpening); the engine must
give its output token for token.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokenfuse.alignment.union import END
from tokenfuse.combiners.base import Dist
from tokenfuse.config import parse_config
from tokenfuse.engine import Ensemble, EnsembleOptions
from tokenfuse.engine.sampling import Sampling
from tokenfuse.engine.strategies import safe as safe_module
from tokenfuse.engine.strategies.safe import Safe, clean_tokens, consensus
from tokenfuse.engine.sync import incomplete_tail
from tokenfuse.errors import ConfigError
from tokenfuse.eval.methods import plan_methods
from tokenfuse.members.transformers import TransformersMember

PROMPTS = ["Once upon a time there was", "def f(x):", "日本語"]
MAX_NEW = 16


@pytest.fixture(scope="module")
def sharp(make_tiny, tokenizers, align_cache, one_thread):
    """Members whose output layer is scaled so they are often confident: A (SmolLM2), B (Qwen, the
    drafter) and D, a copy of B, so the verifiers often agree with the draft (consensus) and often not
    (tiny random models alone are never sure of anything, nor agree)."""
    def scaled(family, seed, name, scale):
        m = make_tiny(family, seed=seed, name=name)
        model = type(m.model)(m.model.config).eval()
        model.load_state_dict(m.model.state_dict())
        model.lm_head.weight.data *= scale
        return TransformersMember(name, model, tokenizers[family], align_cache=align_cache)

    b = scaled("qwen", 1, "B", 4.0)
    return [scaled("smollm2", 0, "A", 4.0), b, TransformersMember("D", b.model, tokenizers["qwen"], align_cache=align_cache)]


def gen(members, align_cache, prompt, **options):
    return Ensemble(members, align_cache=align_cache, primary="B", **options).generate(prompt, max_new_tokens=MAX_NEW)


# ---------------------------------------------------------------------------------------- the reference
def reference(members, align_cache, prompt, *, n, gate=None, max_new=MAX_NEW, sharpen=0.5, lam=0.1):
    """Algorithm 1, plainly: the pieces chosen and how many positions triggered. The members' ids are
    the engine's re-synchronised ones (``OpenSequence.force``); everything else is computed here."""
    ens = Ensemble(members, align_cache=align_cache, primary="B")
    space, union, d = ens.space, ens.space.union, ens.primary
    pieces = union.pieces
    s = ens.open(prompt, max_new_tokens=max_new)

    def row(i):
        with torch.no_grad():
            logits = members[i].model(torch.tensor([s.states[i].all_ids()], device=members[i].device)).logits[0, -1].float().cpu()
        return logits.log_softmax(-1)

    def top_text(i, lp):
        umap = union.maps[i]
        return int(torch.where(torch.from_numpy(umap[: len(lp)] >= 0), lp, -math.inf).argmax())

    def projected(i, lp):
        umap = union.maps[i][: len(lp)]
        p = lp.double().exp().numpy() * (umap >= 0)
        return np.bincount(umap[umap >= 0], weights=p[umap >= 0], minlength=len(pieces)) / p.sum()

    def own_token(i, out, rest):  # the token member i's full tokenisation of out + rest starts at len(out)
        if incomplete_tail(out):
            return None
        pos = 0
        for tid in space.codecs[i].encode_bytes(out + rest):
            if pos == len(out):
                return tid
            pos += len(space.codecs[i].token_bytes[tid] or b"")
            if pos > len(out):
                return None
        return None

    def gated(rows):
        return gate is not None and float(rows[d].max().exp()) > 0.5

    def ensemble(rows):
        if gated(rows):
            return int(projected(d, rows[d]).argmax())
        p = sum(projected(i, lp) for i, lp in rows.items()) / len(rows)
        if p.max() < sharpen:
            drafter = set(union.maps[d][union.maps[d] >= 0].tolist()) - {END}
            q = p.copy()
            for e in np.nonzero(p > lam)[0].tolist():
                if e in drafter:
                    q[e] += sum(p[k] for k in np.nonzero(p)[0].tolist()
                                if k != e and pieces[k].startswith(pieces[e]))
            p = q
        return int(p.argmax())

    chosen, triggered = [], 0
    while True:
        room = max_new - len(chosen)
        out0, drafts = bytes(s.output), []
        saved = s.snapshot()
        while len(drafts) < min(n, room):
            e = int(union.maps[d][top_text(d, row(d))])
            if e < 0 or e == END or not union.representable[e]:
                break
            drafts.append(e)
            s.force(e)
        s.restore(saved)
        assert bytes(s.output) == out0
        for j in range(len(drafts) + (len(drafts) < min(n, room))):
            rows = {i: row(i) for i in range(len(members))}
            fire = j == len(drafts)
            if not fire:
                out, rest = bytes(s.output), b"".join(pieces[e] for e in drafts[j:])
                own = {i: own_token(i, out, rest) for i in rows}
                if all(t is not None for t in own.values()):
                    ver = [i for i in rows if i != d]
                    unanimous = all(top_text(v, rows[v]) == own[v] for v in ver)
                    probs = [float(rows[d][top_text(d, rows[d])].exp())] + [float(rows[v][own[v]].exp()) for v in ver]
                    fire = not unanimous and sum(probs) / len(probs) <= 0.5
            e = ensemble(rows) if fire else drafts[j]
            triggered += fire and not gated(rows)  # E/T: the combination decided
            if e == END:
                return chosen + [END], triggered
            chosen.append(e)
            s.force(e)
            if len(chosen) == max_new:
                return chosen, triggered
            if fire:
                break


def engine_pieces(ens, g):
    """The union entries of a generation's output, cut where the trace says (traced run)."""
    return [ens.space.union.pieces.index(t.raw) for t in g.trace]


@pytest.mark.parametrize(("setup", "n", "gate"), [("copy", 5, None), ("copy", 2, None), ("copy", 5, "B"),
                                                 ("copy", 2, "B"), ("three", 5, None), ("three", 2, "B")])
def test_the_engine_is_algorithm_1(request, setup, n, gate, align_cache):
    """``copy``: verifiers that often agree (``sharp``); ``three``: the three tokenizers' tiny members
    (they rarely agree: nearly every clean position triggers)."""
    members = request.getfixturevalue("sharp" if setup == "copy" else "members")
    mixed = 0
    for prompt in PROMPTS:
        want, triggered = reference(members, align_cache, prompt, n=n, gate=gate)
        opts = {"params": {"safe": True, "safe_n": n}} | ({"gate": gate, "threshold": 0.5} if gate else {})
        ens = Ensemble(members, align_cache=align_cache, primary="B", **opts)
        g = ens.generate(prompt, max_new_tokens=MAX_NEW, trace=True)
        assert engine_pieces(ens, g) == want, prompt
        assert g.ensembled_steps == triggered and g.vetoed_steps == 0
        mixed += 0 < triggered < len(want) - 2
    assert setup == "three" or mixed == len(PROMPTS)  # positions taken from the draft and positions decided


# ---------------------------------------------------------------------------------------- clean check
def test_the_clean_check_on_real_tokenizers(members, align_cache):
    """A (SmolLM2) drafts `` So|fa``; Qwen (B) and Gemma-3 (C) hold `` Sofa`` as one token: the position
    before `` So`` is clean (each one's token there is its own), the one after it is not."""
    ens = Ensemble(members, align_cache=align_cache, primary="A")
    pieces = ens.space.union.pieces
    so, fa = pieces.index(b" So"), pieces.index(b"fa")
    s = ens.open("Hi", max_new_tokens=8)
    own = clean_tokens(ens.space, s, [so, fa], [0, 1, 2])
    assert [ens.space.codecs[i].token_bytes[own[i]] for i in range(3)] == [b" So", b" Sofa", b" Sofa"]
    s.force(so)
    assert clean_tokens(ens.space, s, [fa], [0, 1, 2]) is None
    assert clean_tokens(ens.space, s, [fa], [0]) is not None
    ens.close(s)


# ---------------------------------------------------------------------------------------- consensus
def test_each_consensus_rule_decides_a_skip(members, align_cache):
    """Constructed rows: the drafter (B) and two verifiers, ``own`` their tokens at the boundary."""
    ens = Ensemble(members, align_cache=align_cache, primary="B")
    space = ens.space
    own = {0: 1000, 1: 2000, 2: 3000}

    def rows(probs):  # member -> {id: probability}, the rest spread thin
        out = {}
        for i, m in enumerate(members):
            v = len(m.codec.token_bytes)
            p = torch.full((v,), 1e-9)
            for t, x in probs[i].items():
                p[t] = x
            out[i] = p.log()
        return out

    assert all(space.union.maps[i][t] >= 0 for i, t in own.items())
    # unanimous: every verifier ranks its own token first, however unsure
    assert consensus(space, 1, rows({0: {1000: 0.2, 1005: 0.1}, 1: {2000: 0.1, 2007: 0.3}, 2: {3000: 0.15}}), own)
    # one verifier prefers another token: no unanimity; the mean (0.2 + 0.3 + 0.15) / 3 <= 1/2
    assert not consensus(space, 1, rows({0: {1000: 0.2, 1005: 0.3}, 1: {2000: 0.1, 2007: 0.3}, 2: {3000: 0.15}}), own)
    # ... but a mean above 1/2 is consensus: the drafter's own (top) token 0.9, A's 0.4 (not its top), C's 0.3
    assert consensus(space, 1, rows({0: {1000: 0.4, 1005: 0.5}, 1: {2007: 0.9}, 2: {3000: 0.3}}), own)
    assert not consensus(space, 1, rows({0: {1000: 0.2, 1005: 0.5}, 1: {2007: 0.9}, 2: {3000: 0.3}}), own)


# ---------------------------------------------------------------------------------------- sharpening
PIECES = [b"", b" Sof", b" Sofia", b" So", b" the", b" th", b"x", b" Sofa"]


def sharpener(sharpen=0.5, lam=0.1, held=(1, 3, 4, 6)):
    st = Safe(EnsembleOptions(params={"safe": True, "safe_sharpen": sharpen, "safe_lambda": lam}))
    umap = np.array([0, *held])  # the drafter's ids -> entries: END and the ``held`` pieces
    st.decider = SimpleNamespace(primary=0, space=SimpleNamespace(union=SimpleNamespace(pieces=PIECES, maps=[umap])))
    return st


def test_sharpening_gives_a_drafter_token_its_extensions_mass():
    p = torch.tensor([[0.05, 0.2, 0.25, 0.15, 0.08, 0.12, 0.1, 0.05]], dtype=torch.float64)
    out = sharpener().reshape(Dist(p.clone())).probs[0]
    # " Sof" (0.2) + " Sofia", " Sofa"; " So" (0.15) + " Sof", " Sofia", " Sofa"; " the" (0.08 <= lambda): as is;
    # " th" (0.12) is no drafter token; "x" has no extension; END never gains
    assert out.tolist() == pytest.approx([0.05, 0.5, 0.25, 0.65, 0.08, 0.12, 0.1, 0.05], abs=1e-12)
    assert sharpener(lam=0.05).reshape(Dist(p.clone())).probs[0, 4] == pytest.approx(0.08)  # no extension of " the"
    assert sharpener(held=(1, 3, 4, 5, 6)).reshape(Dist(p.clone())).probs[0, 5] == pytest.approx(0.2)


def test_sharpening_on_top_k_rows_and_its_threshold():
    """Top-k rows (a column's entry per row) sum over the row's own columns; rows whose top is at or
    above ``safe_sharpen`` stay; ``0`` never sharpens; the combiner's distribution is untouched."""
    probs = torch.tensor([[0.3, 0.2, 0.25, 0.1], [0.6, 0.2, 0.1, 0.1]])
    index = torch.tensor([[1, 3, 2, 5], [3, 1, 2, 0]])
    dist = Dist(probs.clone(), index=index)
    out = sharpener().reshape(dist).probs
    assert out[0].tolist() == pytest.approx([0.55, 0.75, 0.25, 0.1])  # " Sof" + " Sofia"; " So" + both
    assert out[1].tolist() == pytest.approx(probs[1].tolist())
    assert sharpener(sharpen=0.7).reshape(dist).probs[1].tolist() == pytest.approx([0.9, 0.3, 0.1, 0.1])
    assert torch.equal(sharpener(sharpen=0).reshape(dist).probs, probs)
    assert torch.equal(dist.probs, probs)


# ---------------------------------------------------------------------------------------- the loop
def test_traced_is_untraced_and_counts(sharp, align_cache):
    for prompt in PROMPTS:
        ens = Ensemble(sharp, align_cache=align_cache, primary="B", params={"safe": True})
        a = ens.generate(prompt, max_new_tokens=MAX_NEW)
        b = ens.generate(prompt, max_new_tokens=MAX_NEW, trace=True)
        assert (b.output, b.steps, b.ensembled_steps, b.vetoed_steps, b.member_ids) == \
            (a.output, a.steps, a.ensembled_steps, 0, a.member_ids)
        assert sum(t.ensembled for t in b.trace) == a.ensembled_steps
        assert a.drafted >= a.accepted >= a.steps - a.ensembled_steps


def test_copies_of_the_drafter_never_trigger(make_tiny, align_cache, one_thread):
    """A verifier that is the drafter ranks every drafted token first: nothing triggers but where its own
    token at the boundary is longer than the drafted one (its tokenisation merges the next piece),
    and there the ensemble of copies chooses the draft: the primary's output."""
    a, b = make_tiny("gemma3", seed=3, name="A"), make_tiny("gemma3", seed=3, name="B")
    for prompt in PROMPTS:
        alone = Ensemble.single(b, align_cache=align_cache).generate(prompt, max_new_tokens=MAX_NEW)
        g = gen([a, b], align_cache, prompt, params={"safe": True})
        assert (g.output, g.steps, g.vetoed_steps) == (alone.output, alone.steps, 0)
        assert g.ensembled_steps <= 2


def test_no_clean_position_is_the_primary_alone(members, align_cache, monkeypatch):
    monkeypatch.setattr(safe_module, "token_at_end", lambda *a, **k: None)
    for prompt in PROMPTS:
        alone = Ensemble.single(members[1], align_cache=align_cache).generate(prompt, max_new_tokens=MAX_NEW)
        g = gen(members, align_cache, prompt, params={"safe": True})
        assert (g.output, g.ensembled_steps) == (alone.output, 0)


# ---------------------------------------------------------------------------------------- options
def test_parameters_are_declared_and_checked(members, align_cache):
    assert EnsembleOptions(params={"safe": True}).params == {"safe": True}
    opts = EnsembleOptions(method="unite", params={"k": 3, "safe": True, "safe_n": 8, "safe_lambda": 0})
    assert (opts.params["safe_n"], opts.params["safe_lambda"]) == (8, 0)
    for options, msg in (
            ({"params": {"safe": True, "safe_sharpen": 1.5}}, "params.safe_sharpen: gac: Input should be less than or equal to 1"),
            ({"params": {"safe": True, "safe_n": 0}}, "params.safe_n: gac: Input should be greater than or equal to 1"),
            ({"params": {"safe_n": 3}}, "params.safe_n: a parameter of SAFE; it needs `safe: true`"),
            ({"params": {"safe_lambda": 0.2}}, "params.safe_lambda: a parameter of SAFE"),
            ({"params": {"safe": True}, "gate": "A", "threshold": 0.5, "primary": "B"}, "gate: with `safe` the gate is the primary member (B)"),
            ({"params": {"safe": True}, "speculative": {"draft": "C"}}, "speculative.draft: SAFE drafts with the primary member (A)"),
            ({"params": {"safe": True, "select": 0.5}}, "params.safe: SAFE decides its drafted positions itself; the word-boundary"),
            ({"params": {"safe": True, "prompt_weights": 0.1}}, "params.safe: SAFE decodes in drafted rounds, which prompt_weights does not allow"),
            ({"method": "deepen", "params": {"safe": True}}, "params.safe: deepen: unexpected keyword argument 'safe'")):
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            Ensemble(members, align_cache=align_cache, **options)
    ok = Ensemble(members, align_cache=align_cache, params={"safe": True, "safe_n": 3}, gate="A", threshold=0.5,
                  speculative={"draft": "A"})
    assert ok.describe()["speculative"] == {"draft": "A", "k": 3, "adapt": False}


def test_sampling_and_remote_members_are_refused(members, align_cache):
    ens = Ensemble(members, align_cache=align_cache, params={"safe": True})
    with pytest.raises(ConfigError, match="params.safe: SAFE decodes greedily; set temperature 0"):
        ens.generate("Hi", max_new_tokens=4, sampling=Sampling(temperature=0.7, seed=1))
    away = copy.copy(members[2])
    away.in_process = False  # as a remote or Ray member
    with pytest.raises(ConfigError, match="params.safe: SAFE verifies each drafted chunk .* C does not run in this process"):
        Ensemble([members[0], members[1], away], align_cache=align_cache, params={"safe": True})


# ---------------------------------------------------------------------------------------- eval row
def test_the_safe_row_is_gac_plus_safe():
    cfg = parse_config({"members": [{"name": "a"}, {"name": "b", "score": 0.9}], "params": {"select": 0.7},
                        "speculative": {"k": 6, "draft": "a"}})
    (spec,) = plan_methods(cfg, ["safe"], form="generate", registered=["gac"], log=lambda m: None)
    row = cfg.with_overrides(**spec.overrides)
    assert row.params == {"boundary": False, "safe": True}  # the config's selective rule does not revise SAFE's
    assert (row.primary, row.gate, row.threshold, row.speculative) == ("b", "b", 0.5, None)
