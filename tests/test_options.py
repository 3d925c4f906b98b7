"""What an ensemble is, as one value (``EnsembleOptions``), its one self-description
(``Ensemble.describe``), variants on loaded members (``Ensemble.variant``) and strategies that plug
into the step decision without touching it (``tokenfuse.engine.strategies.register``)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from tokenfuse.alignment.union import END
from tokenfuse.config import parse_config
from tokenfuse.engine import Ensemble, EnsembleOptions
from tokenfuse.engine.strategies import STRATEGIES, Strategy, register
from tokenfuse.errors import ConfigError

PROMPT = "Once upon a time there was"


def test_options_are_frozen_and_validated_once():
    o = EnsembleOptions(method="unite", params={"k": 3}, gate="A", threshold=0.4)
    with pytest.raises(ValidationError):
        o.method = "gac"
    with pytest.raises(ValidationError, match="params.select: selective ensembling gates on the primary member"):
        EnsembleOptions(params={"select": 0.5}, gate="A", threshold=0.5)
    with pytest.raises(ValidationError, match="threshold: gate 'A' needs a threshold"):
        EnsembleOptions(gate="A")
    with pytest.raises(ValidationError, match="params.k: unite: k must be a positive integer"):
        EnsembleOptions(method="unite", params={"k": 0})
    with pytest.raises(ValidationError, match=r"params.colour: gac: unexpected keyword argument 'colour' \(known: boundary"):
        EnsembleOptions(params={"colour": 1})


def test_the_old_spelling_of_selective_ensembling_is_thresholded_mode_on_the_primary():
    """``params.select`` (with ``select_boundary``) reads as ``threshold`` with ``params.boundary``, with a warning."""
    with pytest.warns(FutureWarning, match=r"params.select is now spelled `threshold` \(the gate: the primary member\)"):
        old = EnsembleOptions(method="unite", params={"k": 3, "select": 0.4})
    assert old == EnsembleOptions(method="unite", params={"k": 3, "boundary": True}, threshold=0.4)
    with pytest.warns(FutureWarning):
        off = EnsembleOptions(params={"select": 0.4, "select_boundary": False})
    assert off == EnsembleOptions(threshold=0.4, params={"boundary": False})
    assert EnsembleOptions(params={"select": None}) == EnsembleOptions()  # null: off
    with pytest.raises(ValidationError, match="params.select: gac: Input should be less than or equal to 1"):
        EnsembleOptions(params={"select": 2})
    with pytest.raises(ValidationError, match="params.boundary: the word-boundary rule of thresholded mode; it needs `threshold`"):
        EnsembleOptions(params={"boundary": True})


def test_replace_is_the_override_rule():
    o = EnsembleOptions(method="unite", params={"k": 3, "boundary": True}, threshold=0.5, gate=None)
    assert o.replace(params={"k": 4}).params == {"k": 4, "boundary": True}  # merged key by key
    assert o.replace(method="unite").params == {"k": 3, "boundary": True}  # the same method keeps them
    assert o.replace(method="gac").params == {}  # another method's parameters do not carry over
    gated = o.replace(params={"boundary": False}, gate="A", threshold=0.3)
    assert (gated.gate, gated.threshold) == ("A", 0.3) and gated.replace(gate=None, threshold=None).gate is None
    assert o.replace(speculative={"k": 2}).speculative.k == 2
    with pytest.raises(ValidationError, match="speculative.k"):
        o.replace(speculative={"k": 0})
    cfg = parse_config({"members": [{"name": "A"}, {"name": "B"}], "method": "unite", "params": {"k": 3}})
    assert cfg.options == EnsembleOptions(method="unite", params={"k": 3})  # a config is its options + the rest
    assert cfg.with_overrides(method="gac").options == cfg.options.replace(method="gac")


def test_members_are_checked_against_the_options(members):
    with pytest.raises(ConfigError, match=r"gate: 'Z' is not a member \(members: A, B, C\)"):
        Ensemble(members, gate="Z", threshold=0.5)
    with pytest.raises(ConfigError, match="speculative.draft: 'Z' is not a member"):
        Ensemble(members, EnsembleOptions(speculative={"draft": "Z"}))
    with pytest.raises(ConfigError, match="members: names must be unique; repeated: A"):
        Ensemble([members[0], members[0]])


def test_describe_is_the_one_self_description(members, align_cache):
    ens = Ensemble(members, EnsembleOptions(method="unite", params={"k": 4}, gate="B", threshold=0.3,
                                            speculative={"k": 2}), align_cache=align_cache)
    d = ens.describe()
    assert d == {"members": [{"name": "A", "weight": 1.0}, {"name": "B", "weight": 1.0}, {"name": "C", "weight": 1.0}],
                 "method": "unite", "params": {"k": 4}, "primary": "A", "agreement_skip": None, "gate": "B",
                 "threshold": 0.3, "window": 8, "scoring": "one-forward", "parallel": True,
                 "speculative": {"draft": d["speculative"]["draft"], "k": 2, "adapt": True}}
    assert d["speculative"]["draft"] in {"A", "B", "C"}
    assert Ensemble(members, primary="C", align_cache=align_cache).describe()["primary"] == "C"


def test_a_variant_shares_the_members_and_the_union(members, align_cache):
    base = Ensemble(members, align_cache=align_cache)
    v = base.variant(base.options.replace(method="unite"), weights={"C": 0.0})
    assert v.union is base.union and [m.name for m in v.members] == ["A", "B", "C"]
    assert [m["weight"] for m in v.describe()["members"]] == [1.0, 1.0, 0.0] and v.describe()["method"] == "unite"
    assert all(x is y for x, y in zip(v.members, base.members))  # the same member objects, other weights
    assert base.weights == [1.0, 1.0, 1.0] and v.weights == [1.0, 1.0, 0.0]
    assert [m.weight for m in base.members] == [1.0, 1.0, 1.0]  # the members themselves keep their weights
    pair = Ensemble(members[:2], method="unite", align_cache=align_cache)
    assert v.generate(PROMPT, max_new_tokens=8).text == pair.generate(PROMPT, max_new_tokens=8).text


def test_members_shared_by_ensembles_are_never_written(make_tiny, one_thread, tmp_path):
    """One loaded pair of members serves several ensembles with their own weights and scores (a
    ``variant``, ``load.ensemble_from_members``): none writes a member attribute, and each decides
    exactly as an ensemble built fresh on new member objects whose own default weights are its weights."""
    from tokenfuse.load import ensemble_from_members

    align = tmp_path / "alignment"
    a, b = make_tiny("smollm2", seed=0, name="A"), make_tiny("qwen", seed=1, name="B")
    base = Ensemble([a, b], align_cache=align)
    base.generate(PROMPT, max_new_tokens=2)  # what a member makes at its first forward (a row store) is made
    before = [dict(vars(m)) for m in (a, b)]
    heavy_a = base.variant(weights={"A": 50.0})
    cfg = parse_config({"members": [{"name": "A", "source": "smollm2-135m-instruct", "weight": 1.0, "score": 0.4},
                                    {"name": "B", "source": "qwen2.5-coder-0.5b-instruct", "weight": 50.0,
                                     "score": 0.6}], "cache_dir": str(tmp_path)})
    heavy_b = ensemble_from_members(cfg, [a, b], union=base.union)
    assert all(e.members[0] is a and e.members[1] is b for e in (base, heavy_a, heavy_b))
    assert (base.weights, heavy_a.weights, heavy_b.weights) == ([1.0, 1.0], [50.0, 1.0], [1.0, 50.0])
    assert (base.scores, heavy_a.scores, heavy_b.scores) == ([None, None], [None, None], [0.4, 0.6])
    assert heavy_b.describe()["members"] == [{"name": "A", "weight": 1.0, "score": 0.4},
                                             {"name": "B", "weight": 50.0, "score": 0.6}]
    assert (base.describe()["primary"], heavy_b.describe()["primary"]) == ("A", "B")  # B: the higher score
    # the three decide in turns on the same member objects, and again after each other
    got = {name: ens.generate(PROMPT, max_new_tokens=8) for name, ens in
           (("base", base), ("a", heavy_a), ("b", heavy_b))}
    assert heavy_a.generate(PROMPT, max_new_tokens=8).output == got["a"].output
    for m, was in zip((a, b), before):  # nothing of either member was written
        assert vars(m).keys() == was.keys() and all(v is was[k] for k, v in vars(m).items()), m.name
    assert (a.weight, b.weight) == (1.0, 1.0) and not hasattr(a, "score") and not hasattr(b, "score")
    for name, w, scores in (("base", (1.0, 1.0), None), ("a", (50.0, 1.0), None), ("b", (1.0, 50.0), [0.4, 0.6])):
        fresh = [make_tiny("smollm2", seed=0, name="A", weight=w[0]), make_tiny("qwen", seed=1, name="B", weight=w[1])]
        want = Ensemble(fresh, scores=scores, align_cache=align).generate(PROMPT, max_new_tokens=8)
        assert (got[name].output, got[name].member_ids, got[name].steps) == (want.output, want.member_ids, want.steps)
    assert len({g.output for g in got.values()}) == 3  # the weights matter: three different outputs


class _EndParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    end_at_once: bool = False


class _EndAtOnce(Strategy):
    """A plug-in for the test: every combined choice becomes END."""

    name = "end_at_once"
    Params = _EndParams

    @classmethod
    def wanted(cls, options) -> bool:
        return bool(options.params.get("end_at_once"))

    def revise(self, seqs, members, outs, chosen):
        for r in chosen:
            chosen[r] = END
        return set(chosen)


def test_a_strategy_plugs_in_without_touching_the_decision(members, align_cache):
    register(_EndAtOnce)
    try:
        g = Ensemble(members, params={"end_at_once": True}, agreement_skip=False,
                     align_cache=align_cache).generate(PROMPT, max_new_tokens=8)
        assert (g.steps, g.finish_reason, g.vetoed_steps, g.text) == (0, "end", 1, "")
        plain = Ensemble(members, align_cache=align_cache).generate(PROMPT, max_new_tokens=8)
        assert plain.steps == 8
        with pytest.raises(ConfigError, match="params.end_at_once: deepen: unexpected keyword argument"):
            Ensemble(members, method="deepen", params={"end_at_once": True})
    finally:
        STRATEGIES.remove(_EndAtOnce)
    with pytest.raises(ConfigError, match="unexpected keyword argument 'end_at_once'"):
        Ensemble(members, params={"end_at_once": True})
