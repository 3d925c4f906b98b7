"""Proper text scores (engine/text_features.py, engine/text_rows.py): properness by brute force, and the
numbers of the one-pass features against the members computed one id list at a time."""

from __future__ import annotations

import hashlib
import itertools
import math

import numpy as np
import pytest
import torch

from tokenfuse.combiners.mixers import ALPHAS, Fitted
from tokenfuse.engine import text_features, text_rows
from tokenfuse.engine.text_features import Rows, doc_features, primary_tokens
from tokenfuse.eval.text import aggregate, single_logprobs

ALPHABET = b"ab"
MAX_LEN = 5


def _fake_rows(member, seed: int) -> Rows:
    """``member``'s codec with a random model on it: every distribution is a seeded function of the
    id list, and all its mass is on the tokens made of ``ALPHABET`` only plus the END ids, so every
    byte string the model can produce is a string over ``ALPHABET`` (the brute force sees all of them)."""
    codec = member.codec
    allowed = torch.tensor([bool(b) and set(b) <= set(ALPHABET) for b in codec.token_bytes])
    for i in codec.end_ids:
        allowed[i] = True

    def fn(lists):
        out = []
        for ids in lists:
            h = int(hashlib.sha256(f"{seed}:{ids}".encode()).hexdigest()[:12], 16)
            g = torch.Generator().manual_seed(h)
            logits = torch.randn(len(codec.token_bytes), generator=g) * 3.0
            logits[~allowed] = float("-inf")
            out.append(torch.log_softmax(logits, dim=-1))
        return out

    return Rows(member.name, codec, member.encode_prompt(""), fn)


@pytest.fixture(scope="module")
def fake(make_tiny):
    fams = ("smollm2", "qwen", "gemma3")
    return [_fake_rows(make_tiny(f, seed=i, name=f), seed=i) for i, f in enumerate(fams)]


PARAMS = {"doc-mix": Fitted(weights=np.array([0.2, 0.5, 0.3])),
          "gac": Fitted(weights=np.array([0.3, 0.3, 0.4])),
          "switch": Fitted(weights=np.array([0.3, 0.3, 0.4]), alpha=0.2),
          "poe": Fitted(beta=np.array([0.5, 0.25, 0.25]))}


def _totals(members, primary: int, rows, *, k: int) -> dict[str, list[float]]:
    """For each row, Σ over every string of each length 1..MAX_LEN of its probability."""
    sums = {row: [0.0] * MAX_LEN for row in rows}
    vocabs: dict = {}
    for n in range(1, MAX_LEN + 1):
        for chars in itertools.product(ALPHABET.decode(), repeat=n):
            f = doc_features("".join(chars), members, primary, k=k, vocabs=vocabs)
            for row in rows:
                sums[row][n - 1] += math.exp(text_rows.row_logprob(row, f, [m.name for m in members],
                                                                   PARAMS.get(row, Fitted())))
    return sums


@pytest.mark.parametrize("primary", [0, 1, 2])
def test_every_row_is_a_distribution_over_byte_strings(fake, primary):
    """Each row's probabilities of all strings of one length sum to at most 1 (a sub-distribution:
    the mass of other tokenisations and of END is not counted), for every length up to MAX_LEN."""
    rows = [f"single:{m.name}" for m in fake] + list(text_rows.TEXT_ROWS)
    sums = _totals(fake, primary, rows, k=4)
    for row, s in sums.items():
        assert max(s) <= 1 + 1e-9, (row, s)
        assert max(s) > 0.1, (row, s)  # the check sees real mass, not a vanishing sum


def test_the_brute_force_catches_an_improper_rule(fake, monkeypatch):
    """Scoring a candidate by the member's mass of tokens that merely *start* with its bytes (an upper
    bound, as the option-ranking likelihood's first sub-token rule is) breaks properness here."""
    def prefix_mass(lp, ids):
        return 1.0 if len(ids) else 0.0  # every candidate the member can start gets all its mass

    monkeypatch.setattr(text_features, "_mass", prefix_mass)
    sums = _totals(fake, 0, ["gac"], k=4)
    assert max(sums["gac"]) > 1.0


