"""tokenfuse eval: vote/MBR scoring, bootstrap intervals, resumable runs, the table, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from tokenfuse.combiners.mixers import ONLINE_RATES
from tokenfuse.engine import Likelihood
from tokenfuse.config import config_from_models, parse_config
from tokenfuse.eval.methods import MethodSpec, answer_key, majority_vote, mbr_select, parse_methods, plan_methods
from tokenfuse.eval.report import markdown_table
from tokenfuse.eval.summary import summarise
from tokenfuse.eval.runner import EvalSettings, run_eval
from tokenfuse.eval.stats import bootstrap_ci, paired_bootstrap, paired_bootstrap_mean
from tokenfuse.errors import TokenfuseError

pytest.importorskip("sacrebleu")


# ---------------------------------------------------------------------------------------- vote / MBR
def test_answer_key_numbers_letters_and_text():
    assert answer_key("18") == answer_key("18.0") == answer_key("18.00") == "#18"
    assert answer_key("1,200") == "#1200"
    assert answer_key("A") == "a" and answer_key("(B)") == "b"  # a lone letter survives normalisation
    assert answer_key("The Eiffel Tower.") == answer_key("eiffel tower") == "eiffel tower"
    assert answer_key(None) is None and answer_key("  ") is None


def test_majority_vote():
    assert majority_vote(["18", "7", "18.0"]) == 0  # numeric equality: 2 votes for 18
    assert majority_vote(["7", "18", "18.0"], primary=0) == 1  # majority beats the primary member
    assert majority_vote(["A", "B", "C"], primary=2) == 2  # three-way tie: the primary member
    assert majority_vote(["A", "B", None], primary=2) == 0  # primary abstains: first tied member
    assert majority_vote([None, "paris", "Paris."], primary=0) == 1
    assert majority_vote([None, None, None], primary=1) == 1  # nobody answered: the primary's output


def test_mbr_select():
    outs = ["The capital of France is Paris", "Paris is the capital of France", "Bananas are yellow"]
    assert mbr_select(outs) == 0  # highest mean chrF to the others (0 and 1 are close; 0 is ahead)
    assert mbr_select(["x", "x", "y"], primary=2) == 0  # two agreeing outputs beat the primary
    assert mbr_select(["same", "same"], primary=1) == 1  # exact tie: the primary member
    assert mbr_select(["only"]) == 0


def test_vote_and_mbr_on_packed_records_without_outputs():
    """Published records may have their ``output`` removed (option texts): vote needs only the
    extracted answers; MBR compares outputs and says which records lack them instead of failing
    with a KeyError."""
    from types import SimpleNamespace

    from tokenfuse.eval.rows import output_record

    task, item = SimpleNamespace(name="mmlu"), {"id": "q1"}
    singles = [{"extracted": "B", "correct": False}, {"extracted": "C", "correct": True},
               {"extracted": "C", "correct": True, "output": "(C)"}]
    spec = lambda name: MethodSpec(name, "output", ("smol", "gemma", "qwen"))  # noqa: E731
    vote = output_record(spec("vote"), task, item, singles, primary=0, form="generate")
    assert vote == {"id": "q1", "output": None, "extracted": "C", "correct": True, "chosen": "gemma"}
    with pytest.raises(TokenfuseError, match=r"records of smol, gemma on mmlu item q1 have no 'output'"):
        output_record(spec("mbr"), task, item, singles, primary=0, form="generate")


def test_bootstrap_ci_fixed_seed():
    values = [1] * 6 + [0] * 4
    assert bootstrap_ci(values, seed=0) == pytest.approx((0.3, 0.9))
    assert bootstrap_ci(values, seed=0) == bootstrap_ci(values, seed=0)
    assert bootstrap_ci([1, 1, 1]) == (1.0, 1.0)
    lo, hi = bootstrap_ci([])
    assert lo != lo and hi != hi  # NaN


def test_paired_bootstrap_resamples_the_differences():
    a, b = [1, 1, 1, 0, 1, 0, 1, 1, 0, 1], [0, 1, 0, 0, 1, 0, 1, 0, 0, 1]
    d, lo, hi = paired_bootstrap(a, b)
    assert (d, hi) == (pytest.approx(0.3), pytest.approx(0.6)) and lo == pytest.approx(0.0975)
    assert (lo, hi) == bootstrap_ci([x - y for x, y in zip(a, b)])  # the same draws, on the differences
    # Unpaired, the two intervals overlap (40-100 against 10-70): pairing is what separates them.
    assert bootstrap_ci(a) == pytest.approx((0.4, 1.0)) and bootstrap_ci(b) == pytest.approx((0.1, 0.7))
    assert paired_bootstrap(a, a) == (0.0, 0.0, 0.0)
    assert paired_bootstrap([1, 1], [0, 0]) == (1.0, 1.0, 1.0)
    assert all(x != x for x in paired_bootstrap([], []))
    with pytest.raises(ValueError, match="3 against 2 items"):
        paired_bootstrap([1, 0, 1], [1, 0])


def test_paired_bootstrap_mean_stratified_over_tasks():
    import numpy as np

    a, b = [1, 1, 1, 0, 1, 0, 1, 1, 0, 1], [0, 1, 0, 0, 1, 0, 1, 0, 0, 1]
    c, e = [1, 0, 0, 0], [1, 1, 0, 0]
    assert paired_bootstrap_mean([(a, b)]) == paired_bootstrap(a, b)
    got = paired_bootstrap_mean([(a, b), (c, e)])
    # By hand: one generator, each task's items drawn separately in task order, then the mean of the task means.
    rng = np.random.default_rng(0)
    da, dc = np.subtract(a, b), np.subtract(c, e)
    means = (da[rng.integers(0, 10, size=(1000, 10))].mean(1) + dc[rng.integers(0, 4, size=(1000, 4))].mean(1)) / 2
    assert got == (pytest.approx((0.3 - 0.25) / 2), *np.quantile(means, [0.025, 0.975]).tolist())
    assert got[1:] == (pytest.approx(-0.25), pytest.approx(0.25))
    # Every resample of (+1 on one task, -1 on the other) averages to 0.
    assert paired_bootstrap_mean([([1] * 5, [0] * 5), ([0, 0], [1, 1])]) == (0.0, 0.0, 0.0)
    assert all(x != x for x in paired_bootstrap_mean([(a, b), ([], [])]))


# ---------------------------------------------------------------------------------------- planning
def test_parse_and_plan_methods():
    with pytest.raises(TokenfuseError, match="did you mean 'vote'"):
        parse_methods("single,vot")
    cfg = config_from_models("smollm2-135m-instruct,gemma3-270m")
    logs: list[str] = []
    gen = plan_methods(cfg, parse_methods("single,gac,gac-threshold,deepen,vote"), form="generate",
                       registered=["gac", "unite"], log=logs.append)
    assert [s.name for s in gen] == ["single:smollm2-135m-instruct", "single:gemma3-270m", "gac", "gac-threshold",
                                     "vote"]
    assert gen[3].overrides["gate"] == "smollm2-135m-instruct" and gen[3].overrides["threshold"] == 0.5
    assert any("deepen: skipped" in m for m in logs)
    lik = plan_methods(cfg, ["gac", "gac-threshold", "mbr"], form="likelihood", registered=["gac"], log=logs.append)
    assert [s.name for s in lik] == ["single:smollm2-135m-instruct", "single:gemma3-270m", "gac", "gac-threshold",
                                     "mbr", "seq-avg"]
    assert lik[3].overrides["gate"] == "smollm2-135m-instruct"


def test_engine_rows_are_config_overrides():
    """Each engine row is the config with the row's overrides: the config's params only for its own method."""
    from tokenfuse.config import parse_config

    cfg = parse_config({"members": [{"name": "a"}, {"name": "b"}], "method": "unite", "params": {"k": 5},
                        "gate": "b", "threshold": 0.2})
    specs = plan_methods(cfg, ["gac", "gac-threshold", "unite"], form="generate", registered=["gac", "unite"],
                         log=lambda m: None)
    rows = {s.name: cfg.with_overrides(**s.overrides) for s in specs if s.overrides}
    assert (rows["unite"].method, rows["unite"].params, rows["unite"].gate) == ("unite", {"k": 5}, None)
    assert (rows["gac"].method, rows["gac"].params, rows["gac"].gate, rows["gac"].threshold) == ("gac", {}, None, None)
    assert (rows["gac-threshold"].params, rows["gac-threshold"].gate, rows["gac-threshold"].threshold) == ({}, "b", 0.2)


def test_adaptive_rows():
    from tokenfuse.config import parse_config

    cfg = parse_config({"members": [{"name": "a"}, {"name": "b"}], "params": {"select": 0.7}})
    names = ["gac", "gac-threshold", "gac-select", "gac-conf", "gac-prompt"]
    gen = {s.name: s for s in plan_methods(cfg, names, form="generate", registered=["gac"], log=lambda m: None)}
    lik = {s.name: s for s in plan_methods(cfg, names, form="likelihood", registered=["gac"], log=lambda m: None)}
    rows = {n: cfg.with_overrides(**s.overrides) for n, s in gen.items() if s.overrides}
    assert (rows["gac"].params, rows["gac"].threshold) == ({"boundary": False}, None)  # every step; the rest of the
    # config's params stay with its own method (below), its thresholded mode is gac-threshold's
    thresholded = ("a", 0.7, {"boundary": True})  # the config's (its old spelling: the primary gating at 0.7)
    assert (rows["gac-threshold"].gate, rows["gac-threshold"].threshold, rows["gac-threshold"].params) == thresholded
    assert (rows["gac-select"].gate, rows["gac-select"].threshold, rows["gac-select"].params) == thresholded
    assert rows["gac-conf"].params == {"boundary": True, "confidence": "entropy"}  # the default, beside the config's
    assert rows["gac-prompt"].params == {"boundary": True, "prompt_weights": 0.1, "prompt_bytes": 512}
    assert rows["gac-conf"].threshold == rows["gac-prompt"].threshold == 0.7
    assert rows["gac-prompt"].scoring == "one-forward"
    assert "scoring" not in lik["gac-prompt"].overrides and "scoring" not in lik["gac-conf"].overrides
    other = parse_config({"members": [{"name": "a"}, {"name": "b"}], "method": "unite", "params": {"k": 3}})
    sel = plan_methods(other, ["gac-select"], form="generate", registered=["gac"], log=lambda m: None)[-1]
    row = other.with_overrides(**sel.overrides)
    assert (row.params, row.gate, row.threshold) == ({"boundary": True}, "a", 0.5)  # unite's params stay with unite
    with pytest.warns(FutureWarning, match=r"--methods: gac-select is now gac-threshold with params.boundary: true"):
        assert parse_methods("gac,gac-select") == ["gac", "gac-select"]


def test_byte_rows_are_the_byte_method_with_its_mixer():
    """``byte-mix`` and ``byte-gate``: the byte method with ``mix`` mixture and gate; a config whose method
    is ``byte`` gives them its fit file, its other parameters stay its own."""
    from tokenfuse.config import parse_config

    cfg = parse_config({"members": [{"name": "a"}, {"name": "b"}]})
    specs = plan_methods(cfg, ["byte-mix", "byte-gate", "byte-online"], form="likelihood", registered=["gac", "byte"],
                         log=lambda m: None)
    rows = {s.name: cfg.with_overrides(**s.overrides) for s in specs if s.overrides}
    assert (rows["byte-mix"].method, rows["byte-mix"].params) == ("byte", {"mix": "mixture"})
    assert rows["byte-gate"].params == {"mix": "gate"} and rows["byte-online"].params == {"mix": "online"}
    own = parse_config({"members": [{"name": "a"}, {"name": "b"}], "method": "byte",
                        "params": {"fit": "fit.json", "mix": "switch", "alpha": 0.2}})
    specs = plan_methods(own, ["byte-gate"], form="generate", registered=["byte"], log=lambda m: None)
    assert own.with_overrides(**specs[-1].overrides).params == {"fit": "fit.json", "mix": "gate", "alpha": 0.2}
    logs: list[str] = []
    assert not [s for s in plan_methods(cfg, ["byte-mix"], form="generate", registered=["gac"], log=logs.append)
                if s.name == "byte-mix"] and any("byte-mix: skipped" in m for m in logs)


# ---------------------------------------------------------------------------------------- table
def _rec(i, correct, **kw):
    return {"id": str(i), "correct": correct, **kw}


def test_markdown_table_shape():
    cfg = config_from_models("a-model,b-model")
    recs = {
        "piqa": {
            "single:a-model": [_rec(i, c, correct_raw=c, seconds=1.0, steps=4) for i, c in enumerate([1, 1, 0, 0])],
            "single:b-model": [_rec(i, c, correct_raw=not c, seconds=2.0, steps=4) for i, c in enumerate([1, 0, 0, 0])],
            "gac": [_rec(i, c, correct_raw=c, seconds=3.0, steps=4) for i, c in enumerate([1, 1, 1, 0])],
            "vote": [_rec(i, c, correct_raw=c) for i, c in enumerate([1, 0, 0, 0])],
        },
        "gsm8k": {
            "single:a-model": [_rec(i, c, seconds=1.0, steps=10, ensembled=0) for i, c in enumerate([0, 0, 0, 1])],
            "single:b-model": [_rec(i, c, seconds=1.0, steps=10, ensembled=0) for i, c in enumerate([1, 1, 0, 0])],
            "gac": [_rec(i, c, seconds=2.0, steps=10, ensembled=5) for i, c in enumerate([1, 0, 0, 0])],
            "vote": [_rec(i, c) for i, c in enumerate([0, 0, 0, 1])],
        },
    }
    results = summarise(cfg, EvalSettings(tasks=["piqa", "gsm8k"]), recs, {"piqa": "likelihood", "gsm8k": "generate"})
    assert results["best_member"] == "single:a-model"  # both average 37.5: the first listed
    table = markdown_table(results).splitlines()
    assert table[0] == ("| method | piqa (4) | gsm8k (4) | Avg. | Δ best | ms/token (share) | ens. % | "
                        "items/min (share) |")
    assert table[2] == "| single:a-model | 50.0 | 25.0 | 37.5 | +0.0 | 100 | 0 | 60.0 |"
    assert table[3] == "| single:b-model | 25.0 | 50.0 | 37.5 | +0.0 | 100 | 0 | 40.0 |"
    assert table[4] == "| gac | 75.0 | 25.0 | 50.0 | +12.5 | 200 | 50 | 24.0 |"
    assert table[5] == "| vote | 25.0 | 25.0 | 25.0 | -12.5 | — | — | — |"
    assert table[7].startswith("`ms/token (share)`, `items/min (share)`: from a row's share of the time")
    # The tasks' wall time: the rows' batches one after another (piqa 4 + 8 + 12 s, gsm8k 4 + 4 + 8 s).
    wall = table[table.index("| task | items | rows timed | wall (s) | items/min (wall) |"):]
    assert wall[2:5] == ["| piqa | 4 | 3 | 24 | 10.0 |", "| gsm8k | 4 | 3 | 16 | 15.0 |",
                         "| all tasks | 8 | — | 40 | 12.0 |"]
    assert results["task_wall"]["piqa"] == {"seconds": 24.0, "items": 4, "rows": 3, "items_per_min": 10.0}
    head = "| method | piqa | gsm8k | Avg. vs single:a-model | Avg. vs per-task best |"
    gain = table[table.index(head):]
    # per task against that task's best member (piqa: a, gsm8k: b); the average against a (the best
    # average), then against a on piqa and b on gsm8k
    assert gain[2] == ("| gac | +25.0 [+0.0, +75.0] | **-25.0** [-75.0, +0.0] | +12.5 [-25.0, +50.0] | "
                       "+0.0 [-25.0, +25.0] |")
    assert gain[3] == ("| vote | **-25.0** [-75.0, +0.0] | **-25.0** [-100.0, +50.0] | **-12.5** [-37.5, +0.0] | "
                       "**-25.0** [-75.0, +12.8] |")
    assert "piqa: likelihood, gsm8k: generate" in table[-1]
    gac = results["tasks"]["gsm8k"]["gac"]["vs_best"]
    assert (gac["member"], gac["gain"], gac["ci"]) == ("single:b-model", -0.25, [-0.75, 0.0])
    assert "vs_best" not in results["tasks"]["gsm8k"]["single:a-model"]
    ov = results["overview"]["gac"]
    assert (ov["vs_best"]["member"], ov["vs_best"]["gain"], ov["vs_best"]["ci"]) == ("single:a-model", 0.125,
                                                                                    [-0.25, 0.5])
    assert ov["vs_task_best"] == {"members": {"piqa": "single:a-model", "gsm8k": "single:b-model"}, "gain": 0.0,
                                  "ci": [-0.25, 0.25]}
    # A significant gain gets its mark: gac right on every item where the best member is wrong.
    recs["piqa"]["gac"] = [_rec(i, 1, correct_raw=1, seconds=3.0, steps=4) for i in range(4)]
    recs["piqa"]["single:b-model"] = [_rec(i, 0, correct_raw=0, seconds=2.0, steps=4) for i in range(4)]
    recs["piqa"]["single:a-model"] = [_rec(i, 0, correct_raw=0, seconds=1.0, steps=4) for i in range(4)]
    table = markdown_table(summarise(cfg, EvalSettings(tasks=["piqa", "gsm8k"]), recs,
                                     {"piqa": "likelihood", "gsm8k": "generate"}))
    assert "| gac | +100.0 [+100.0, +100.0]† | **-25.0** [-75.0, +0.0] |" in table  # 4 items: p = 1/8, no ‡


def test_sign_flip_p_is_the_exact_paired_test():
    from tokenfuse.eval.stats import sign_flip_p

    assert sign_flip_p([1, 0, 1], [1, 0, 1]) == 1.0  # identical rows
    assert sign_flip_p([], []) == 1.0
    assert sign_flip_p([1, 0], [0, 1]) == 1.0  # one win, one loss
    assert sign_flip_p([1, 1, 1, 1], [0, 0, 0, 0]) == 2 / 16  # all 16 sign flips: two reach |4|
    # 5 wins, 1 loss: flips with |sum| >= 4 are those with at most 1 of the 6 on either side: 2 (1 + 6) / 64
    assert sign_flip_p([1] * 5 + [0] + [1] * 10, [0] * 5 + [1] + [1] * 10) == 14 / 64  # shared items do not count
    clear = sign_flip_p([1] * 20 + [0] * 2 + [1] * 50 + [0] * 28, [0] * 20 + [1] * 2 + [1] * 50 + [0] * 28)
    assert clear < 0.01 and clear == 2 * (1 + 22 + 231) / 2 ** 22  # 20 wins, 2 losses
    assert sign_flip_p([1, 0, 1], [0, 1, 1]) == sign_flip_p([0, 1, 1], [1, 0, 1])  # two-sided
    with pytest.raises(ValueError):
        sign_flip_p([1, 0], [1])
    with pytest.raises(ValueError):
        sign_flip_p([0.5, 1], [1, 0])


def test_sign_flip_p_matches_scipy_binomtest():
    stats = pytest.importorskip("scipy.stats")
    from tokenfuse.eval.stats import sign_flip_p

    for wins, losses in [(0, 3), (7, 2), (30, 41), (120, 80), (3, 3)]:
        got = sign_flip_p([1] * wins + [0] * losses, [0] * wins + [1] * losses)
        assert got == pytest.approx(stats.binomtest(wins, wins + losses, 0.5).pvalue, rel=1e-9)


def test_holm_on_a_hand_computed_example():
    from tokenfuse.eval.stats import holm

    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> running max 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == [1.0, 1.0]  # capped at 1
    assert holm([0.02]) == [0.02] and holm([]) == []


def _holm_records():
    """24 items per task; piqa: gac right on 12 items more than the best member (a), unite on 6 more;
    gsm8k: gac the best member (b) itself, unite one item more."""
    def rows(k: int, n: int = 24) -> list[dict]:
        return [_rec(i, i < k, correct_raw=i < k, seconds=1.0, steps=4) for i in range(n)]

    return {"piqa": {"single:a-model": rows(10), "single:b-model": rows(5), "gac": rows(22), "unite": rows(16)},
            "gsm8k": {"single:a-model": rows(6), "single:b-model": rows(8), "gac": rows(8), "unite": rows(9)}}


def test_gain_table_marks_significance_after_holm():
    cfg = config_from_models("a-model,b-model")
    results = summarise(cfg, EvalSettings(tasks=["piqa", "gsm8k"]), _holm_records(),
                        {"piqa": "likelihood", "gsm8k": "likelihood"})
    v = {(t, m): results["tasks"][t][m]["vs_best"] for t in ("piqa", "gsm8k") for m in ("gac", "unite")}
    assert results["holm"] == {"family": 4, "alpha": 0.05, "test": "exact paired sign-flip"}
    assert [v[k]["p"] for k in v] == pytest.approx([2 / 2 ** 12, 2 / 2 ** 6, 1.0, 1.0])
    # Holm: 4 * 2/4096, then 3 * 2/64 = 0.094 (raw p 0.031 < 0.05, not after the correction), then 1, 1
    assert [v[k]["p_holm"] for k in v] == pytest.approx([8 / 4096, 6 / 64, 1.0, 1.0])
    assert all(x["family"] == 4 for x in v.values())
    assert "p" not in results["overview"]["gac"]["vs_best"]  # the averages are outside the family
    table = markdown_table(results)
    gain = table[table.index("| method | piqa | gsm8k | Avg. vs"):].splitlines()
    assert gain[2].startswith("| gac | +50.0 [+29.2, +70.8]†‡ | +0.0 [+0.0, +0.0] | ")
    assert gain[3].startswith("| unite | +25.0 [+8.3, +41.7]† | +4.2 [+0.0, +12.5] | ")  # † without ‡
    assert table.count("‡") == 1 + 2  # the one cell, and the caption and legend lines
    assert "‡: Holm-adjusted p < 0.05 over the family of the table's 4 per-task comparisons" in table


def test_results_without_p_values_render_without_holm():
    cfg = config_from_models("a-model,b-model")
    results = summarise(cfg, EvalSettings(tasks=["piqa", "gsm8k"]), _holm_records(),
                        {"piqa": "likelihood", "gsm8k": "likelihood"})
    old = json.loads(json.dumps(results))  # as an older run wrote it: no p-values, no task_wall
    del old["holm"], old["task_wall"]
    for per in old["tasks"].values():
        for c in per.values():
            for key in ("p", "p_holm", "family"):
                c.get("vs_best", {}).pop(key, None)
    table = markdown_table(old)
    assert "Holm: not computed for this run (its results.json has no p-values); † alone." in table
    assert "†‡" not in table and "| gac | +50.0 [+29.2, +70.8]† |" in table
    assert "| piqa | 24 | 4 | 96 | 15.0 |" in table  # the wall time from the rows' seconds all the same


# ---------------------------------------------------------------------------------------- a run
ARC = [{"id": f"arc-{i}", "question": q, "choices": ch, "answer": a, "task": "ARC-Easy"} for i, (q, ch, a) in
       enumerate([("Which is a liquid?", ["rock", "water", "wood"], "B"),
                  ("What do plants need?", ["light", "sand"], "A"),
                  ("Which is hot?", ["ice", "snow", "fire", "rain"], "C")])]
QA = [{"id": f"tq-{i}", "question": q, "answer": a, "aliases": [a]} for i, (q, a) in
      enumerate([("Capital of France?", "Paris"), ("2+2?", "4"), ("Color of the sky?", "blue")])]


@pytest.fixture()
def data_dir(tmp_path):
    root = tmp_path / "data"
    for rel, rows in (("arc/easy_test.jsonl", ARC), ("triviaqa/test.jsonl", QA), ("triviaqa/dev.jsonl", QA)):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root


@pytest.fixture()
def tiny_pair(make_tiny, one_thread):
    from tokenfuse import Ensemble

    members = [make_tiny("smollm2", seed=1, name="s"), make_tiny("qwen", seed=2, name="q")]
    return members, Ensemble(members).union


def test_byte_rows_are_fit_on_the_tasks_dev_items(tiny_pair, data_dir, tmp_path):
    """``byte-mix`` and ``byte-gate`` on a likelihood task: their numbers fit on the gold options of its dev
    items (a fit file in the run's folder, the rows' ``params.fit``; made once), the rows scored on bytes."""
    members, union = tiny_pair
    dev = [{"id": f"d-{i}", "question": q, "choices": ch, "answer": a, "task": "ARC-Easy"} for i, (q, ch, a) in
           enumerate([("Which is cold?", ["ice", "fire"], "A"), ("Which is wet?", ["sand", "rain"], "B")])]
    (data_dir / "arc" / "easy_dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dev), encoding="utf-8")
    logs: list[str] = []
    settings = EvalSettings(tasks=["arc_easy"], methods=["byte-mix", "byte-gate", "byte-online"], limit=2,
                            data=str(data_dir), out=str(tmp_path), batch_size=2, num_fewshot=0, progress=False)
    run_eval(config_from_models("s,q", primary="s"), settings, members=members, union=union, log=logs.append)
    fit = json.loads((tmp_path / "fits" / "arc_easy.json").read_text())
    assert fit["members"] == ["s", "q"] and fit["dev_items"] == 2 and math.isclose(sum(fit["fitted"]["byte-mix"]["weights"]), 1)
    assert len(fit["fitted"]["byte-gate"]["gate"]) == 2 + 2 * 2 * 2
    assert fit["fitted"]["byte-online"]["gate"] == fit["fitted"]["byte-gate"]["gate"]
    assert fit["fitted"]["byte-online"]["rate"] in ONLINE_RATES
    assert len([json.loads(x) for x in (tmp_path / "items" / "arc_easy-likelihood" / "byte-online.jsonl").open()]) == 2
    spec = json.loads((tmp_path / "items" / "arc_easy-likelihood" / "byte-gate.spec.json").read_text())
    assert spec["overrides"]["params"] == {"mix": "gate", "fit": str(tmp_path / "fits" / "arc_easy.json")}
    rows = [json.loads(x) for x in (tmp_path / "items" / "arc_easy-likelihood" / "byte-mix.jsonl").open()]
    assert len(rows) == 2 and all(r["bytes"] == [len(o.encode()) for o in r["options"]] for r in rows)
    assert sum("fitting the byte rows" in m for m in logs) == 1
    run_eval(config_from_models("s,q", primary="s"), settings, members=members, union=union, log=logs.append)
    assert sum("fitting the byte rows" in m for m in logs) == 1  # made once
    del fit["fitted"]["byte-online"]  # a fit made before the row existed is made again (the same dev items)
    (tmp_path / "fits" / "arc_easy.json").write_text(json.dumps(fit))
    run_eval(config_from_models("s,q", primary="s"), settings, members=members, union=union, log=logs.append)
    again = json.loads((tmp_path / "fits" / "arc_easy.json").read_text())
    assert sum("fitting the byte rows" in m for m in logs) == 2 and again["fitted"]["byte-gate"] == fit["fitted"]["byte-gate"]


def test_the_byte_fit_shows_its_progress_over_the_members_byte_models(tiny_pair, data_dir, tmp_path, capsys):
    """The fit's byte models (one per member and dev item) show their progress (off a terminal: one line when
    done); ``progress=False`` (``--quiet``) shows nothing."""
    from tokenfuse import Ensemble
    from tokenfuse.eval.bytefit import task_fit
    from tokenfuse.tasks import ARCEasy

    members, _ = tiny_pair
    dev = [{"id": f"d-{i}", "question": q, "choices": ch, "answer": "A", "task": "ARC-Easy"}
           for i, (q, ch) in enumerate([("Which is cold?", ["ice", "fire"]), ("Which is hot?", ["sun", "snow"])])]
    (data_dir / "arc" / "easy_dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dev), encoding="utf-8")
    task = ARCEasy(str(data_dir))
    assert task_fit(Ensemble(members), task, tmp_path / "a", 1234, lambda m: None, progress=False) is not None
    assert capsys.readouterr().err == ""
    assert task_fit(Ensemble(members), task, tmp_path / "b", 1234, lambda m: None) is not None
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dev arc_easy byte fit: 4/4 byte models in ")


def test_byte_rows_generate_four_bytes_for_each_token_of_the_limit(tiny_pair, data_dir, tmp_path):
    """In the generate form a task's limit is in tokens: the byte rows get ``steps_per_token`` (4) bytes for each."""
    members, union = tiny_pair
    settings = EvalSettings(tasks=["triviaqa"], methods=["byte-mix"], limit=2, data=str(data_dir), out=str(tmp_path),
                            batch_size=2, num_fewshot=0, progress=False, max_new_tokens={"triviaqa": 3})
    run_eval(config_from_models("s,q", primary="s"), settings, members=members, union=union, log=lambda m: None)
    rows = [json.loads(x) for x in (tmp_path / "items" / "triviaqa-generate" / "byte-mix.jsonl").open()]
    assert len(rows) == 2 and all(r["steps"] <= 12 for r in rows) and max(r["steps"] for r in rows) > 3


