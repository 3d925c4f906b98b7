"""SAFE (``params.safe``, ``tokenfuse.engine.strategies.safe``): the primary drafts, the ensemble
decides only where the members disagree and every tokenizer has a token boundary, sharpening.

Tiny random-weight members on the three real tokenizers (A SmolLM2, B Qwen, C Gemma-3); B is the
primary (the drafter) throughout.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenfuse.alignment.union import END
from tokenfuse.combiners.base import Dist
from tokenfuse.config import parse_config
from tokenfuse.engine import Ensemble, EnsembleOptions
from tokenfuse.engine.strategies import safe as safe_module
from tokenfuse.engine.strategies.safe import Safe, sharpen_row
from tokenfuse.engine.sync import boundary_at_end
from tokenfuse.errors import ConfigError
from tokenfuse.eval.methods import plan_methods

PROMPTS = ["Once upon a time there was", "def f(x):", "日本語"]
MAX_NEW = 16


def gen(members, align_cache, prompt, **options):
    return Ensemble(members, align_cache=align_cache, primary="B", **options).generate(prompt, max_new_tokens=MAX_NEW)


def same_generation(a, b) -> None:
    assert b.output == a.output
    assert (b.steps, b.ensembled_steps, b.skipped_steps, b.vetoed_steps, b.finish_reason) == \
        (a.steps, a.ensembled_steps, a.skipped_steps, a.vetoed_steps, a.finish_reason)
    assert b.member_ids == a.member_ids


@pytest.fixture
def spy(monkeypatch):
    """``boundary_at_end`` as SAFE calls it, recorded: ``calls`` (output length, member, result);
    ``answer`` replaces the real result when set."""
    calls: list[tuple[int, int, bool]] = []
    state = SimpleNamespace(calls=calls, answer=None)

    def recorded(codec, st, output, piece, *, window):
        real = boundary_at_end(codec, st, output, piece, window=window)
        result = real if state.answer is None else state.answer
        calls.append((len(output), id(codec), result))
        return result

    monkeypatch.setattr(safe_module, "boundary_at_end", recorded)
    return state


# ---------------------------------------------------------------------------------------- parameters
def test_parameters_are_declared_and_checked(members):
    assert EnsembleOptions(params={"safe": True}).params == {"safe": True}
    assert EnsembleOptions(method="unite", params={"k": 3, "safe": True, "safe_sharpen": 0}).params["safe_sharpen"] == 0
    for options, msg in (
            ({"params": {"safe": True, "safe_sharpen": 1.5}}, "params.safe_sharpen: gac: Input should be less than or equal to 1"),
            ({"params": {"safe_sharpen": 0.3}}, "params.safe_sharpen: SAFE's sharpening needs `safe: true`"),
            ({"params": {"safe": True}, "gate": "A", "threshold": 0.5}, "params.safe: SAFE has the primary member"),
            ({"params": {"safe": True, "select": 0.5}}, "params.safe: SAFE and selective ensembling"),
            ({"method": "deepen", "params": {"safe": True}}, "params.safe: deepen: unexpected keyword argument 'safe'")):
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            Ensemble(members, **options)


# ---------------------------------------------------------------------------------------- the rule
def test_members_that_agree_with_the_drafter_give_the_primary_alone(make_tiny, align_cache, one_thread):
    """Copies of one model always agree with the draft: the primary's output, nothing ensembled."""
    a, b = make_tiny("gemma3", seed=3, name="A"), make_tiny("gemma3", seed=3, name="B")
    for prompt in PROMPTS:
        alone = Ensemble.single(b, align_cache=align_cache).generate(prompt, max_new_tokens=MAX_NEW)
        g = gen([a, b], align_cache, prompt, params={"safe": True})
        assert (g.output, g.steps, g.ensembled_steps, g.vetoed_steps) == (alone.output, alone.steps, 0, 0)


def test_boundary_at_end_on_real_tokenizers(members, align_cache):
    """After `` So``, ``fa`` makes `` Sofa``: one token for Qwen (B) and Gemma-3 (C), ``So|fa`` for
    SmolLM2 (A); `` the`` starts a new token for all three; END (no piece) ends cleanly."""
    ens = Ensemble(members, align_cache=align_cache)
    s = ens.open("Hi", max_new_tokens=8)
    s.force(ens.space.union.pieces.index(b" So"))
    out = bytes(s.output)

    def clean(piece):
        return [boundary_at_end(ens.space.codecs[i], s.states[i], out, piece, window=s.window) for i in range(3)]

    assert clean(b"fa") == [True, False, False]
    assert clean(b" the") == [True, True, True]
    assert clean(b"") == [True, True, True]
    ens.close(s)


def test_no_clean_boundary_is_the_primary_alone(members, align_cache, spy):
    """Where no position is a clean boundary nothing is ensembled: the primary's output; each step
    the members disagreed on asked the boundary once (a member's ``False`` ends the check) and is vetoed."""
    spy.answer = False
    for prompt in PROMPTS:
        spy.calls.clear()
        alone = Ensemble.single(members[1], align_cache=align_cache).generate(prompt, max_new_tokens=MAX_NEW)
        g = gen(members, align_cache, prompt, params={"safe": True})
        assert (g.output, g.ensembled_steps) == (alone.output, 0)
        assert g.vetoed_steps == len(spy.calls) > 0


