"""Analyses: ECE on hand-made numbers, option confidence, tokenizer agreement on the real tokenizers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tokenfuse.analyze.calibration import from_records, option_confidence, reliability
from tokenfuse.analyze.tokenizers import agreement_matrix, pieces, table


def test_ece_on_hand_made_numbers():
    r = reliability([0.9, 0.8, 0.3, 0.3], [True, False, False, True], bins=10)
    # bins 9: acc 1 vs 0.9; 8: acc 0 vs 0.8; 3: acc 0.5 vs 0.3 -> (0.1 + 0.8 + 2 * 0.2) / 4
    assert r.ece == pytest.approx(0.325)
    assert r.bin_counts == (0, 0, 0, 2, 0, 0, 0, 0, 1, 1)
    assert r.accuracy == 0.5 and r.mean_confidence == pytest.approx(0.575)
    assert math.isnan(r.bin_accuracy[0])
    assert reliability([1.0, 0.0], [True, False], bins=4).ece == 0.0  # the edges fall into the end bins
    perfect = reliability([0.75] * 4, [True, True, True, False], bins=10)
    assert perfect.ece == pytest.approx(0.0)


def test_option_confidence_and_records():
    k, c = option_confidence([math.log(0.2), math.log(0.5), math.log(0.3)])
    assert k == 1 and c == pytest.approx(0.5)
    assert option_confidence([-math.inf, -math.inf]) == (0, 0.5)
    recs = [{"logprobs": [math.log(0.9), math.log(0.1)], "gold": 0},  # right, confident
            {"logprobs": [math.log(0.6), math.log(0.4)], "gold": 1}]  # wrong, 0.6
    r = from_records(recs, bins=10)
    assert r.accuracy == 0.5 and r.ece == pytest.approx((0.1 + 0.6) / 2)


WORDS = ["the", "hello", "understanding", "july", "february", "didn't", "behind"]


@pytest.fixture(scope="module")
def codecs(tokenizers):
    from tokenfuse.members.codec import ByteCodec

    return {k: ByteCodec(tokenizers[k]) for k in ("smollm2", "gemma3", "qwen")}


def test_tokenizer_agreement_on_real_tokenizers(codecs):
    assert pieces(codecs["smollm2"], " july") == (b" ju", b"ly")
    assert pieces(codecs["gemma3"], " july") == (b" july",)
    assert pieces(codecs["qwen"], "didn't") == (b"didn", b"'t")
    ws = agreement_matrix(codecs, WORDS, leading_space=True)
    wo = agreement_matrix(codecs, WORDS, leading_space=False)
    n = len(WORDS)
    # with a space: the, hello, understanding, behind agree everywhere; july and february split three
    # ways; " didn't" is [" didn", "'t"] for SmolLM2 and Qwen but [" didn", "'", "t"] for Gemma
    assert [[round(x * n) for x in row] for row in ws] == [[7, 4, 5], [4, 7, 4], [5, 4, 7]]
    assert [[round(x * n) for x in row] for row in wo] == [[7, 3, 2], [3, 7, 3], [2, 3, 7]]
    text = table(list(codecs), ws, wo, n).splitlines()
    assert text[3] == "| | smollm2 | gemma3 | qwen |"
    assert text[5] == "| smollm2 | — | 57.1 % | 71.4 % |"  # upper triangle: with a space
    assert text[6] == "| gemma3 | 42.9 % | — | 57.1 % |"  # lower triangle: without


def test_calibration_from_eval_records(tmp_path):
    from tokenfuse.analyze.calibration import run_calibration
    from tokenfuse.config import config_from_models
    from tokenfuse.eval.records import append_records, item_file

    ev = tmp_path / "ev"
    half = [math.log(0.5)] * 2
    append_records(item_file(ev, "piqa", "likelihood", "single:a"),
                   [{"id": "1", "gold": 0, "logprobs": [0.0, -math.inf]},
                    {"id": "2", "gold": 1, "logprobs": half},
                    {"id": "3", "gold": 0, "logprobs": half}])  # item 3: not run by gac, left out
    append_records(item_file(ev, "piqa", "likelihood", "gac"),
                   [{"id": "2", "gold": 1, "logprobs": half}, {"id": "1", "gold": 1, "logprobs": [0.0, -math.inf]}])
    append_records(item_file(ev, "piqa", "likelihood", "vote"), [{"id": "1", "gold": 0, "pred": 0}])
    text = run_calibration(config_from_models("a"), task="piqa", methods="gac", eval_out=ev, out=tmp_path / "o")
    lines = text.splitlines()
    assert lines[0].startswith("Calibration on piqa (likelihood form, 2 items, 10 bins")
    # single:a: item 1 right at confidence 1, item 2 wrong at 0.5 -> ECE (0 + 0.5) / 2
    assert lines[4] == "| single:a | 50.0 | 75.0 | 25.0 |"
    assert lines[5] == "| gac | 0.0 | 75.0 | 75.0 |"
    assert (tmp_path / "o" / "calibration.png").is_file()


# ------------------------------------------------------------- readings of eval records (no model)
DATA = Path(__file__).resolve().parent / "data" / "bench"


def _analyze(argv: list[str], capsys) -> list[str]:
    from tokenfuse.cli import main

    assert main(["analyze", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_compare_records_item_by_item(tmp_path, capsys):
    from tokenfuse.eval.records import append_records, item_file

    old, new = tmp_path / "old", tmp_path / "new"
    append_records(item_file(old, "piqa", "likelihood", "gac"),
                   [{"id": "1", "pred": 0, "logprobs": [-1.0, -2.0], "correct": True},
                    {"id": "2", "pred": 1, "logprobs": [-3.0, -0.5], "correct": False},
                    {"id": "4", "pred": 0, "logprobs": [-1.0, -2.0], "correct": True}])  # not in new: left out
    append_records(item_file(new, "piqa", "likelihood", "gac"),
                   [{"id": "1", "pred": 0, "logprobs": [-1.0, -2.0], "correct": True},
                    {"id": "2", "pred": 0, "logprobs": [-0.2, -0.5], "correct": True},
                    {"id": "3", "pred": 0, "logprobs": [-1.0, -2.0], "correct": True}])
    append_records(item_file(old, "piqa", "likelihood", "vote"), [{"id": "1", "pred": 0, "correct": True}])
    append_records(item_file(new, "piqa", "likelihood", "vote"), [{"id": "1", "pred": 1, "correct": False}])
    append_records(item_file(old, "piqa", "likelihood", "unite"), [{"id": "1", "pred": 0, "correct": True}])  # old only
    lines = _analyze(["compare", str(old / "items" / "piqa-likelihood"), str(new / "items" / "piqa-likelihood")],
                     capsys)
    # gac: items 1 and 2; item 2's log-probs moved by up to |-3.0 - -0.2| = 2.8 and its choice 1 -> 0
    assert lines == [(f"{'gac':40s}    2 items: log-probs changed on    1 (max |d| 2.800), choice changed on   1; "
                      "correct 1 -> 2"),
                     f"{'vote':40s}    1 items: choice changed on   1; correct 1 -> 0"]
    gen_old, gen_new = tmp_path / "g1", tmp_path / "g2"
    append_records(item_file(gen_old, "gsm8k", "generate", "single:a"),
                   [{"id": "1", "output": " 4", "correct": True}, {"id": "2", "output": " 5", "correct": False}])
    append_records(item_file(gen_new, "gsm8k", "generate", "single:a"),
                   [{"id": "1", "output": " 4.", "correct": True}, {"id": "2", "output": " 5", "correct": False}])
    assert _analyze(["compare", str(gen_old / "items" / "gsm8k-generate"), str(gen_new / "items" / "gsm8k-generate")],
                    capsys) == [f"{'single__a':40s}    2 items: output changed on   1; correct 1 -> 1"]


def test_letter_counts_on_the_fixture_items(tmp_path, capsys):
    from tokenfuse.cli import main
    from tokenfuse.eval.records import append_records, item_file

    ev = tmp_path / "ev"
    # the fixture's ARC-Challenge items: gold B, A, C; options up to E
    append_records(item_file(ev, "arc_challenge", "generate", "gac"),
                   [{"id": "ARC-toy-1", "extracted": "B", "correct": True},
                    {"id": "ARC-toy-2", "extracted": "A", "correct": True},
                    {"id": "ARC-toy-3", "extracted": None, "correct": False},
                    {"id": "ARC-other", "extracted": "D", "correct": True}])  # not one of the items: left out
    append_records(item_file(ev, "arc_challenge", "generate", "single:a"),
                   [{"id": "ARC-toy-1", "extracted": "B", "correct": True},
                    {"id": "ARC-toy-2", "extracted": "B", "correct": False}])
    lines = _analyze(["letters", "arc_challenge", "--eval-out", str(ev), "--data", str(DATA)], capsys)
    assert lines == ["             items    A    B    C    D    E none   acc",
                     "gold             3    1    1    1    0    0",
                     "always A         3" + " " * 32 + "33.3",
                     "always B         3" + " " * 32 + "33.3",
                     "always C         3" + " " * 32 + "33.3",
                     "gac              3    1    1    0    0    0    1  66.7",
                     "single__a        2    0    2    0    0    0    0  50.0"]
    assert main(["analyze", "letters", "arc_challenge", "--eval-out", str(ev), "--data", str(DATA), "--dev"]) == 2
    assert "no letter-form records in" in capsys.readouterr().err


def test_text_pieces_on_hand_made_features(tmp_path, capsys):
    import numpy as np

    from tokenfuse.engine.text_features import DocFeatures
    from tokenfuse.eval.text import doc_key
    from tokenfuse.tasks.text import Document

    docs = [Document("c1", "code", "hi yo"), Document("c2", "code", "skipped"), Document("p1", "prose", "é")]
    (tmp_path / "data" / "text").mkdir(parents=True)
    (tmp_path / "data" / "text" / "test.jsonl").write_text(
        "".join(json.dumps({"id": d.id, "domain": d.domain, "source": "s", "text": d.text}) + "\n" for d in docs),
        encoding="utf-8")
    run = tmp_path / "run"
    (run / "features" / "test-a").mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"members": ["a", "b"], "primary": "a",
                                                  "fitted": {"gac": {"weights": [0.5, 0.5]}}}))
    features = {  # primary a's pieces "hi", " yo" (the true one its first candidate) and "é" (not a candidate)
        "c1": DocFeatures(5, 0, np.array([0.5, 0.25]), np.array([[7, 8], [9, 10]]), np.array([[0.5, 0.3], [0.25, 0.5]]),
                          np.array([0, 0]), e={1: np.array([[0.9, 0.05], [0.5, 0.25]])}, piece_bytes=[2, 3]),
        "p1": DocFeatures(2, 0, np.array([0.2]), np.array([[3, 4]]), np.array([[0.4, 0.4]]), np.array([-1]),
                          e={1: np.array([[0.3, 0.3]])}, piece_bytes=[2]),
    }
    for d in docs:
        if d.id in features:
            np.savez(run / "features" / "test-a" / f"{doc_key(d)}.npz", **features[d.id].to_npz())
    lines = _analyze(["pieces", str(run), "--docs", "1", "--top", "1", "--data", str(tmp_path / "data")], capsys)
    # b's component of the true piece: e + (1 - Σe) p_a: 0.9 + 0.05·0.5 = 0.925, 0.5 + 0.25·0.25 = 0.5625,
    # 0 + 0.4·0.2 = 0.08; gac = their mean with p_a: 0.7125, 0.40625, 0.14
    # bits saved: log2(0.7125/0.5) = 0.511, log2(0.40625/0.25) = 0.700, log2(0.14/0.2) = -0.515
    assert lines == ["",
                     ("code c1: 5 bytes, 2 pieces; gac saves +1.2 bits (+0.2423 per byte); pieces better 2, worse 0; "
                      "saved on better pieces 1.2, lost on worse 0.0"),
                     "  lost most:",
                     " " * 20 + "'' | 'hi'         primary   -1.00 gac   -0.49 bits (others' exact-bytes e: 0.900)",
                     "  saved most:",
                     " " * 18 + "'hi' | ' yo'        primary   -2.00 gac   -1.30 bits (others' exact-bytes e: 0.500)",
                     "",
                     ("prose p1: 2 bytes, 1 pieces; gac saves -0.5 bits (-0.2573 per byte); pieces better 0, worse 1; "
                      "saved on better pieces 0.0, lost on worse -0.5"),
                     "  lost most:",
                     " " * 20 + "'' | 'é'          primary   -2.32 gac   -2.84 bits (others' exact-bytes e: -)",
                     "  saved most:",
                     " " * 20 + "'' | 'é'          primary   -2.32 gac   -2.84 bits (others' exact-bytes e: -)"]


def test_option_margins_against_the_best_member(tmp_path, capsys):
    from tokenfuse.analyze.options import item_numbers
    from tokenfuse.eval.records import append_records, item_file

    # gold 0; per byte: -4/4 = -1.0 (gold), -3/2 = -1.5, -10/5 = -2.0 -> nll 1.0, margin +0.5
    assert item_numbers({"gold": 0, "logprobs": [-4.0, -3.0, -10.0], "bytes": [4, 2, 5]}) == (1.0, 0.5)
    assert item_numbers({"gold": 1, "logprobs": [-1.0, -math.inf], "bytes": [1, 1]}) is None
    assert item_numbers({"gold": 0, "pred": 0}) is None  # no option scores
    recs = {  # two items, gold 0, one byte per option
        "single:a": [{"id": "1", "gold": 0, "logprobs": [-1.0, -2.0], "bytes": [1, 1], "correct": True},
                     {"id": "2", "gold": 0, "logprobs": [-3.0, -2.0], "bytes": [1, 1], "correct": False}],
        "single:b": [{"id": "1", "gold": 0, "logprobs": [-2.0, -1.0], "bytes": [1, 1], "correct": False},
                     {"id": "2", "gold": 0, "logprobs": [-2.5, -2.0], "bytes": [1, 1], "correct": False}],
        "byte-gate": [{"id": "1", "gold": 0, "logprobs": [-0.5, -2.0], "bytes": [1, 1], "correct": True},
                      {"id": "2", "gold": 0, "logprobs": [-1.5, -2.0], "bytes": [1, 1], "correct": True}],
    }
    for row, rs in recs.items():
        append_records(item_file(tmp_path, "piqa", "likelihood", row), rs)
    append_records(item_file(tmp_path, "piqa", "likelihood", "mbr"), [{"id": "1", "pred": 0, "correct": True}])
    lines = _analyze(["options", str(tmp_path)], capsys)
    assert lines[0] == "### piqa-likelihood (best member: single:a)"  # 50 % against b's 0 %
    table = {ln.split(" | ")[0][2:]: ln for ln in lines if ln.startswith("| ") and not ln.startswith("| row")}
    assert set(table) == {"byte-gate", "single:a", "single:b"}  # mbr has no option scores
    # byte-gate: nll (0.5 + 1.5) / 2 = 1.0, margin (1.5 + 0.5) / 2 = +1.0; a: nll (1 + 3) / 2 = 2.0, margin
    # (1 - 1) / 2 = 0; paired differences: nll -0.5, -1.5; margin +0.5, +1.5 (two items: the interval is their range)
    assert table["byte-gate"] == ("| byte-gate | 2 | 100.0 | 1.0000 | +1.0000 | -1.0000 [-1.5000, -0.5000] | "
                                  "+1.0000 [+0.5000, +1.5000] |")
    assert table["single:a"] == "| single:a | 2 | 50.0 | 2.0000 | +0.0000 | — | — |"
    from tokenfuse.cli import main

    assert main(["analyze", "options", str(tmp_path), "--tasks", "boolq"]) == 2  # a clear error, no traceback
    assert "no likelihood records of boolq" in capsys.readouterr().err
    assert main(["analyze", "options", str(tmp_path / "nothing")]) == 2
    assert "has no items/ folder" in capsys.readouterr().err