def test_output_rows_resume_from_packed_likelihood_records_without_options(tiny_pair, data_dir, tmp_path):
    """The published likelihood records have their option texts removed; vote, MBR and seq-avg
    computed on them later (a resumed or extended run) take the options from the task and give the
    records they give from the full ones."""
    members, union = tiny_pair
    cfg = config_from_models("s,q")

    def run(out, methods):
        settings = EvalSettings(tasks=["arc_easy"], methods=methods, limit=2, data=str(data_dir), out=str(out),
                                batch_size=2, num_fewshot=0, progress=False)
        run_eval(cfg, settings, members=members, union=union, log=lambda m: None)

    run(tmp_path / "full", ["single", "vote", "mbr"])
    packed = tmp_path / "packed" / "items" / "arc_easy-likelihood"
    packed.mkdir(parents=True)
    for name in ("single__s.jsonl", "single__q.jsonl"):
        rows = [json.loads(line) for line in (tmp_path / "full" / "items" / "arc_easy-likelihood" / name).open()]
        assert all("options" in r for r in rows)
        (packed / name).write_text("".join(json.dumps({k: v for k, v in r.items() if k != "options"}) + "\n"
                                           for r in rows), encoding="utf-8")
    run(tmp_path / "packed", ["single", "vote", "mbr"])
    for name in ("vote.jsonl", "mbr.jsonl", "seq-avg.jsonl"):
        full = (tmp_path / "full" / "items" / "arc_easy-likelihood" / name).read_text()
        assert (packed / name).read_text() == full and full.count("\n") == 2


