"""The likelihood form's proper scores (tokenfuse.eval.proper): NLL and Brier of the softmax over the
options' summed log-likelihoods, paired against the best member, in results.json and its tables."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from tokenfuse.config import config_from_models
from tokenfuse.eval import pages
from tokenfuse.eval.proper import item_scores, option_distribution, proper_scores
from tokenfuse.eval.records import append_records, item_file
from tokenfuse.eval.report import markdown_table
from tokenfuse.eval.summary import summarise
from tokenfuse.eval.runner import EvalSettings

ROOT = Path(__file__).resolve().parents[1]


def test_item_scores_by_hand():
    lp = [math.log(0.2), math.log(0.6)]  # p = 0.25 / 0.75 after the renormalisation over the options
    assert option_distribution(lp) == pytest.approx([0.25, 0.75])
    nll, brier = item_scores(lp, gold=0)
    assert nll == pytest.approx(math.log(4))
    assert brier == pytest.approx(0.75 ** 2 + 0.75 ** 2)
    nll, brier = item_scores(lp, gold=1)
    assert nll == pytest.approx(-math.log(0.75)) and brier == pytest.approx(2 * 0.25 ** 2)
    # Summed log-likelihoods far below 0 (long options): computed in log space, no underflow.
    nll, _ = item_scores([-1000.0, -1001.0, -1003.0], gold=2)
    assert nll == pytest.approx(3 + math.log(1 + math.exp(-1) + math.exp(-3)))
    # An excluded gold option (-inf, another finite): probability 0; every option -inf: no distribution.
    nll, brier = item_scores([-math.inf, -2.0], gold=0)
    assert nll == math.inf and brier == pytest.approx(2.0)
    assert item_scores([-math.inf, -math.inf], gold=0) is None


def _recs(lps, gold=0, **kw):
    return [{"id": str(i), "gold": gold, "logprobs": lp, "bytes": [1] * len(lp),
             "correct": max(range(len(lp)), key=lambda k: lp[k]) == gold, **kw} for i, lp in enumerate(lps)]


def _records():
    """piqa, 4 items, gold option 0: member a sure and right on 3, sure and wrong on one; b unsure and
    a little wrong throughout; gac in between; vote without option scores; contrast with an item it excludes."""
    sure, wrong, unsure = [0.0, -10.0], [-10.0, 0.0], [-1.0, -0.7]
    return {"piqa": {"single:a-model": _recs([sure, sure, sure, wrong]),
                     "single:b-model": _recs([unsure] * 4),
                     "gac": _recs([[-1.0, -2.5]] * 3 + [[-2.0, -1.0]]),
                     "vote": [{"id": str(i), "gold": 0, "correct": True} for i in range(4)],
                     "contrast": _recs([sure, [-math.inf, -math.inf], sure, sure])},
            "gsm8k": {"single:a-model": [{"id": "g", "correct": True}], "single:b-model": [{"id": "g", "correct": False}]}}


def test_proper_scores_in_results_json_and_the_tables():
    results = summarise(config_from_models("a-model,b-model"), EvalSettings(tasks=["piqa", "gsm8k"]), _records(),
                        {"piqa": "likelihood", "gsm8k": "generate"})
    per = results["tasks"]["piqa"]
    a = [item_scores(lp, 0) for lp in ([0.0, -10.0],) * 3 + ([-10.0, 0.0],)]
    b = item_scores([-1.0, -0.7], 0)
    assert per["single:a-model"]["proper"]["nll"] == pytest.approx(sum(x[0] for x in a) / 4)
    assert per["single:b-model"]["proper"] == pytest.approx({"nll": b[0], "brier": b[1], "n": 4})
    # The best member by each score: b by NLL (a's one confident miss costs 10 nats), a by Brier (at most 2 an item).
    assert results["proper"]["best"] == {"piqa": {"nll": "single:b-model", "brier": "single:a-model"}}
    assert results["proper"]["score"] == "sum" and results["proper"]["uniform"]["piqa"] == pytest.approx(
        {"nll": math.log(2), "brier": 0.5})
    g = [item_scores(lp, 0) for lp in ([-1.0, -2.5],) * 3 + ([-2.0, -1.0],)]
    v = per["gac"]["proper"]["vs_best"]
    assert v["nll"]["member"] == "single:b-model"
    assert v["nll"]["diff"] == pytest.approx(sum(x[0] for x in g) / 4 - b[0])
    assert v["brier"]["member"] == "single:a-model"
    assert v["brier"]["diff"] == pytest.approx(sum(x[1] - y[1] for x, y in zip(g, a)) / 4)
    lo, hi = v["brier"]["ci"]
    assert lo <= v["brier"]["diff"] <= hi
    assert "proper" not in per["vote"]  # it chooses an option: no distribution
    assert per["contrast"]["proper"] == {"nll": None, "brier": None, "n": 4, "undefined": 1}
    assert "proper" not in results["tasks"]["gsm8k"]["single:a-model"]

    tables = pages.sections(markdown_table(results))
    assert tables["proper"][0][:3] == ["method", "piqa NLL", "piqa Brier"]
    assert [row[0] for row in tables["proper"][1:]] == ["single:a-model", "single:b-model", "gac", "contrast",
                                                        "uniform"]
    assert tables["proper"][-1] == ["uniform", "0.693", "0.500"]
    assert tables["proper"][4] == ["contrast", "—", "—"]
    gain = {row[0]: row[1:] for row in tables["proper_gain"][1:]}
    assert list(gain) == ["gac", "contrast"]
    assert gain["gac"] == ["-0.375 [-0.653, +0.181]", "-0.183 [-0.682, +0.067]"]  # a gain (negative), not bold
    assert gain["contrast"] == ["—", "—"]
    cut = pages.cut(tables, ["proper", "proper_gain"], ["piqa"], ["gac"])
    assert cut.splitlines()[0] == ("| method | piqa NLL | piqa Brier | proper_gain: piqa NLL | "
                                   "proper_gain: piqa Brier |")


def test_no_option_scores_no_proper_section():
    recs = {"piqa": {"single:a-model": [{"id": "1", "correct": True}], "gac": [{"id": "1", "correct": True}]}}
    results = summarise(config_from_models("a-model,b-model"), EvalSettings(tasks=["piqa"]), recs,
                        {"piqa": "likelihood"})
    assert "proper" not in results and "Proper scores" not in markdown_table(results)
    assert proper_scores(results["tasks"], recs, {"piqa": "likelihood"}) is None


def _script():
    spec = importlib.util.spec_from_file_location("proper_scores", ROOT / "scripts" / "results" / "proper_scores.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_adds_the_scores_from_the_records_and_nothing_else(tmp_path):
    recs = _records()
    results = summarise(config_from_models("a-model,b-model"), EvalSettings(tasks=["piqa", "gsm8k"]), recs,
                        {"piqa": "likelihood", "gsm8k": "generate"})
    expected = json.loads(json.dumps(results))
    old = json.loads(json.dumps(results))  # as a run aggregated before the proper scores wrote it
    del old["proper"]
    for per in old["tasks"].values():
        for c in per.values():
            c.pop("proper", None)
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    (run / "results.json").write_text(json.dumps(old), encoding="utf-8")
    for m, rows in recs["piqa"].items():
        append_records(item_file(out, "piqa", "likelihood", m), rows)
    assert _script().main([str(run), "--records", str(out)]) == 0
    assert json.loads((run / "results.json").read_text(encoding="utf-8")) == expected
    # Records that did not make the results.json: refused.
    append_records(item_file(out, "piqa", "likelihood", "gac"), _recs([[-9.0, 0.0]], gold=0))  # item 0 now wrong
    with pytest.raises(SystemExit, match="not the records it was aggregated from"):
        _script().main([str(run), "--records", str(out)])


def test_a_worse_row_is_bold_and_an_infinite_nll_has_no_interval():
    from tokenfuse.eval.report import _diff_cell

    assert _diff_cell({"diff": 0.1, "ci": [0.05, 0.2]}) == "**+0.100** [+0.050, +0.200]†"
    assert _diff_cell({"diff": -0.02, "ci": [-0.05, 0.01]}) == "-0.020 [-0.050, +0.010]"
    assert _diff_cell({"diff": math.inf, "ci": None}) == "**+∞**"