def test_features_match_the_members_one_list_at_a_time(make_tiny):
    """On tiny random transformers members: the primary's numbers and each member's ``single`` equal
    the member's own next-token log-probabilities computed one id list at a time."""
    members = [make_tiny("qwen", seed=3, name="q"), make_tiny("gemma3", seed=4, name="g")]
    rows = [Rows.from_member(m) for m in members]
    text = "def f(x):\n    return x + 1  # 日本語"
    f = doc_features(text, rows, 0, k=8)

    def direct(m, ids):
        st = m.new_state(m.encode_prompt("") + ids)
        try:
            return m.next_logprobs([st])[0]
        finally:
            m.release(st)

    toks = primary_tokens(members[0].codec, text)
    for j in range(len(toks)):
        lp = direct(members[0], toks[:j])
        assert math.isclose(f.p_true[j], math.exp(float(lp[toks[j]])), rel_tol=1e-4, abs_tol=1e-9)
    own = primary_tokens(members[1].codec, text)
    expect = [float(direct(members[1], own[:j])[own[j]]) for j in range(len(own))]
    np.testing.assert_allclose(f.single[1], expect, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(single_logprobs(rows[1], text), expect, rtol=1e-4, atol=1e-5)
    assert np.all(f.e[1].sum(axis=1) <= 1 + 1e-9)
    assert f.nbytes == len(text.encode())


def test_fit_recovers_the_better_member_and_rows_aggregate(fake):
    dev = [doc_features(t, fake, 1, k=4) for t in ("abba", "aab", "babab", "bb")]
    fitted = text_rows.fit(dev, len(fake))
    for row in ("doc-mix", "gac"):
        assert math.isclose(fitted[row].weights.sum(), 1.0)
    assert fitted["switch"].alpha in ALPHAS
    assert math.isclose(fitted["poe"].beta.sum(), 1.0)
    # the fit maximises dev likelihood: no grid point or uniform weights do better on dev
    total = lambda row, p: sum(text_rows.row_logprob(row, f, [m.name for m in fake], p) for f in dev)  # noqa: E731
    uniform = Fitted(weights=np.full(3, 1 / 3))
    assert total("gac", fitted["gac"]) >= total("gac", uniform) - 1e-9
    assert total("poe", fitted["poe"]) >= total("poe", Fitted(beta=np.full(3, 1 / 3))) - 1e-9
    recs = [{"id": str(i), "domain": "x" if i % 2 else "y", "bytes": 4,
             "bits": {"single:a": 8.0 + i, "single:b": 14.0, "gac": 7.0 + i}} for i in range(6)]
    res = aggregate(recs, ["single:a", "single:b", "gac"], ["a", "b"])
    assert res["rows"]["gac"]["bpb"]["pooled"] == round(sum(7.0 + i for i in range(6)) / 24, 5)
    vs = res["rows"]["gac"]["vs_best"]["pooled"]
    assert vs["best"] == "single:a"
    assert vs["gain"] == round(1 - sum(7.0 + i for i in range(6)) / sum(8.0 + i for i in range(6)), 5)
    assert vs["ci"][0] > 0 and vs["p_holm"] >= vs["p"]


def test_score_command_prints_every_row_and_names_bad_files(make_tiny, tmp_path, monkeypatch, capsys):
    import json as _json

    from tokenfuse import cli, load
    from tokenfuse.engine import Ensemble

    members = [make_tiny("smollm2", seed=5, name="s"), make_tiny("qwen", seed=6, name="q")]
    monkeypatch.setattr(load, "load_ensemble", lambda cfg, progress=True: Ensemble(members))
    doc = tmp_path / "doc.txt"
    doc.write_text("print('hello')\n# 안녕하세요\n", encoding="utf-8")
    assert cli.main(["score", str(doc), "--json", "--pieces"]) == 0
    out = _json.loads(capsys.readouterr().out)
    assert out["bytes"] == len(doc.read_bytes())
    assert set(out["rows"]) == {"single:s", "single:q", "doc-mix", "gac", "switch", "poe"}
    text = doc.read_text(encoding="utf-8")
    own = single_logprobs(Rows.from_member(members[1]), text)
    assert math.isclose(out["rows"]["single:q"]["bits"], -own.sum() / math.log(2), rel_tol=1e-6)
    gac = out["rows"]["gac"]
    assert math.isclose(gac["bits"], -sum(gac["piece_logprobs"]) / math.log(2), rel_tol=1e-4)
    assert sum(out["piece_bytes"]) == out["bytes"]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff")
    assert cli.main(["score", str(bad)]) != 0
    assert f"{bad}: not UTF-8 text (byte 3 is not valid UTF-8)" in capsys.readouterr().err


def test_text_run_writes_results_and_resumes(make_tiny, text_data, tmp_path, monkeypatch, capsys):
    import json as _json

    from tokenfuse import cli, load
    from tokenfuse.engine import Ensemble
    from tokenfuse.errors import TokenfuseError

    members = [make_tiny("gemma3", seed=7, name="g"), make_tiny("qwen", seed=8, name="q")]
    monkeypatch.setattr(load, "load_ensemble", lambda cfg, progress=True: Ensemble(members))
    args = ["eval", "--tasks", "text", "--data", str(text_data), "--out", str(tmp_path / "out"), "--quiet"]
    assert cli.main(args) == 0
    res = _json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["test_documents"] == 3 and res["primary"] in ("g", "q")
    assert set(res["rows"]) == {"single:g", "single:q", "doc-mix", "gac", "switch", "poe"}
    assert set(res["rows"]["gac"]["bpb"]) == {"code", "en", "zh", "pooled"}
    assert set(res["rows"]["gac"]["vs_best"]["pooled"]) >= {"gain", "ci", "p_holm"}
    items = [_json.loads(x) for x in (tmp_path / "out" / "items-text.jsonl").read_text().splitlines()]
    assert [r["id"] for r in items] == ["test-code", "test-en", "test-zh"]
    capsys.readouterr()
    assert cli.main(args) == 0  # a rerun computes nothing again and gives the same numbers
    assert "3 already done" in capsys.readouterr().err
    again = _json.loads((tmp_path / "out" / "results.json").read_text())
    assert again["rows"] == res["rows"]
    assert all(again["seconds"][k] >= res["seconds"][k] for k in res["seconds"])  # the cost adds up
    with pytest.raises(TokenfuseError, match="text .* runs on its own"):
        from tokenfuse.eval import cli as eval_cli
        eval_cli.run(cli.build_parser().parse_args(["eval", "--tasks", "text,piqa"]))


def test_poe_with_a_zero_exponent_is_the_others_product(fake):
    """A member with exponent 0 leaves the product (0 · log 0 = 0, never NaN), even where its component is 0."""
    f = doc_features("abab", fake, 0, k=4)
    true, cand = text_rows.components(f, 3)
    true[:, 2] = 0.0
    cand[:, :, 2] = 0.0
    got = text_rows.poe_logprobs(true, cand, f, np.array([1.0, 0.0, 0.0]))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, np.log(f.p_true), rtol=1e-9)  # β on the primary alone: the primary


