"""``tokenfuse analyze answers``: the gold answers' bytes under each member's byte model after its own
prompt and under the byte rows, as generation gives them; the tables on hand-made numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tokenfuse.analyze.answers import TaskBytes, answer_bytes, byte_kinds, gold_rows, task_table
from tokenfuse.config import config_from_models
from tokenfuse.engine import Ensemble
from tokenfuse.errors import TokenfuseError

BENCH = Path(__file__).parent / "data" / "bench"


@pytest.fixture(scope="module")
def pair(make_tiny, one_thread):
    return [make_tiny("smollm2", seed=5, name="s"), make_tiny("qwen", seed=6, name="q")]


def test_byte_kinds():
    k = byte_kinds(b"3 + 4 = 7.\n#### 7", "7")
    assert k["first"].tolist() == [True] + [False] * 16
    assert np.flatnonzero(k["digits"]).tolist() == [0, 4, 8, 16]
    assert np.flatnonzero(k["space"]).tolist() == [1, 3, 5, 7, 10, 15]
    assert np.flatnonzero(k["answer"]).tolist() == [16]  # the answer's last occurrence
    assert np.flatnonzero(k["other"]).tolist() == [2, 6, 9, 11, 12, 13, 14]
    assert not k["letters"].any()
    assert not byte_kinds(b"Mars", "Venus")["answer"].any() and byte_kinds(b"Mars", "Mars")["answer"].all()


def test_the_table_on_hand_made_numbers():
    tb = TaskBytes()
    ln = math.log
    tb.add(b"ab", "b", {"m1": [ln(0.5), ln(0.5)], "m2": [ln(0.25), ln(0.25)], "byte-gate": [ln(0.4), ln(0.6)]})
    tb.add(b"c", "c", {"m1": [ln(0.5)], "m2": [ln(1.0)], "byte-gate": [ln(0.8)]})
    # pooled over the three bytes: m1 3 ln2 / 3, m2 4 ln2 / 3: m1 is the best member
    assert tb.nats("m1") == pytest.approx(ln(2)) and tb.nats("m2") == pytest.approx(4 * ln(2) / 3)
    assert tb.best_member(["m1", "m2"]) == "m1"
    assert tb.nats("byte-gate", "first") == pytest.approx(-(ln(0.4) + ln(0.8)) / 2)
    assert tb.nats("byte-gate", "answer") == pytest.approx(-(ln(0.6) + ln(0.8)) / 2)
    assert math.isnan(tb.nats("m1", "digits"))
    lines = task_table("demo", tb, ["m1", "m2"], "the chat form's target", top=2)
    assert lines[0] == "### demo: 2 items, 3 gold bytes (the chat form's target); best member m1"
    gate = next(line for line in lines if line.startswith("| byte-gate |"))
    assert "| 33.3 % |" in gate  # one byte of three (the first, 0.4 < 0.5) below m1
    assert gate.split(" | ")[3] == "—"  # no digits
    assert lines[-3].startswith("| 0 | b'a' | 0.22 |") and "`[a]b`" in lines[-3]  # ln(0.5 / 0.4)


def test_gold_bytes_after_an_empty_prompt_are_what_scoring_gives(pair, align_cache, tmp_path, byte_fit):
    """After an empty prompt each member's byte model starts at its start ids and each mixer is new, as
    ``Ensemble.score_prompt`` scores a text (whose numbers generation uses, tests/test_bytegen.py): the same
    log-probability for every byte, for each mixer."""
    text = "Tom has 3 + 4 = 7 apples."
    fit = byte_fit(["s", "q"], weights=[0.7, 0.3])
    rows = {name: Ensemble(pair, method="byte", params={"mix": mix, "fit": fit, "rule": "top", "keep": 0.05},
                           align_cache=align_cache)
            for name, mix in (("byte-mix", "mixture"), ("byte-gate", "gate"), ("byte-online", "online"))}
    got = gold_rows(rows, "", text)
    assert set(got) == {"s", "q", "byte-mix", "byte-gate", "byte-online"}
    for name, ens in rows.items():
        want = [p.logprob for p in ens.score_prompt(text)]
        np.testing.assert_allclose(got[name], want, rtol=1e-9, atol=1e-9)
    assert not np.allclose(got["byte-gate"], got["byte-mix"])
    alone = Ensemble([pair[0]], method="byte", params={"rule": "top", "keep": 0.05}, align_cache=align_cache)
    np.testing.assert_allclose(got["s"], [p.logprob for p in alone.score_prompt(text)], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("chat", [False, True])
def test_gold_bytes_after_a_prompt_are_what_generation_reads(pair, align_cache, chat):
    """Scoring a greedy output as gold after its prompt (each member's byte model after its own ids of the
    prompt, raw or through its chat template): each member's probability of each byte is the one generation
    traced; the masked mixture generation chose from gives each byte at least the unmasked mixture's."""
    ens = Ensemble(pair, method="byte", params={"rule": "top", "keep": 0.05}, align_cache=align_cache)
    prompt = "Question: what is 2 + 2?"
    g = ens.generate(prompt, max_new_tokens=6, trace=True, chat=chat)
    got = gold_rows({"byte-mix": ens}, prompt, g.output.decode("utf-8"), chat=chat)
    assert len(g.trace) == len(g.output) >= 1
    for t, step in enumerate(g.trace):
        for m in step.members:
            assert math.exp(got[m.name][t]) == pytest.approx(m.piece_prob, rel=1e-5)
        assert step.prob >= math.exp(got["byte-mix"][t]) * (1 - 1e-6)
    other = gold_rows({"byte-mix": ens}, prompt + " ", g.output.decode("utf-8"), chat=chat)
    assert not np.allclose(other["s"], got["s"])  # the prompt's ids are where the models start