def test_run_eval_writes_outputs_and_resumes(tiny_pair, data_dir, tmp_path, monkeypatch):
    from tokenfuse.engine import Ensemble

    members, union = tiny_pair
    cfg = config_from_models("s,q")
    out = tmp_path / "out"
    settings = EvalSettings(tasks=["arc_easy", "triviaqa"], methods=["single", "gac", "vote", "mbr"], limit=2,
                            data=str(data_dir), out=str(out), batch_size=2, num_fewshot=0,
                            max_new_tokens={"triviaqa": 3}, progress=False)
    res = run_eval(cfg, settings, members=members, union=union, log=lambda m: None)
    assert res["forms"] == {"arc_easy": "likelihood", "triviaqa": "generate"}
    assert list(res["overview"]) == ["single:s", "single:q", "gac", "vote", "mbr", "seq-avg"]
    assert {t: c["n"] for t, c in res["tasks"]["arc_easy"].items()} == dict.fromkeys(res["overview"], 2)
    assert "seq-avg" not in res["tasks"]["triviaqa"]
    for name in ("results.json", "results.md", "results.png"):
        assert (out / name).is_file()
    for t, per in res["tasks"].items():  # every other row against the task's best member, paired
        best = max(["single:s", "single:q"], key=lambda m: per[m]["acc"])
        for m in ("gac", "vote", "mbr"):
            assert (per[m]["vs_best"]["member"], per[m]["vs_best"]["gain"]) == (best, per[m]["acc"] - per[best]["acc"])
    assert "| Avg. vs per-task best |" in (out / "results.md").read_text()
    gac_file = out / "items" / "arc_easy-likelihood" / "gac.jsonl"
    lines = gac_file.read_text().splitlines()
    rec = json.loads(lines[0])
    assert len(rec["logprobs"]) == len(rec["options"]) == len(rec["bytes"]) and rec["pred"] in range(len(rec["options"]))
    # The same items for every method: the seeded subset.
    ids = {p.name: [json.loads(x)["id"] for x in p.read_text().splitlines()] for p in gac_file.parent.glob("*.jsonl")}
    assert len({tuple(v) for v in ids.values()}) == 1

    # A rerun computes nothing: every item is finished.
    def boom(*a, **k):
        raise AssertionError("a finished item ran again")

    monkeypatch.setattr(Ensemble, "generate", boom)
    monkeypatch.setattr(Ensemble, "loglikelihood", boom)
    again = run_eval(cfg, settings, members=members, union=union, log=lambda m: None)
    assert again["tasks"] == res["tasks"]

    # Drop one finished item (and cut the last line, as an interrupt would): only that item runs.
    gac_file.write_text(lines[0] + "\n" + lines[1][:10], encoding="utf-8")
    calls = []
    monkeypatch.setattr(Ensemble, "loglikelihood", lambda self, reqs, **k: calls.append(len(reqs)) or
                        [Likelihood(-1.0, 1, 3, 1)] * len(reqs))
    run_eval(cfg, settings, members=members, union=union, log=lambda m: None)
    assert len(calls) == 1
    assert len(read_ids(gac_file)) == 2


