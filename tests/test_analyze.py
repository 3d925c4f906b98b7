"""Analyses: ECE on hand-made numbers, option confidence, tokenizer agreement on the real tokenizers."""

from __future__ import annotations

import math

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
