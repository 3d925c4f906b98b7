"""The byte rows (engine/byte_rows.py): each a distribution over byte strings (its weights depend on the
past bytes only), and fits that do what they say."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tokenfuse.engine import byte_rows

ALPHABET = 3
LENGTH = 4
MEMBERS = 3


def _members(seed: int):
    """Three random byte-level models over a 3-letter alphabet: each a seeded table of the next letter's
    distribution given the letters before it."""
    rng = np.random.default_rng(seed)
    tables: list[dict] = [{} for _ in range(MEMBERS)]

    def cond(m: int, past: tuple[int, ...]) -> np.ndarray:
        if past not in tables[m]:
            tables[m][past] = rng.dirichlet(np.full(ALPHABET, 0.5))
        return tables[m][past]

    def q(s: tuple[int, ...]) -> np.ndarray:
        return np.array([[cond(m, s[:n])[s[n]] for m in range(MEMBERS)] for n in range(len(s))])

    return q


@pytest.fixture(scope="module")
def fitted():
    q = _members(0)
    rng = np.random.default_rng(1)
    dev = [q(tuple(rng.integers(0, ALPHABET, size=30).tolist())) for _ in range(4)]
    return byte_rows.fit_bytes(dev), dev


@pytest.mark.parametrize("row", byte_rows.BYTE_ROWS)
def test_every_row_is_a_distribution_over_strings(fitted, row):
    """The row's probabilities of all strings of each length sum to 1: its weights use past bytes only."""
    fit, _ = fitted
    q = _members(2)
    for n in range(1, LENGTH + 1):
        total = sum(math.exp(byte_rows.byte_logprobs(row, q(s), fit[row]).sum())
                    for s in itertools.product(range(ALPHABET), repeat=n))
        assert abs(total - 1.0) < 1e-12, (row, n, total)


def test_fits_improve_on_what_they_start_from(fitted):
    """On the dev bytes: EM's weights beat uniform, the best ``alpha`` beats none (or is none), and the
    gate (which starts at the mixture: ``A = 0``, ``b = log w``) is no worse than the mixture."""
    fit, dev = fitted
    q = np.concatenate(dev)

    def loss(row):
        return -sum(float(byte_rows.byte_logprobs(row, d, fit[row]).sum()) for d in dev)

    uniform = -float(np.log(q.mean(axis=1)).sum())
    assert loss("byte-mix") < uniform
    assert loss("byte-switch") <= -sum(float(byte_rows.switch_logprobs(d, np.array(fit["byte-mix"].w), 0.0).sum())
                                       for d in dev) + 1e-9
    assert loss("byte-gate") <= loss("byte-mix") + 1e-6
    assert math.isclose(sum(fit["byte-mix"].w), 1.0)


