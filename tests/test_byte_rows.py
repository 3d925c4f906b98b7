"""The byte rows (engine/text_rows.py, on the mixers of combiners/mixers.py): each a distribution over byte
strings (its weights depend on the past bytes only), fits that do what they say, and the mixers the
``byte`` method steps with giving the rows' numbers."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tokenfuse.combiners import mixers
from tokenfuse.combiners.mixers import Fitted, Mixer
from tokenfuse.engine import text_rows

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
    return text_rows.fit_bytes(dev), dev


@pytest.mark.parametrize("row", text_rows.BYTE_ROWS)
def test_every_row_is_a_distribution_over_strings(fitted, row):
    """The row's probabilities of all strings of each length sum to 1: its weights use past bytes only."""
    fit, _ = fitted
    q = _members(2)
    for n in range(1, LENGTH + 1):
        total = sum(math.exp(text_rows.byte_logprobs(row, q(s), fit[row]).sum())
                    for s in itertools.product(range(ALPHABET), repeat=n))
        assert abs(total - 1.0) < 1e-12, (row, n, total)


def test_fits_improve_on_what_they_start_from(fitted):
    """On the dev bytes: EM's weights beat uniform, the best ``alpha`` beats none (or is none), and the
    gate (which starts at the mixture: ``A = 0``, ``b = log w``) is no worse than the mixture."""
    fit, dev = fitted
    q = np.concatenate(dev)

    def loss(row):
        return -sum(float(text_rows.byte_logprobs(row, d, fit[row]).sum()) for d in dev)

    uniform = -float(np.log(q.mean(axis=1)).sum())
    assert loss("byte-mix") < uniform
    no_share = Fitted(weights=fit["byte-mix"].weights, alpha=0.0)
    assert loss("byte-switch") <= -sum(float(mixers.mixed_logprobs("switch", d, no_share).sum()) for d in dev) + 1e-9
    assert loss("byte-gate") <= loss("byte-mix") + 1e-6
    assert math.isclose(sum(fit["byte-mix"].weights), 1.0)


def test_the_gate_follows_the_member_that_has_been_right():
    """Member 0 predicts the first half perfectly and member 1 the second: the gate's weight moves from
    member 0 to member 1 after the switch, which a fixed mixture cannot do."""
    n = 400
    q = np.full((n, 2), 0.05)
    q[: n // 2, 0] = 0.95
    q[n // 2:, 1] = 0.95
    fit = text_rows.fit_bytes([q, q.copy()])
    mixer, s = Mixer("gate", fit["byte-gate"], 2), []
    for p in q:
        s.append(mixer.weights())
        mixer.update(p)
    assert s[n // 2 - 1][0] > 0.8 and s[-1][1] > 0.8
    gate = -text_rows.byte_logprobs("byte-gate", q, fit["byte-gate"]).sum()
    mix = -text_rows.byte_logprobs("byte-mix", q, fit["byte-mix"]).sum()
    assert gate < 0.5 * mix


@pytest.mark.parametrize("kind", ["mixture", "switch", "gate"])
def test_a_mixer_stepping_whole_distributions_gives_the_rows_numbers(fitted, kind):
    """The ``byte`` method's use of a mixer (``combine`` on each member's whole next distribution, then
    ``update`` with each member's probability of the symbol taken) gives each symbol the probability the
    row computes from the members' probabilities of it alone (``mixed_logprobs``)."""
    fit, _ = fitted
    p = {"mixture": fit["byte-mix"], "switch": Fitted(weights=fit["byte-mix"].weights, alpha=0.1),
         "gate": fit["byte-gate"]}[kind]
    rng = np.random.default_rng(3)
    dists = [np.log(rng.dirichlet(np.full(ALPHABET, 0.5), size=MEMBERS)) for _ in range(12)]
    text = [int(rng.integers(ALPHABET)) for _ in dists]
    mixer, got = Mixer(kind, p, MEMBERS), []
    for lps, x in zip(dists, text):
        q = mixer.combine(list(lps))
        assert math.isclose(q.sum(), 1.0)
        got.append(math.log(q[x]))
        mixer.update(np.exp(lps[:, x]))
    want = mixers.mixed_logprobs(kind, np.array([np.exp(lps[:, x]) for lps, x in zip(dists, text)]), p)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_a_mixer_refuses_numbers_that_do_not_fit_it():
    with pytest.raises(ValueError, match="mixer gate: needs 21 fitted numbers for 3 members"):
        Mixer("gate", Fitted(gate=np.zeros(4)), 3)
    with pytest.raises(ValueError, match="mixer switch: needs 3 weights"):
        Mixer("switch", Fitted(weights=np.ones(2) / 2), 3)
    with pytest.raises(ValueError, match="mixer product: needs each member's whole next distribution"):
        mixers.mixed_logprobs("product", np.ones((1, 2)), Fitted(weights=np.ones(2) / 2))


def test_fitted_numbers_read_back_and_the_older_spelling():
    f = Fitted(weights=np.array([0.25, 0.75]), alpha=0.01, gate=np.arange(3.0))
    back = Fitted.from_dict(f.as_dict())
    assert back.weights.tolist() == [0.25, 0.75] and back.alpha == 0.01 and back.gate.tolist() == [0.0, 1.0, 2.0]
    assert Fitted.from_dict({"w": [0.5, 0.5]}).weights.tolist() == [0.5, 0.5]  # a text-bytes run before one Fitted


def test_an_unknown_row_is_named():
    with pytest.raises(ValueError, match="unknown byte row 'nope'"):
        text_rows.byte_logprobs("nope", np.ones((1, 2)), Fitted())


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
    assert set(res["rows"]) == {"single:g", "single:q", "bytes:g", "bytes:q", "doc-mix", *text_rows.BYTE_ROWS}
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
    assert set(json.loads(capsys.readouterr().out)["rows"]) == set(items[2]["bits"]) - {"byte-gate", "byte-online"}
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