def test_generate_form_runs_the_rows_batch_by_batch(tiny_pair, data_dir, tmp_path, monkeypatch):
    """Each batch of items goes through every row before the next batch starts, so the members'
    pooled contexts still hold the batch's prompts when the next row feeds them."""
    from tokenfuse.eval import batches

    members, union = tiny_pair
    calls = []
    generate = batches.generate_records

    def spy(ens, task, items, **kw):
        calls.append([it["id"] for it in items])
        return generate(ens, task, items, **kw)

    monkeypatch.setattr(batches, "generate_records", spy)
    settings = EvalSettings(tasks=["triviaqa"], methods=["single", "gac"], limit=3, data=str(data_dir),
                            out=str(tmp_path / "out"), batch_size=2, num_fewshot=0,
                            max_new_tokens={"triviaqa": 3}, progress=False)
    run_eval(config_from_models("s,q", primary="s"), settings, members=members, union=union, log=lambda m: None)
    first, second = calls[0], calls[3]
    assert calls == [first] * 3 + [second] * 3 and len(first) == 2 and len(second) == 1


def test_task_primary_is_the_dev_best_member_unless_the_config_names_one(tiny_pair, data_dir, tmp_path, monkeypatch):
    """With no ``primary`` and no scores, the member best on the task's dev items gates, drafts and
    leads; every ensemble row carries it in its overrides, and results.md says whence it came."""
    from tokenfuse.eval import runner
    from tokenfuse.eval.report import primary_lines
    from tokenfuse.tasks import load_task

    members, union = tiny_pair
    task = load_task("triviaqa", str(data_dir), num_fewshot=0)
    seen = []

    def fake_rows(cfg, base, task, specs, items, settings, *, split="test"):
        seen.append((split, [s.name for s in specs], len(items)))
        return {s.name: [{"id": it["id"], "correct": s.name == "single:q" or i == 0} for i, it in enumerate(items)]
                for s in specs}

    monkeypatch.setattr(runner, "run_rows", fake_rows)
    settings = EvalSettings(tasks=["triviaqa"], methods=["single", "gac-threshold"], data=str(data_dir),
                            out=str(tmp_path / "out"), progress=False, member_dev_limit=3)
    n = len(task.dev_subset(3, settings.seed))
    assert runner.task_primary(config_from_models("s,q"), None, task, settings.methods, settings) == "q"
    assert seen == [("dev", ["single:s", "single:q"], n)]
    assert settings.primaries["triviaqa"] == {"member": "q", "from": "dev", "dev_items": n,
                                              "dev_acc": {"s": 1 / n, "q": 1.0}}
    assert primary_lines({"primaries": settings.primaries})[-1] == (
        f"* triviaqa: q — best of the members alone on {n} dev items (s {100 / n:.1f}, q 100.0)")
    # The config's primary, a member's score, or only the members alone: no dev items are run.
    for cfg, methods in ((config_from_models("s,q", primary="s"), ["gac"]), (config_from_models("s,q"), ["single"])):
        assert runner.task_primary(cfg, None, task, methods, settings) == "s"
        assert settings.primaries["triviaqa"] == {"member": "s", "from": "config"}
    scored = parse_config({"members": [{"name": "s"}, {"name": "q", "score": 0.2}]})
    assert runner.task_primary(scored, None, task, ["gac"], settings) == "q" and len(seen) == 1
    assert primary_lines({"primaries": settings.primaries}) == []
    # The rows that read the primary get it pinned.
    specs = {s.name: s for s in plan_methods(config_from_models("s,q"), ["gac-threshold", "contrast", "gac"],
                                              form="generate", registered=["gac", "contrast"], log=lambda m: None,
                                              primary="q")}
    assert specs["gac-threshold"].overrides["gate"] == "q" and specs["gac-threshold"].overrides["primary"] == "q"
    assert specs["contrast"].overrides == {"method": "contrast", "gate": None, "threshold": None, "primary": "q"}
    assert specs["gac"].overrides["primary"] == "q"
    # --threshold alone: the task's primary gates at it; a config's own gate keeps its own threshold.
    (row,) = plan_methods(config_from_models("s,q"), ["gac-threshold"], form="generate", registered=["gac"],
                          log=lambda m: None, primary="q", threshold=0.7)
    assert (row.overrides["gate"], row.overrides["threshold"]) == ("q", 0.7)
    (row,) = plan_methods(config_from_models("s,q", gate="s", threshold=0.2), ["gac-threshold"], form="generate",
                          registered=["gac"], log=lambda m: None, primary="q", threshold=0.7)
    assert (row.overrides["gate"], row.overrides["threshold"]) == ("s", 0.2)