def test_the_gate_follows_the_member_that_has_been_right():
    """Member 0 predicts the first half perfectly and member 1 the second: the gate's weight moves from
    member 0 to member 1 after the switch, which a fixed mixture cannot do."""
    n = 400
    q = np.full((n, 2), 0.05)
    q[: n // 2, 0] = 0.95
    q[n // 2:, 1] = 0.95
    fit = byte_rows.fit_bytes([q, q.copy()])
    s = byte_rows.gate_weights(byte_rows.gate_features(np.log(q)), np.array(fit["byte-gate"].gate), 2)
    assert s[n // 2 - 1, 0] > 0.8 and s[-1, 1] > 0.8
    gate = -byte_rows.byte_logprobs("byte-gate", q, fit["byte-gate"]).sum()
    mix = -byte_rows.byte_logprobs("byte-mix", q, fit["byte-mix"]).sum()
    assert gate < 0.5 * mix


def test_an_unknown_row_is_named():
    with pytest.raises(ValueError, match="unknown byte row 'nope'"):
        byte_rows.byte_logprobs("nope", np.ones((1, 2)), byte_rows.ByteFitted())


def test_text_bytes_run_writes_results_and_resumes(make_tiny, one_thread, text_data, tmp_path, monkeypatch, capsys):
    """``tokenfuse eval --tasks text-bytes`` on tiny members: every row, each member alone as in the ``text``
    run (its own tokens, read from the byte view's rows), a rerun that computes nothing again."""
    import json

    from tokenfuse import cli, load
    from tokenfuse.engine import Ensemble
    from tokenfuse.engine.text_features import Rows
    from conftest import TEXT_DOCS
    from tokenfuse.eval.text import single_logprobs

    members = [make_tiny("gemma3", seed=7, name="g"), make_tiny("qwen", seed=8, name="q")]
    monkeypatch.setattr(load, "load_ensemble", lambda cfg, progress=True: Ensemble(members))
    args = ["eval", "--tasks", "text-bytes", "--data", str(text_data), "--out", str(tmp_path / "out"), "--quiet"]
    assert cli.main(args) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(res["rows"]) == {"single:g", "single:q", "bytes:g", "bytes:q", "doc-mix", *byte_rows.BYTE_ROWS}
    assert set(res["rows"]["byte-gate"]["vs_doc_mix"]["pooled"]) >= {"gain", "ci", "p_holm"}
    from tokenfuse.eval import pages  # the results pages render the run's results.md from results.json alone
    assert pages.render_run(tmp_path / "out") == (tmp_path / "out" / "results.md").read_text()
    items = [json.loads(x) for x in (tmp_path / "out" / "items-text-bytes.jsonl").read_text().splitlines()]
    rows = Rows.from_member(members[0])
    for item, t in zip(items, TEXT_DOCS.values()):
        alone = -float(single_logprobs(rows, t + "test").sum()) / math.log(2)
        assert abs(item["bits"]["single:g"] - alone) < 1e-3
    capsys.readouterr()
    assert cli.main(args) == 0
    assert "3 already done" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "results.json").read_text())["rows"] == res["rows"]

    # `tokenfuse score --bytes` with the run's fit gives a document the run's numbers (every row)
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT_DOCS["zh"] + "test", encoding="utf-8")
    fit = str(tmp_path / "out" / "results.json")
    assert cli.main(["score", str(doc), "--bytes", "--fitted", fit, "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["bytes"] == items[2]["bytes"] and set(scored["rows"]) == set(items[2]["bits"])
    for row, bits in items[2]["bits"].items():
        assert abs(scored["rows"][row]["bits"] - bits) < 1e-4, row
    assert set(scored["members"]) == {"g", "q"}  # what each member's byte model cost, beside its own scoring
    for i, cost in enumerate(scored["members"].values()):
        assert set(cost) == {"rows", "view_seconds", "own_seconds"} and cost["rows"] == items[2]["rows_read"][i]
    assert cli.main(["score", str(doc), "--bytes", "--json"]) == 0  # no fit: the members' weights, no gate
    assert set(json.loads(capsys.readouterr().out)["rows"]) == set(items[2]["bits"]) - {"byte-gate"}
    # the pruning as flags: the top rule reads more rows than the run's (the default, defer)
    assert res["rule"] == "defer" and res["keep"] == 2e-3
    assert cli.main(["score", str(doc), "--bytes", "--json", "--rule", "top", "--keep", "0.01"]) == 0
    top = json.loads(capsys.readouterr().out)["members"]
    assert all(top[m]["rows"] > scored["members"][m]["rows"] for m in top)
    assert cli.main(["score", str(doc), "--bytes", "--width", "two"]) != 0
    assert "--width: expected a positive number or none, got 'two'" in capsys.readouterr().err
    assert cli.main(["score", str(doc), "--bytes", "--keep", "2"]) != 0
    assert "--keep: expected 0 <= keep < 1, got 2.0" in capsys.readouterr().err
    # a run's views are all made with one pruning: resuming with another is refused, naming the flags
    assert cli.main(args + ["--rule", "top"]) != 0
    assert "resume it with the same pruning (--keep 0.002 --width 1 --rule defer" in capsys.readouterr().err
    assert cli.main(["score", str(doc), "--fitted", fit]) != 0
    assert "the fit of a text-bytes run; score its byte rows with --bytes" in capsys.readouterr().err
    assert cli.main(["score", str(doc), "--bytes", "--pieces"]) != 0
    assert "--pieces: the token-level rows' pieces" in capsys.readouterr().err