def test_every_boundary_clean_without_sharpening_is_plain_gac(members, align_cache, spy):
    """Where every position is clean and sharpening is off, SAFE's choices are GaC's; the steps whose
    piece is not the primary's most likely one are the ensembled ones, each one boundary check per
    member."""
    spy.answer = True
    for prompt in PROMPTS:
        spy.calls.clear()
        plain = gen(members, align_cache, prompt)
        g = gen(members, align_cache, prompt, params={"safe": True, "safe_sharpen": 0})
        assert (g.output, g.steps, g.vetoed_steps) == (plain.output, plain.steps, 0)
        assert plain.ensembled_steps == plain.steps > g.ensembled_steps > 0
        assert len(spy.calls) == 3 * g.ensembled_steps  # every member of every departing step


def test_only_clean_positions_are_ensembled(members, align_cache, spy):
    """With the real boundary test: every step the members disagree on is ensembled exactly where all
    three tokenizers have a boundary, and vetoed where one of them has not."""
    seen = 0
    for prompt in PROMPTS:
        spy.calls.clear()
        g = gen(members, align_cache, prompt, params={"safe": True})
        by_step: dict[int, list[bool]] = {}
        for n, _, ok in spy.calls:
            by_step.setdefault(n, []).append(ok)
        clean = [n for n, oks in by_step.items() if oks == [True] * 3]
        assert all(oks[:-1] == [True] * (len(oks) - 1) and not oks[-1] for n, oks in by_step.items() if n not in clean)
        assert (g.ensembled_steps, g.vetoed_steps) == (len(clean), len(by_step) - len(clean))
        seen += g.vetoed_steps
    assert seen > 0  # the prompts do reach an unclean position


@pytest.mark.parametrize("draft", ["B", "A"])
def test_speculative_decoding_gives_plain_decodings(members, align_cache, draft):
    """The rule is per step, so drafting (by the primary, or another member) and verifying in one
    forward chooses exactly what plain decoding does: output, counters, member ids."""
    for prompt in PROMPTS:
        for params in ({"safe": True}, {"safe": True, "safe_sharpen": 1}):
            a = gen(members, align_cache, prompt, params=params)
            b = gen(members, align_cache, prompt, params=params, speculative={"draft": draft, "k": 4})
            same_generation(a, b)
            assert b.drafted > 0 and 0 <= b.accepted <= b.drafted


# ---------------------------------------------------------------------------------------- sharpening
PIECES = {0: b"", 1: b" Sof", 2: b" Sofia", 3: b" So", 4: b" the", 5: b" th", 6: b"x"}


def test_sharpening_moves_sub_word_mass_to_the_longest_extension():
    p = torch.tensor([0.1, 0.3, 0.25, 0.2, 0.08, 0.04, 0.03], dtype=torch.float64)
    sharpen_row(p, lambda c: c, PIECES.__getitem__)
    # " So" -> " Sof" (its most likely extension) -> " Sofia"; " th" -> " the"; END and "x" stay
    assert p.tolist() == pytest.approx([0.1, 0.0, 0.75, 0.0, 0.12, 0.0, 0.03], abs=1e-12)
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-12)


def test_sharpening_applies_below_the_threshold_only():
    """Rows whose top probability is at or above ``safe_sharpen`` are left as they are; ``0`` never sharpens."""
    probs = torch.tensor([[0.1, 0.3, 0.25, 0.2, 0.08, 0.04, 0.03],
                          [0.0, 0.6, 0.1, 0.3, 0.0, 0.0, 0.0]])
    dist = Dist(probs.clone(), index=torch.arange(7).expand(2, -1))
    space = SimpleNamespace(piece=PIECES.__getitem__)
    for sharpen, row0, row1 in ((0.5, [0.1, 0.0, 0.75, 0.0, 0.12, 0.0, 0.03], probs[1].tolist()),
                                (0.7, [0.1, 0.0, 0.75, 0.0, 0.12, 0.0, 0.03], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]),
                                (0.0, probs[0].tolist(), probs[1].tolist())):
        st = Safe(EnsembleOptions(params={"safe": True, "safe_sharpen": sharpen}))
        st.bind(SimpleNamespace(space=space))
        out = st.reshape(dist)
        assert out.probs[0].tolist() == pytest.approx(row0, abs=1e-6)
        assert out.probs[1].tolist() == pytest.approx(row1, abs=1e-6)
    assert torch.equal(dist.probs, probs)  # the combiner's distribution itself is untouched
    assert END == 0


# ---------------------------------------------------------------------------------------- eval row
def test_the_safe_row_drafts_with_the_primary():
    cfg = parse_config({"members": [{"name": "a"}, {"name": "b", "score": 0.9}], "params": {"select": 0.7},
                        "speculative": {"k": 6}})
    (spec,) = plan_methods(cfg, ["safe"], form="generate", registered=["gac"], log=lambda m: None)
    row = cfg.with_overrides(**spec.overrides)
    assert row.params == {"select": None, "safe": True, "safe_sharpen": 0.5}
    assert (row.primary, row.speculative.draft, row.speculative.k, row.gate) == ("b", "b", 6, None)