# ---------------------------------------------------------------------------------------- dev work
def test_primary_dev_count_is_proportional_unless_auto_runs():
    from tokenfuse.eval.auto import primary_dev_count

    assert primary_dev_count("likelihood", 12, with_auto=False) == 12  # --limit 12: 12 dev items for the primary
    assert primary_dev_count("likelihood", 2376, with_auto=False) == 500  # all of a task's items: at most 500
    assert primary_dev_count("generate", 1000, with_auto=False) == 200
    assert primary_dev_count("likelihood", 12, with_auto=False, member_dev_limit=40) == 40  # the flag wins
    assert primary_dev_count("likelihood", 12, with_auto=False, dev_limit=100) == 12  # auto's own flag: not auto
    assert primary_dev_count("likelihood", 12, with_auto=True) == 500  # auto's member count: its records serve both
    assert primary_dev_count("likelihood", 12, with_auto=True, dev_limit=600) == 600
    assert primary_dev_count("generate", 12, with_auto=True, member_dev_limit=300) == 300


def _fixed_clock(monkeypatch):
    from types import SimpleNamespace

    from tokenfuse.eval import runner

    monkeypatch.setattr(runner, "time", SimpleNamespace(perf_counter=lambda: 7.0))


def test_task_primary_ranks_on_as_many_dev_items_as_test_items(tiny_pair, data_dir, tmp_path, monkeypatch):
    """Without ``auto`` the members' ranking that only picks the primary runs on no more dev items
    than the run has test items; with ``auto`` on auto's member count; each ranking says what it
    does when it starts and what it chose when it is done."""
    from tokenfuse.eval import runner
    from tokenfuse.tasks import load_task

    (data_dir / "triviaqa" / "dev.jsonl").write_text("".join(
        json.dumps({**r, "id": f"dev-{i}"}) + "\n" for i, r in enumerate(QA + QA)), encoding="utf-8")  # 6 dev items
    task = load_task("triviaqa", str(data_dir), num_fewshot=0)
    seen = []

    def fake_rows(cfg, base, task, specs, items, settings, *, split="test"):
        seen.append(len(items))
        return {s.name: [{"id": it["id"], "correct": s.name == "single:q"} for it in items] for s in specs}

    monkeypatch.setattr(runner, "run_rows", fake_rows)
    _fixed_clock(monkeypatch)
    logs: list[str] = []
    for limit, extra, methods, want in ((2, {}, ["gac"], 2), (None, {}, ["gac"], 3),
                                        (2, {"member_dev_limit": 5}, ["gac"], 5), (1, {}, ["gac", "auto"], 6)):
        settings = EvalSettings(tasks=["triviaqa"], methods=methods, limit=limit, data=str(data_dir),
                                out=str(tmp_path / "out"), progress=False, **extra)
        assert runner.task_primary(config_from_models("s,q"), None, task, methods, settings, log=logs.append) == "q"
        assert seen[-1] == want and settings.primaries["triviaqa"]["dev_items"] == want
    assert logs[:2] == ["dev triviaqa: ranking 2 members alone on 2 dev items (for the primary member)",
                        "dev triviaqa: primary q (dev accuracy s 0.0, q 100.0), 0.0 s"]
    assert logs[-2] == "dev triviaqa: ranking 2 members alone on 6 dev items (for the primary member and auto)"