def test_answers_on_a_generative_task(pair, tmp_path, byte_fit):
    """Three GSM8K items: every member and byte row over the gold solutions' bytes (the chat form: both
    tiny members' tokenizers have chat templates), the pooled numbers in answers.json those of its items."""
    from tokenfuse import Ensemble as Ens

    cfg = config_from_models("s,q", method="byte", params={"fit": byte_fit(["s", "q"], weights=[0.7, 0.3])})
    text = answer_bytes(cfg, ["gsm8k"], limit=3, data=str(BENCH), top=3, out=tmp_path / "out", progress=False,
                        members=pair, union=Ens(pair).union)
    assert text.startswith("### gsm8k: 3 items, ") and "(the chat form's target)" in text.splitlines()[0]
    for row in ("s", "q", "byte-mix", "byte-gate", "byte-online"):
        assert f"\n| {row} | " in text
    dump = json.loads((tmp_path / "out" / "answers.json").read_text())
    t = dump["tasks"]["gsm8k"]
    items = t["items"]
    golds = {json.loads(line)["id"]: json.loads(line)["solution"].strip()
             for line in (BENCH / "gsm8k" / "test.jsonl").read_text().splitlines()}
    assert [it["bytes"] for it in items] == [len(golds[it["id"]].encode()) for it in items]
    for row in ("s", "byte-gate"):
        pooled = -sum(it[row] for it in items) / sum(it["bytes"] for it in items)
        assert t["nats_per_byte"][row]["all"] == pytest.approx(pooled)
    assert all(v is None or math.isfinite(v) for r in t["nats_per_byte"].values() for v in r.values())
    assert t["best_member"] == min(("s", "q"), key=lambda m: t["nats_per_byte"][m]["all"])
    assert (tmp_path / "out" / "answers.md").read_text().startswith("### gsm8k")


def test_errors_name_the_fix(pair, tmp_path):
    union = Ensemble(pair).union
    with pytest.raises(TokenfuseError, match="analyze answers: arc_easy run in the likelihood form; .*analyze options"):
        answer_bytes(config_from_models("s,q"), ["arc_easy"], data=str(BENCH), members=pair, union=union,
                     progress=False)
    with pytest.raises(TokenfuseError, match="analyze answers: bbh's items have no gold answer text .*'reasoning'"):
        answer_bytes(config_from_models("s,q"), ["bbh"], limit=1, data=str(BENCH), members=pair, union=union,
                     progress=False)
    with pytest.raises(TokenfuseError, match="--limit: expected 1 or more items"):
        answer_bytes(config_from_models("s,q"), ["gsm8k"], limit=0, data=str(BENCH), members=pair, union=union)
    # without a fit for these members the gate rows are left out, said; byte-mix stays
    text = answer_bytes(config_from_models("s,q"), ["triviaqa"], limit=1, data=str(BENCH), members=pair,
                        union=union, progress=False, top=0)
    assert text.startswith("byte-gate: left out (params.fit: the bundled members' fit is for members")
    assert "\n| byte-mix | " in text and "| byte-gate |" not in text