def picked_equals_whole_rows(member, text: str) -> int:
    """``Rows.logprobs_of`` (each row's one entry, taken where the backend computes the row) against
    the same entries of the whole rows, bit for bit; returns how many positions were compared."""
    rows = Rows.from_member(member)
    own = primary_tokens(rows.codec, text)
    lists = [rows.start + own[:j] for j in range(len(own))]
    whole = np.array([float(r[t]) for r, t in zip(rows.fn(lists), own)], dtype=np.float64)
    picked = rows.logprobs_of(lists, own)
    assert picked.dtype == np.float64 and np.array_equal(picked, whole)
    assert np.array_equal(single_logprobs(rows, text), whole)
    return len(own)


@pytest.mark.parametrize("batched", [True, False])
def test_picked_entries_are_the_whole_rows_entries(make_tiny, batched):
    text = "def f(x):\n    return x + 1  # 안녕 ünïcode\n" * 3
    for i, fam in enumerate(("smollm2", "qwen", "gemma3")):
        m = make_tiny(fam, seed=20 + i, name=f"{fam}-pick")
        m.batched = batched
        assert picked_equals_whole_rows(m, text) > 10


def test_a_document_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """``paths.save_npz`` (each document's numbers in the text runs, the tables in the cache): a writer
    stopped half-way leaves the file as it was and no temporary file, so a resumed run never reads half a
    file."""
    from tokenfuse import paths

    path = tmp_path / "docs" / "a.npz"
    paths.save_npz(path, q=np.arange(3.0))
    real = np.savez

    def dies(file, **arrays):
        real(file, **arrays)
        with open(file, "r+b") as fh:
            fh.truncate(10)  # half-written
        raise KeyboardInterrupt

    monkeypatch.setattr(paths.np, "savez", dies)
    with pytest.raises(KeyboardInterrupt):
        paths.save_npz(path, q=np.arange(5.0))
    assert np.load(path)["q"].tolist() == [0.0, 1.0, 2.0]
    assert [p.name for p in path.parent.iterdir()] == ["a.npz"]