def test_dev_records_are_reused_across_runs(tiny_pair, tmp_path, monkeypatch, capsys):
    """A run with another ``--out`` takes the dev records an earlier run computed from the dev
    cache (the same records, so the same primary) and computes only the dev items it lacks; the
    test items run again. Off with ``dev_cache=False``; keyed by the members as loaded."""
    from tokenfuse.eval import batches, devcache
    from tokenfuse.eval.records import item_file, read_records

    members, union = tiny_pair
    root = tmp_path / "data"
    for name, prefix in (("easy_test.jsonl", "arc"), ("easy_dev.jsonl", "dev")):
        (root / "arc").mkdir(parents=True, exist_ok=True)
        (root / "arc" / name).write_text("".join(json.dumps({**r, "id": f"{prefix}-{i}"}) + "\n"
                                                 for i, r in enumerate(ARC + ARC)), encoding="utf-8")
    version = {"s": 1, "q": 1}
    monkeypatch.setattr(devcache, "member_identity", lambda m: {"tiny": m.name, "version": version[m.name]})
    monkeypatch.setenv("TOKENFUSE_CACHE", str(tmp_path / "cache"))
    computed: list[tuple[str, str]] = []
    score = batches.likelihood_records

    def spy(ens, task, items, **kw):
        computed.extend((ens.members[0].name if len(ens.members) == 1 else "ens", str(it["id"])) for it in items)
        return score(ens, task, items, **kw)

    monkeypatch.setattr(batches, "likelihood_records", spy)
    _fixed_clock(monkeypatch)

    def run(out, limit, **kw):
        computed.clear()
        settings = EvalSettings(tasks=["arc_easy"], methods=["single", "gac"], limit=limit, data=str(root),
                                out=str(tmp_path / out), batch_size=2, num_fewshot=0, progress=False,
                                dev_cache=kw.pop("dev_cache", True), **kw)
        res = run_eval(config_from_models("s,q"), settings, members=members, union=union, log=lambda m: None)
        dev = {n: item_file(tmp_path / out, "arc_easy", "likelihood-dev", f"single:{n}").read_text() for n in "sq"}
        return res, dev, sorted({i for _, i in computed if i.startswith("dev-")})

    first, dev1, ran = run("a", 2)
    assert len(ran) == 2 and first["primaries"]["arc_easy"]["dev_items"] == 2
    cached = sorted((tmp_path / "cache" / "eval-dev" / "arc_easy-likelihood").glob("*/records.jsonl"))
    assert len(cached) == 2 and all(len(read_records(p)) == 2 for p in cached)
    capsys.readouterr()
    second, dev2, ran = run("b", 2)
    assert ran == [] and dev2 == dev1 and second["primaries"] == first["primaries"]  # the same records, the same choice
    assert {i for _, i in computed} == set(read_records(item_file(tmp_path / "b", "arc_easy", "likelihood", "gac")))
    assert capsys.readouterr().err == (f"arc_easy-likelihood-dev: 4 records of 2 rows taken from the dev cache "
                                       f"({tmp_path / 'cache' / 'eval-dev' / 'arc_easy-likelihood'})\n")
    third, dev3, ran = run("c", 3)  # one test item more: one dev item more, only that one computed
    assert len(ran) == 1 and all(dev3[n].startswith(dev1[n]) and dev3[n].count("\n") == 3 for n in "sq")
    assert all(len(read_records(p)) == 3 for p in cached)
    _, _, ran = run("d", 3, dev_cache=False)
    assert len(ran) == 3
    version["q"] = 2  # q's weights changed: its ranking records are computed again, s's are taken
    _, _, ran = run("e", 3)
    assert len(ran) == 3 and {n for n, i in computed if i.startswith("dev-")} == {"q"}


