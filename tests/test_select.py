"""``tokenfuse select``: the determine-then-ensemble rule, the written config, and a run end to end on
tiny random-weight members saved as local model directories, on the fixture benchmark."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import yaml
from conftest import tiny_model

import tokenfuse.select as select_mod
from tokenfuse.config import EnsembleConfig, load_config, parse_config
from tokenfuse.errors import TokenfuseError
from tokenfuse.select import (CandidateResult, Verdict, add_parser, config_yaml, format_table, length_ratio,
                              run, select_members, selected_config)

DATA = Path(__file__).resolve().parent / "data" / "bench"

pytestmark = pytest.mark.usefixtures("one_thread")


def cand(name: str, accuracy: float, mean_bytes: float) -> CandidateResult:
    return CandidateResult(name, accuracy, mean_bytes, 50)


def taken(decisions: list[Verdict]) -> list[str]:
    return [d.name for d in decisions if d.taken]


# ---------------------------------------------------------------------------------------- the rule
def test_best_first_then_next_best_within_bounds():
    results = [cand("c", 0.30, 40), cand("a", 0.50, 40), cand("b", 0.45, 60)]
    d = select_members(results)
    assert [(x.name, x.rank, x.taken) for x in d] == [("a", 1, True), ("b", 2, True), ("c", 3, False)]
    assert d[0].reason == "best accuracy"
    assert d[2].reason == "accuracy 20.0 points below the best (limit 10)"


def test_bounds_are_inclusive():
    # exactly 10 points below and exactly twice as long: taken
    assert taken(select_members([cand("a", 0.6, 100), cand("b", 0.5, 200)])) == ["a", "b"]
    assert taken(select_members([cand("a", 0.6, 100), cand("b", 0.5, 50)])) == ["a", "b"]
    # a hair beyond either bound: left out
    assert taken(select_members([cand("a", 0.6, 100), cand("b", 0.499, 100)])) == ["a"]
    assert taken(select_members([cand("a", 0.6, 100), cand("b", 0.6, 201)])) == ["a"]


def test_length_is_checked_against_every_chosen_member():
    # b is within 2x of a; c is within 2x of a (150/100) but not of b (150/60 = 2.5)
    results = [cand("a", 0.5, 100), cand("b", 0.48, 60), cand("c", 0.46, 150)]
    d = select_members(results)
    assert taken(d) == ["a", "b"]
    assert d[2].reason == "mean length 150 B vs b 60 B: 2.50x (limit 2x)"


def test_a_left_out_candidate_does_not_constrain_later_ones():
    results = [cand("a", 0.5, 100), cand("b", 0.49, 500), cand("c", 0.45, 120)]
    assert taken(select_members(results)) == ["a", "c"]


def test_max_members_and_ties():
    results = [cand("x", 0.4, 10), cand("y", 0.4, 10), cand("z", 0.4, 10)]
    d = select_members(results, max_members=2)
    assert [x.name for x in d] == ["x", "y", "z"]  # ties keep the candidates' order
    assert taken(d) == ["x", "y"]
    assert d[2].reason == "compatible, but --max-members 2 already taken"
    assert taken(select_members(results, max_members=1)) == ["x"]
    with pytest.raises(TokenfuseError, match="--max-members"):
        select_members(results, max_members=0)
    assert select_members([]) == []


def test_custom_bounds_and_empty_outputs():
    assert taken(select_members([cand("a", 0.6, 10), cand("b", 0.4, 10)], max_gap=20)) == ["a", "b"]
    assert taken(select_members([cand("a", 0.6, 10), cand("b", 0.6, 25)], max_ratio=3)) == ["a", "b"]
    assert length_ratio(0, 0) == 1.0 and math.isinf(length_ratio(0, 5)) and length_ratio(4, 2) == 2.0
    assert taken(select_members([cand("a", 0.6, 0), cand("b", 0.6, 3)])) == ["a"]


# ---------------------------------------------------------------------------------------- the config
BASE = {
    "members": [
        {"name": "a", "source": "/models/a", "backend": "transformers", "weight": 2.0},
        {"name": "b", "source": "/models/b.gguf", "n_ctx": 2048},
        {"name": "c", "dtype": "bfloat16"},
    ],
    "method": "gac",
    "gate": "c",
    "threshold": 0.5,
    "primary": "c",
    "window": 16,
    "decoding": {"max_new_tokens": 32},
}


def test_selected_config_keeps_member_fields_and_sets_scores():
    cfg = parse_config(BASE)
    results = [cand("a", 0.4, 10), cand("b", 0.5, 12), cand("c", 0.1, 10)]
    out = selected_config(cfg, results, select_members(results))
    assert [m.name for m in out.members] == ["b", "a"]  # ranked order
    assert [m.score for m in out.members] == [0.5, 0.4]
    a = out.members[1]
    assert (a.source, a.backend, a.weight) == ("/models/a", "transformers", 2.0)
    assert out.members[0].n_ctx == 2048
    assert out.primary is None and out.primary_name == "b"  # the highest score
    assert out.gate is None and out.threshold is None  # the gate was not chosen
    assert out.window == 16 and out.decoding.max_new_tokens == 32
    text = config_yaml(out)
    assert parse_config(yaml.safe_load(text)) == out  # only non-default fields are written, and they suffice
    assert yaml.safe_load(text)["members"][1] == {"name": "a", "source": "/models/a", "backend": "transformers",
                                                 "weight": 2.0, "score": 0.4}


def test_format_table_lists_every_candidate_with_its_reason():
    results = [CandidateResult("alpha", 0.5, 12.0, 4, "chat", 3.0), CandidateResult("b", 0.25, 10.0, 4, "raw", 1.0)]
    lines = format_table(results, select_members(results)).splitlines()
    assert lines[0].split() == ["rank", "candidate", "form", "items", "accuracy", "mean", "bytes", "time", "decision"]
    assert lines[1].split()[:6] == ["1", "alpha", "chat", "4", "50.0%", "12.0"]
    assert lines[1].endswith("taken: best accuracy")
    assert lines[2].endswith("left out: accuracy 25.0 points below the best (limit 10)")


# ---------------------------------------------------------------------------------------- end to end
SEEDS = {"m0": 0, "m1": 1, "m2": 2}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizers):
    """Three tiny random-weight models on the SmolLM2 tokenizer, saved as local model directories."""
    root = tmp_path_factory.mktemp("tiny-models")
    tok = tokenizers["smollm2"]
    dirs = {}
    for name, seed in SEEDS.items():
        d = root / name
        tiny_model(len(tok), seed=seed).save_pretrained(d)
        tok.save_pretrained(d)
        dirs[name] = d
    return dirs


@pytest.fixture
def candidates_yaml(tmp_path, model_dirs) -> Path:
    cfg = {"members": [{"name": n, "source": str(d), "backend": "transformers"} for n, d in model_dirs.items()],
           "method": "gac", "cache_dir": str(tmp_path / "cache")}
    path = tmp_path / "candidates.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def select_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tokenfuse")
    add_parser(parser.add_subparsers(dest="command"))
    return run(parser.parse_args(["select", *argv]))


def test_select_end_to_end_on_tiny_members(capsys, tmp_path, candidates_yaml):
    """Real loading and generation: the decisions follow the measured numbers and the config loads and runs."""
    from tokenfuse.load import load_ensemble

    out = tmp_path / "chosen.yaml"
    code = select_cli("--config", str(candidates_yaml), "--task", "arc_challenge", "--data", str(DATA),
                      "--limit", "0", "--max-new-tokens", "3", "--batch-size", "2", "--out", str(out), "--json",
                      "--predictions", str(tmp_path / "predictions.jsonl"))
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["task"] == "arc_challenge" and report["items"] == 3
    rows = report["candidates"]
    assert [r["name"] for r in rows] == ["m0", "m1", "m2"]
    assert all(r["n"] == 3 and r["prompt_form"] == "chat" and 0 <= r["accuracy"] <= 1 for r in rows)
    expected = select_members([CandidateResult(r["name"], r["accuracy"], r["mean_bytes"], r["n"]) for r in rows])
    assert report["chosen"] == taken(expected)
    assert [(r["rank"], r["taken"], r["reason"]) for r in sorted(rows, key=lambda r: r["rank"])] == \
        [(d.rank, d.taken, d.reason) for d in expected]
    preds = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [(p["candidate"], p["id"]) for p in preds] == [(m, i) for m in ("m0", "m1", "m2")
                                                          for i in ("ARC-dev-toy-1", "ARC-dev-toy-2", "ARC-dev-toy-3")]
    for r in rows:
        assert sum(p["correct"] for p in preds if p["candidate"] == r["name"]) == round(3 * r["accuracy"])
        assert r["mean_bytes"] == sum(p["bytes"] for p in preds if p["candidate"] == r["name"]) / 3
    cfg = load_config(out)
    assert [m.name for m in cfg.members] == report["chosen"]
    acc = {r["name"]: r["accuracy"] for r in rows}
    assert all(m.score == round(acc[m.name], 4) for m in cfg.members)
    text = out.read_text()
    assert text.startswith("# Chosen by `tokenfuse select`") and "arc_challenge, 3 items (seed 1234)" in text
    ens = load_ensemble(cfg, progress=False)
    assert ens.generate("Hello", max_new_tokens=2).steps <= 2


def test_select_picks_the_expected_members(capsys, monkeypatch, tmp_path, candidates_yaml):
    """The per-candidate evaluation scripted: m1 is best, m2 within 10 points but 3x as long, m0 compatible."""
    scripted = {"m0": (0.45, 40.0), "m1": (0.52, 30.0), "m2": (0.50, 90.0)}
    seen = []

    def fake_evaluate(ensemble, task, items, *, chat, batch_size, max_new_tokens, progress, name):
        seen.append((name, [m.name for m in ensemble.members], chat, len(items), task.name))
        acc, length = scripted[name]
        return CandidateResult(name, acc, length, len(items), "chat" if chat else "raw")

    monkeypatch.setattr(select_mod, "evaluate_candidate", fake_evaluate)
    out = tmp_path / "chosen.yaml"
    code = select_cli("--config", str(candidates_yaml), "--task", "piqa", "--data", str(DATA), "--limit", "1",
                      "--prompt-form", "raw", "--out", str(out), "--quiet")
    assert code == 0
    assert seen == [("m0", ["m0"], False, 1, "piqa"), ("m1", ["m1"], False, 1, "piqa"),
                    ("m2", ["m2"], False, 1, "piqa")]  # each candidate alone
    printed = capsys.readouterr().out
    assert "chosen: m1, m0" in printed
    assert "left out: mean length 90 B vs m1 30 B: 3.00x (limit 2x)" in printed
    cfg = load_config(out)
    assert [(m.name, m.score) for m in cfg.members] == [("m1", 0.52), ("m0", 0.45)]
    assert cfg.primary_name == "m1" and cfg.members[0].backend == "transformers"
    assert isinstance(cfg, EnsembleConfig) and cfg.cache_dir == str(tmp_path / "cache")


def test_select_prints_the_config_without_out(capsys, monkeypatch, candidates_yaml):
    def fake_evaluate(ensemble, task, items, *, chat, batch_size, max_new_tokens, progress, name):
        return CandidateResult(name, {"m0": 0.9, "m1": 0.1, "m2": 0.1}[name], 5.0, len(items), "chat")

    monkeypatch.setattr(select_mod, "evaluate_candidate", fake_evaluate)
    assert select_cli("--config", str(candidates_yaml), "--task", "boolq", "--data", str(DATA), "--quiet") == 0
    printed = capsys.readouterr().out
    assert "chosen: m0" in printed
    tail = printed.split("\n\n", 1)[1]
    assert [m["name"] for m in yaml.safe_load(tail)["members"]] == ["m0"]


def test_select_user_errors(monkeypatch, tmp_path, candidates_yaml):
    monkeypatch.delenv("TOKENFUSE_DATA", raising=False)
    with pytest.raises(TokenfuseError, match="TOKENFUSE_DATA"):
        select_cli("--config", str(candidates_yaml), "--task", "gsm8k")
    with pytest.raises(TokenfuseError, match=r"gsm8k/test\.jsonl"):
        select_cli("--config", str(candidates_yaml), "--task", "gsm8k", "--data", str(tmp_path))
    with pytest.raises(TokenfuseError, match="--limit"):
        select_cli("--config", str(candidates_yaml), "--task", "piqa", "--data", str(DATA), "--limit", "-2")
    with pytest.raises(TokenfuseError, match="--max-members"):
        select_cli("--config", str(candidates_yaml), "--task", "piqa", "--data", str(DATA), "--max-members", "0")