def test_dev_cache_identity_follows_the_weight_files(tmp_path, data_dir):
    from types import SimpleNamespace

    from tokenfuse.eval.devcache import item_key, member_identity
    from tokenfuse.tasks import load_task

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"1234")
    llama = SimpleNamespace(path=str(gguf), codec=SimpleNamespace(fingerprint="f"), weight_bytes=4)
    ident = member_identity(llama)
    assert ident["files"] == [[str(gguf.resolve()), 4, gguf.stat().st_mtime_ns]] and ident["codec"] == "f"
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"12")
    (folder / "config.json").write_text("{}")
    hf = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(_name_or_path=str(folder)), dtype="float32"),
                         codec=SimpleNamespace(fingerprint="g"), weight_bytes=2, device="cpu")
    ident = member_identity(hf)
    assert [f[0].rsplit("/", 1)[1] for f in ident["files"]] == ["config.json", "model.safetensors"]
    (folder / "model.safetensors").write_bytes(b"123")
    assert member_identity(hf) != ident  # other weights: another key
    assert member_identity(SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(_name_or_path="")))) is None
    assert member_identity(SimpleNamespace(codec=None, weight_bytes=None)) is None  # behind a server: no files
    task = load_task("arc_easy", str(data_dir), num_fewshot=0)
    a, b = task.items[0], dict(task.items[0], question="Which is a gas?")
    assert item_key(task, a, "likelihood") == item_key(task, dict(a), "likelihood") != item_key(task, b, "likelihood")
    assert item_key(task, a, "likelihood") != item_key(task, a, "generate")


def test_cli_dev_cache_is_on_unless_turned_off(monkeypatch):
    from tokenfuse.cli import main
    from tokenfuse.eval import cli

    seen = []

    def fake_run(cfg, settings):
        seen.append(settings)
        raise TokenfuseError("stop here")

    monkeypatch.setattr(cli, "run_eval", fake_run)
    assert main(["eval"]) == 2 and main(["eval", "--no-dev-cache"]) == 2
    assert [s.dev_cache for s in seen] == [True, False] and EvalSettings().dev_cache is False


def read_ids(path):
    from tokenfuse.eval.records import read_records

    return list(read_records(path))


def test_cli_eval_errors_are_one_line(capsys):
    from tokenfuse.cli import main

    assert main(["eval", "--methods", "single,mbrr", "--data", "/nonexistent"]) == 2
    assert "did you mean 'mbr'" in capsys.readouterr().err
    assert main(["eval", "--limit", "0"]) == 2
    assert main(["eval", "--member-dev-limit", "0"]) == 2
    assert "--member-dev-limit: expected 1 or more, got 0" in capsys.readouterr().err


def test_prompt_form_follows_the_members_templates():
    from tokenfuse.tasks import prompt_form

    def member(template):  # Member.has_chat_template: its tokenizer has a chat template
        return type("M", (), {"has_chat_template": bool(template)})()

    assert prompt_form([member("{{x}}"), member("{{y}}")]) is True
    assert prompt_form([member(None)]) is False
    assert prompt_form([member("{{x}}"), member(None)]) == "mixed"


# ---------------------------------------------------------------------------------------- auto
def _dev(accs: dict[str, list[int]]) -> dict[str, list[dict]]:
    return {m: [_rec(i, bool(c)) for i, c in enumerate(cs)] for m, cs in accs.items()}


def test_auto_candidates_follow_the_dev_accuracies():
    from tokenfuse.config import parse_config
    from tokenfuse.eval.auto import THRESHOLDS, candidates

    cfg = parse_config({"members": [{"name": "a"}, {"name": "b", "weight": 2.0}, {"name": "c"}]})
    dev = _dev({"single:a": [1] * 6 + [0] * 4, "single:b": [1] * 8 + [0] * 2, "single:c": [1] * 3 + [0] * 7})
    specs = {s.name: s for s in candidates(cfg, dev)}
    assert list(specs) == [f"auto:gated@{t:g}" for t in THRESHOLDS]  # a is 20 points behind b: nothing kept
    gated = cfg.with_overrides(**specs["auto:gated@0.7"].overrides)
    assert (gated.method, gated.gate, gated.threshold, gated.primary_name) == ("gac", "b", 0.7, "b")
    dev.update(_dev({"single:a": [1] * 7 + [0] * 3}))  # now within 10 points of b: UniTE's rule keeps a and b
    specs = {s.name: s for s in candidates(cfg, dev)}
    kept = cfg.with_overrides(**specs["auto:unite@kept"].overrides)
    assert [(m.name, m.weight) for m in kept.members] == [("a", 1.0), ("b", 2.0), ("c", 0.0)]
    assert (kept.method, kept.primary_name, kept.gate) == ("unite", "b", None) and "auto:gac@kept" in specs


def test_auto_chosen_config():
    from tokenfuse.config import parse_config
    from tokenfuse.eval.auto import Choice, candidates, chosen_config, config_text

    cfg = parse_config({"members": [{"name": "a"}, {"name": "b"}, {"name": "c"}], "method": "unite"})
    dev = _dev({"single:a": [1] * 7 + [0] * 3, "single:b": [1] * 8 + [0] * 2, "single:c": [1] * 3 + [0] * 7})
    specs = {s.name: s for s in candidates(cfg, dev)}
    kept = chosen_config(cfg, specs["auto:gac@kept"])
    assert ([m.name for m in kept.members], kept.method, kept.primary_name) == (["a", "b"], "gac", "b")
    gated = chosen_config(cfg, specs["auto:gated@0.3"])
    assert ([m.name for m in gated.members], gated.gate, gated.threshold) == (["a", "b", "c"], "b", 0.3)
    alone = chosen_config(cfg, MethodSpec("single:c", "engine", ("c",)))
    assert [m.name for m in alone.members] == ["c"] and alone.gate is None
    assert chosen_config(cfg, MethodSpec("vote", "output", ("a", "b", "c"))) is None
    text = config_text(gated, Choice("auto:gated@0.3", "single:b", "auto:gated@0.3", None, {"single:b": 0.8}, 10, 40),
                       task="arc_easy")
    assert text.startswith("# Chosen by `tokenfuse eval`'s auto row on arc_easy") and "#   single:b: 80.0 (on the members' 40)" in text
    assert [m.name for m in parse_config(yaml.safe_load(text)).members] == ["a", "b", "c"]


def test_auto_choice_needs_a_clear_gain_on_dev():
    from tokenfuse.eval.auto import choose

    dev = _dev({"single:a": [1] * 30 + [0] * 30, "single:b": [1] * 20 + [0] * 40,
                "gac": [1] * 31 + [0] * 29, "vote": [1] * 29 + [0] * 31})
    c = choose(dev)
    assert (c.best_single, c.challenger, c.chosen, c.n) == ("single:a", "gac", "single:a", 60)  # +1.7: not clear
    assert c.gain[0] == pytest.approx(1 / 60) and c.gain[1] <= 0 < c.gain[2]
    dev.update(_dev({"gac": [1] * 30 + [1] * 12 + [0] * 18}))  # right wherever a is, and 12 more
    c = choose(dev)
    assert c.chosen == "gac" and c.gain[1] > 0 and c.as_dict()["dev_acc"]["gac"] == 0.7
    assert choose(_dev({"single:a": [1, 0], "single:b": [1, 1]})).chosen == "single:b"


def test_auto_ranks_the_members_on_their_own_dev_items():
    from tokenfuse.eval.auto import choose

    dev = _dev({"single:a": [1] * 6 + [0] * 4, "single:b": [1] * 4 + [0] * 6, "gac": [1] * 6 + [0] * 4})
    ranked = _dev({"single:a": [1] * 6 + [0] * 34, "single:b": [1] * 4 + [0] * 6 + [1] * 20 + [0] * 10})
    c = choose(dev, ranked)  # b leads on its 40 items though a leads on the 10 the rest ran
    assert (c.best_single, c.chosen, c.n, c.member_n) == ("single:b", "single:b", 10, 40)
    assert c.dev_acc["single:b"] == 0.6 and c.dev_acc["gac"] == 0.6
    assert c.gain[0] == pytest.approx(0.2)  # gac against b on the 10 items both ran: not clear at 90 %
    assert c.as_dict()["member_dev_items"] == 40


def test_records_of_another_configuration_are_moved_aside(tmp_path):
    from tokenfuse.eval.records import append_records, keep_if_made_by, read_records

    path = tmp_path / "auto__gated@0.5.jsonl"
    gate_a = {"members": ["a", "b"], "overrides": {"gate": "a", "threshold": 0.5}}
    assert keep_if_made_by(path, gate_a) is None  # nothing yet: the spec is written
    append_records(path, [_rec(1, True)])
    assert keep_if_made_by(path, gate_a) is None and set(read_records(path)) == {"1"}
    moved = keep_if_made_by(path, {**gate_a, "overrides": {"gate": "b", "threshold": 0.5}})
    assert moved == tmp_path / "auto__gated@0.5.jsonl.stale1" and not path.exists()
    assert set(read_records(moved)) == {"1"}  # nothing lost
    append_records(path, [_rec(2, False)])
    assert keep_if_made_by(path, gate_a).name == "auto__gated@0.5.jsonl.stale2"
    legacy = tmp_path / "gac.jsonl"  # records of a run before the spec files: kept, the spec written
    append_records(legacy, [_rec(1, True)])
    assert keep_if_made_by(legacy, gate_a) is None and legacy.exists()
    assert (tmp_path / "gac.spec.json").is_file()


def test_auto_row_is_chosen_on_dev_and_run_on_test(tiny_pair, data_dir, tmp_path, monkeypatch):
    from tokenfuse.engine import Ensemble
    from tokenfuse.config import load_config
    from tokenfuse.eval.auto import THRESHOLDS, choose
    from tokenfuse.eval.records import read_records

    members, union = tiny_pair
    (data_dir / "arc" / "easy_dev.jsonl").write_text("".join(
        json.dumps({**r, "id": f"dev-{r['id']}"}) + "\n" for r in ARC), encoding="utf-8")
    cfg = config_from_models("s,q")
    out = tmp_path / "out"
    settings = EvalSettings(tasks=["arc_easy", "triviaqa"], methods="single,gac,auto", limit=3,  # as the CLI gives it
                            data=str(data_dir), out=str(out), batch_size=2, num_fewshot=0,
                            max_new_tokens={"triviaqa": 2}, progress=False, dev_limit=2)  # members: all 3
    _fixed_clock(monkeypatch)
    logs: list[str] = []
    res = run_eval(cfg, settings, members=members, union=union, log=logs.append)
    assert set(res["auto"]) == {"arc_easy", "triviaqa"} and "auto" in res["overview"]
    assert res["settings"]["methods"] == ["single", "gac", "auto"]
    for task, form in (("arc_easy", "likelihood"), ("triviaqa", "generate")):
        dev_dir = out / "items" / f"{task}-{form}-dev"
        files = {p.stem.replace("__", ":"): list(read_records(p).values()) for p in dev_dir.glob("*.jsonl")}
        order = ["single:s", "single:q", "gac", "seq-avg", *(f"auto:gated@{t:g}" for t in THRESHOLDS),
                 "auto:gac@kept", "auto:unite@kept"]  # the table's rows, then the candidates, as the runner has them
        assert set(files) <= set(order) and {"single:s", "single:q", "gac", "auto:gated@0.5"} <= set(files)
        ranked = {m: files[m] for m in ("single:s", "single:q")}
        assert all(len(r) == 3 for r in ranked.values())  # the members alone on more dev items than the rest
        ids = {r["id"] for r in files["gac"]}
        dev = {m: [r for r in files[m] if r["id"] in ids] for m in order if m in files}
        assert all(len(r) == 2 for r in dev.values()) and ids < {r["id"] for r in ranked["single:s"]}
        test_ids = set(read_records(out / "items" / f"{task}-{form}" / "gac.jsonl"))
        assert not test_ids & {r["id"] for r in dev["gac"]} or task == "triviaqa"  # TriviaQA's fixture repeats them
        expected = choose(dev, ranked)
        assert res["auto"][task]["chosen"] == expected.chosen
        primary, acc = res["primaries"][task]["member"], res["primaries"][task]["dev_acc"]
        best = expected.best_single
        assert [m for m in logs if m.startswith(f"dev {task}:")] == [  # what the dev work is, stage by stage
            f"dev {task}: ranking 2 members alone on 3 dev items (for the primary member and auto)",
            f"dev {task}: primary {primary} (dev accuracy s {100 * acc['s']:.1f}, q {100 * acc['q']:.1f}), 0.0 s",
            f"dev {task}: auto runs {len(expected.dev_acc)} rows and candidates on 2 dev items",
            f"dev {task}: auto chose {expected.chosen} (dev accuracy {100 * expected.dev_acc[expected.chosen]:.1f}; "
            f"best member {best.split(':')[1]} {100 * expected.dev_acc[best]:.1f}), 0.0 s"]
        assert (res["auto"][task]["dev_items"], res["auto"][task]["member_dev_items"]) == (2, 3)
        pool = res["auto"][task]["dev_pool"]  # the members asked for the form's default, the pool has 3
        assert (pool["size"], pool["asked"], pool["member_asked"]) == (3, 2, 500 if form == "likelihood" else 200)
        assert res["auto"][task]["dev_note"] == (f"dev items 3 of {pool['member_asked']} for the members alone: "
                                                 f"the dev pool ({pool['source']}) has 3")
        assert f"* {task}: {res['auto'][task]['dev_note']}." in (out / "results.md").read_text()
        chosen_file = out / "items" / f"{task}-{form}" / (expected.chosen.replace(":", "__") + ".jsonl")
        auto = read_records(out / "items" / f"{task}-{form}" / "auto.jsonl")
        assert {i: r["correct"] for i, r in auto.items()} == {i: r["correct"] for i, r in read_records(chosen_file).items()}
        assert {r["chosen"] for r in auto.values()} == {expected.chosen}
        if res["auto"][task]["config"]:  # the chosen configuration, as a config generate runs
            written = load_config(res["auto"][task]["config"])
            head = Path(res["auto"][task]["config"]).read_text()  # the header says how many and why
            assert f"# Fewer than asked: {res['auto'][task]['dev_note']}." in head
            want = ["s"] if expected.chosen == "single:s" else ["q"] if expected.chosen == "single:q" else ["s", "q"]
            assert [m.name for m in written.members] == want
        else:
            assert expected.chosen in ("vote", "mbr", "seq-avg")
    assert "`auto`'s choice per task" in (out / "results.md").read_text()

    def boom(*a, **k):
        raise AssertionError("a finished item ran again")

    monkeypatch.setattr(Ensemble, "generate", boom)
    monkeypatch.setattr(Ensemble, "loglikelihood", boom)
    again = run_eval(cfg, settings, members=members, union=union, log=lambda m: None)
    assert again["auto"] == res["auto"] and again["tasks"] == res["tasks"]
