"""tokenfuse eval's answer-level rows: SLM-MUX (``mux``) and self-consistency (``sc:<member>``)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from tokenfuse.config import config_from_models
from tokenfuse.errors import TokenfuseError
from tokenfuse.eval.answers import answer_record, mux_pick, sample_seed, samples_needed, sc_pick
from tokenfuse.eval.methods import MethodSpec, answer_key, parse_methods, plan_methods
from tokenfuse.eval.runner import EvalSettings, run_eval


# ---------------------------------------------------------------------------------------- the rules
def test_sc_pick_majority_first_sampled_and_abstentions():
    assert sc_pick(["7", "18", "18.0", "7", "18"]) == (1, 3)  # 18 = 18.0 (answer_key): 3 votes
    assert sc_pick(["B", "A", "a", "b"]) == (0, 2)  # a tie between A and B: the answer sampled first
    assert sc_pick([None, "paris", None, "Paris.", "rome"]) == (1, 2)  # None casts no vote
    assert sc_pick([None, None]) == (0, 0)  # nobody answered: the first sample


def test_mux_pick_the_most_consistent_member_wins():
    primary = ["1", "2", "3", "4", "5"]  # consistency 1
    steady = ["9", "9", "9.0", "8", None]  # consistency 3 (9 = 9.0), one abstention
    assert mux_pick([primary, steady], primary=0) == (1, 0, [1, 3])  # not primary, but consistent: it wins
    # Equal consistency: the primary member (the dev-best), wherever it stands.
    assert mux_pick([["a", "a", "b"], ["c", "d", "d"]], primary=1) == (1, 1, [2, 2])
    assert mux_pick([["a", "a", "b"], ["c", "d", "d"]], primary=0) == (0, 0, [2, 2])
    # A tie the primary member is not in: member order.
    assert mux_pick([["x", "y"], ["a", "a"], ["b", "b"]], primary=0) == (1, 0, [1, 2, 2])
    # Abstentions: a member whose samples have no answer has consistency 0.
    assert mux_pick([[None, None, None], [None, "5", None]], primary=0) == (1, 1, [0, 1])
    assert mux_pick([[None, None], [None, None]], primary=1) == (1, 0, [0, 0])  # nobody answered: primary


def test_answer_records_use_the_matched_budget():
    """``mux`` takes the first k samples of each member, ``sc:<member>`` the first k × M of one."""
    def samples(extracted, correct, seconds):
        return {"outputs": [f"out {x}" for x in extracted], "extracted": extracted, "correct": correct,
                "steps": [2] * len(extracted), "seconds": seconds}

    drawn = {"a": samples(["1", "2", "3", "3"], [False, True, False, False], 4.0),
             "b": samples(["5", "5", "6", "6"], [True, True, False, False], 8.0)}
    mux = answer_record(MethodSpec("mux", "answers", ("a", "b")), "q1", drawn, k=2, width=2, primary="a")
    # a's first two answers differ (consistency 1), b's agree (2): b's 5. a's later 3, 3 do not count.
    assert mux == {"id": "q1", "output": "out 5", "extracted": "5", "correct": True, "chosen": "b",
                   "consistency": [1, 2], "samples": 4, "steps": 8, "seconds": 6.0, "sampling_seconds": 12.0}
    sc_a = answer_record(MethodSpec("sc:a", "answers", ("a",)), "q1", drawn, k=2, width=2, primary="a")
    assert sc_a == {"id": "q1", "output": "out 3", "extracted": "3", "correct": False, "votes": 2, "samples": 4,
                    "steps": 8, "seconds": 4.0, "sampling_seconds": 12.0}
    sc_b = answer_record(MethodSpec("sc:b", "answers", ("b",)), "q1", drawn, k=2, width=2, primary="a")
    assert (sc_b["extracted"], sc_b["votes"], sc_b["correct"]) == ("5", 2, True)  # 5 and 6 tie: 5 came first
    specs = plan_methods(config_from_models("a,b"), ["mux", "sc"], form="generate", registered=[])
    assert samples_needed(specs, 5, 2) == {"a": 10, "b": 10}
    assert samples_needed(specs[:1], 5, 2) == {"a": 5, "b": 5}  # mux alone: k each


def test_sample_seeds_are_per_item_member_and_index():
    seeds = {sample_seed(1234, i, m, j) for i in ("q1", "q2") for m in ("a", "b") for j in range(5)}
    assert len(seeds) == 20 and all(0 <= s < 2 ** 63 for s in seeds)
    assert sample_seed(1234, "q1", "a", 0) == sample_seed(1234, "q1", "a", 0) != sample_seed(1235, "q1", "a", 0)


ANSWERS = st.one_of(st.none(), st.sampled_from(["1", "1.0", "2", "A", "a", "paris", "Paris."]))


@hsettings(max_examples=200, deadline=None)
@given(st.lists(st.lists(ANSWERS, min_size=4, max_size=4), min_size=1, max_size=4), st.data())
def test_order_of_samples_within_a_member_changes_no_consistency(members, data):
    """Permuting a member's samples changes no consistency, nor the chosen member; the answer only
    where the member's most frequent answer was tied (the tie goes to the first sampled)."""
    primary = data.draw(st.integers(0, len(members) - 1))
    shuffled = [data.draw(st.permutations(xs)) for xs in members]
    m, j, cons = mux_pick(members, primary=primary)
    m2, j2, cons2 = mux_pick(shuffled, primary=primary)
    assert (m2, cons2) == (m, cons)
    counts = Counter(answer_key(a) for a in members[m] if answer_key(a) is not None)
    if list(counts.values()).count(max(counts.values(), default=0)) == 1:
        assert answer_key(shuffled[m][j2]) == answer_key(members[m][j])
    for xs, ys in zip(members, shuffled):
        (i, votes), (i2, votes2) = sc_pick(xs), sc_pick(ys)
        assert votes == votes2 == max(Counter(answer_key(a) for a in xs if answer_key(a)).values(), default=0)


@hsettings(max_examples=200, deadline=None)
@given(st.lists(ANSWERS, min_size=1, max_size=5), st.data())
def test_one_sample_each_is_the_primary_members_answer(answers, data):
    """k = 1: every answering member has consistency 1, so mux is the primary member's answer when
    it gave one, else the first answering member's (member order), else the primary's sample."""
    primary = data.draw(st.integers(0, len(answers) - 1))
    m, j, _ = mux_pick([[a] for a in answers], primary=primary)
    answering = [i for i in [primary, *range(len(answers))] if answer_key(answers[i]) is not None]
    assert (m, j) == ((answering[0] if answering else primary), 0)


def test_plan_mux_and_sc_generate_form_only():
    cfg = config_from_models("smollm2-135m-instruct,gemma3-270m")
    assert "mux" in parse_methods("mux,sc") and "sc" in parse_methods("mux,sc")
    gen = plan_methods(cfg, ["vote", "mux", "sc"], form="generate", registered=[])
    assert [(s.name, s.kind, s.members) for s in gen[2:]] == [
        ("vote", "output", ("smollm2-135m-instruct", "gemma3-270m")),
        ("mux", "answers", ("smollm2-135m-instruct", "gemma3-270m")),
        ("sc:smollm2-135m-instruct", "answers", ("smollm2-135m-instruct",)),
        ("sc:gemma3-270m", "answers", ("gemma3-270m",))]
    logs: list[str] = []
    lik = plan_methods(cfg, ["mux", "sc"], form="likelihood", registered=[], log=logs.append)
    assert [s.name for s in lik] == ["single:smollm2-135m-instruct", "single:gemma3-270m", "seq-avg"]
    assert [m.split(":")[0] for m in logs] == ["mux", "sc"] and all("generate form" in m for m in logs)


def test_cli_sample_options(monkeypatch, capsys):
    from tokenfuse.cli import main
    from tokenfuse.eval import cli

    seen = []

    def fake_run(cfg, settings):
        seen.append(settings)
        raise TokenfuseError("stop here")

    monkeypatch.setattr(cli, "run_eval", fake_run)
    assert main(["eval", "--methods", "mux,sc", "--samples", "3", "--sample-temperature", "0.5"]) == 2
    assert (seen[0].samples, seen[0].sample_temperature) == (3, 0.5)
    assert main(["eval", "--samples", "0"]) == 2
    assert main(["eval", "--sample-temperature", "0"]) == 2
    err = capsys.readouterr().err
    assert "--samples: expected 1 or more, got 0" in err and "--sample-temperature: expected more than 0" in err


# ---------------------------------------------------------------------------------------- a run
QA = [{"id": f"tq-{i}", "question": q, "answer": a, "aliases": [a]} for i, (q, a) in
      enumerate([("Capital of France?", "Paris"), ("2+2?", "4"), ("Color of the sky?", "blue")])]


@pytest.fixture()
def data_dir(tmp_path):
    root = tmp_path / "data" / "triviaqa"
    root.mkdir(parents=True)
    for name in ("test.jsonl", "dev.jsonl"):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in QA), encoding="utf-8")
    return tmp_path / "data"


@pytest.fixture()
def tiny_pair(make_tiny, one_thread):
    from tokenfuse import Ensemble

    members = [make_tiny("smollm2", seed=1, name="s"), make_tiny("qwen", seed=2, name="q")]
    return members, Ensemble(members).union


def lines(path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_run_samples_reproducibly_resumes_and_reports(tiny_pair, data_dir, tmp_path, monkeypatch):
    from tokenfuse.engine import Ensemble

    members, union = tiny_pair
    cfg = config_from_models("s,q")

    def run(out, methods, batch_size=4):
        settings = EvalSettings(tasks=["triviaqa"], methods=methods, limit=3, data=str(data_dir), out=str(out),
                                batch_size=batch_size, num_fewshot=0, max_new_tokens={"triviaqa": 3},
                                progress=False, samples=2)
        return run_eval(cfg, settings, members=members, union=union, log=lambda m: None)

    calls = []
    generate = Ensemble.generate

    def spy(self, prompts, **kw):
        calls.append((self.members[0].name, len(prompts), kw["sampling"]))
        return generate(self, prompts, **kw)

    monkeypatch.setattr(Ensemble, "generate", spy)
    res = run(tmp_path / "a", ["single", "mux", "sc"])
    items = tmp_path / "a" / "items" / "triviaqa-generate"
    drawn = {m: lines(items / f"samples__{m}.jsonl") for m in ("s", "q")}
    assert {m: [len(r["outputs"]) for r in d.values()] for m, d in drawn.items()} == {"s": [4] * 3, "q": [4] * 3}
    # Each member samples alone, one item's k × M = 4 samples per call (batch size 4), each its own seed.
    sampled = [c for c in calls if isinstance(c[2], list)]
    assert [(name, n) for name, n, _ in sampled] == [("s", 4), ("q", 4)] * 3
    assert all(len({sp.seed for sp in sps}) == 4 and {sp.temperature for sp in sps} == {0.7} for _, _, sps in sampled)
    assert any(len(set(r["outputs"])) > 1 for d in drawn.values() for r in d.values())  # the seeds differ
    assert sorted(res["overview"]) == ["mux", "sc:q", "sc:s", "single:q", "single:s"]
    cell = res["tasks"]["triviaqa"]
    assert cell["mux"]["samples_per_item"] == cell["sc:s"]["samples_per_item"] == 4
    assert cell["mux"]["vs_best_sc"]["row"] in ("sc:s", "sc:q") and res["settings"]["samples"] == 2
    sampling = sum(r["seconds"] for d in drawn.values() for r in d.values())
    singles = sum(cell[m]["seconds"] for m in ("single:s", "single:q"))
    assert res["task_wall"]["triviaqa"]["seconds"] == pytest.approx(singles + sampling, abs=1e-3)
    assert cell["mux"]["seconds"] == pytest.approx(sampling / 2, abs=1e-3)  # 2 of each member's 4 samples
    md = (tmp_path / "a" / "results.md").read_text()
    assert "| mux | 4 | " in md and "| sc:s | 4 | " in md and "| task | best sc | mux − best sc |" in md
    from tokenfuse.eval.pages import sections

    tables = sections(md)  # the results pages can cut the two new tables
    assert [r[:2] for r in tables["answers"]] == [["row", "samples/item"], ["mux", "4"], ["sc:s", "4"], ["sc:q", "4"]]
    assert tables["mux"][1][:2] == ["triviaqa", cell["mux"]["vs_best_sc"]["row"]]
    mux = lines(items / "mux.jsonl")
    for r in mux.values():  # mux's answer is the chosen member's sample
        assert r["extracted"] in drawn[r["chosen"]][r["id"]]["extracted"][:2] and r["samples"] == 4

    # Seeded: another run, one item per call, mux alone first (2 samples each), then extended by sc.
    run(tmp_path / "b", ["mux"], batch_size=1)
    first = lines(tmp_path / "b" / "items" / "triviaqa-generate" / "samples__s.jsonl")
    assert [r["outputs"] for r in first.values()] == [r["outputs"][:2] for r in drawn["s"].values()]
    run(tmp_path / "b", ["mux", "sc"], batch_size=1)
    for m in ("s", "q"):
        again = lines(tmp_path / "b" / "items" / "triviaqa-generate" / f"samples__{m}.jsonl")
        assert {i: (r["outputs"], r["extracted"]) for i, r in again.items()} == \
            {i: (r["outputs"], r["extracted"]) for i, r in drawn[m].items()}

    # Resume: drop one item's samples of s; only those 4 samples are drawn again, alike.
    path = items / "samples__s.jsonl"
    kept = path.read_text().splitlines()
    path.write_text("\n".join(kept[:1] + kept[2:]) + "\n", encoding="utf-8")
    calls.clear()
    again = run(tmp_path / "a", ["single", "mux", "sc"])
    assert [(name, n) for name, n, _ in calls] == [("s", 4)]
    assert {i: r["outputs"] for i, r in lines(path).items()} == {i: r["outputs"] for i, r in drawn["s"].items()}
    assert lines(items / "mux.jsonl").keys() == mux.keys()
    assert {m: again["tasks"]["triviaqa"][m]["acc"] for m in again["overview"]} == \
        {m: c["acc"] for m, c in cell.items()}
    # Another temperature: the samples are moved aside and drawn again.
    settings = EvalSettings(tasks=["triviaqa"], methods=["mux"], limit=3, data=str(data_dir), out=str(tmp_path / "a"),
                            batch_size=4, num_fewshot=0, max_new_tokens={"triviaqa": 3}, progress=False, samples=2,
                            sample_temperature=1.5)
    calls.clear()
    run_eval(cfg, settings, members=members, union=union, log=lambda m: None)
    assert (items / "samples__s.jsonl.stale1").is_file() and len(calls) == 4  # 2 items per call (2 samples each)


def test_each_sequence_samples_with_its_own_seed_whatever_its_batch(tiny_pair):
    """``Ensemble.generate`` with one ``Sampling`` per prompt: the same prompt three times gives each
    seed's own sample, the one it gives alone or in another batch."""
    from tokenfuse.engine import Ensemble, Sampling

    members, _ = tiny_pair
    ens = Ensemble.single(members[0])
    seeds = [Sampling(temperature=0.7, seed=s) for s in (11, 12, 13)]
    batch = [g.text for g in ens.generate(["Q: 2+2?\nA:"] * 3, max_new_tokens=6, sampling=seeds)]
    alone = [ens.generate("Q: 2+2?\nA:", max_new_tokens=6, sampling=s).text for s in seeds]
    mixed = ens.generate(["Capital of France?", "Q: 2+2?\nA:"], max_new_tokens=6, sampling=seeds[1:])[1].text
    assert batch == alone and mixed == alone[2] and len(set(batch)) == 3
    with pytest.raises(ValueError, match="2 sampling options for 3 prompts"):
        ens.generate(["a", "b", "c"], sampling=seeds[:2])


def test_auto_takes_mux_and_sc_as_candidates(tiny_pair, data_dir, tmp_path):
    """``auto`` runs the answer rows on the dev items too (their samples apart, under ``-dev``) and
    chooses among them with every other row; an answer row is no config to write."""
    from tokenfuse.config import parse_config
    from tokenfuse.eval.auto import chosen_config

    members, union = tiny_pair
    out = tmp_path / "out"
    settings = EvalSettings(tasks=["triviaqa"], methods=["single", "mux", "sc", "auto"], limit=2, data=str(data_dir),
                            out=str(out), batch_size=4, num_fewshot=0, max_new_tokens={"triviaqa": 2},
                            progress=False, samples=1, dev_limit=2)
    res = run_eval(config_from_models("s,q"), settings, members=members, union=union, log=lambda m: None)
    assert {"mux", "sc:s", "sc:q"} <= set(res["auto"]["triviaqa"]["dev_acc"])  # beside its gated candidates
    dev = lines(out / "items" / "triviaqa-generate-dev" / "samples__q.jsonl")
    assert len(dev) == 2 and all(len(r["outputs"]) == 2 for r in dev.values())  # k × M = 1 × 2
    cfg = parse_config({"members": [{"name": "s"}, {"name": "q"}]})
    assert chosen_config(cfg, MethodSpec("mux", "answers", ("s", "q"))) is None


def test_answer_table_shows_a_row_on_the_tasks_it_sampled_only():
    """``auto`` that chose ``mux`` on one task and a member on another: its samples and cost are those
    of the task it sampled on, said in the row's name; a row sampled everywhere is as before."""
    from tokenfuse.eval.report import answer_lines

    mux = {"a": {"n": 10, "samples_per_item": 6, "seconds": 60.0}, "b": {"n": 10, "samples_per_item": 6, "seconds": 20.0}}
    results = {"overview": {"mux": {"samples_per_item": 6, "items_per_min": 15.0},
                            "auto": {"samples_per_item": 6, "items_per_min": 40.0}},
               "tasks": {"a": {"mux": mux["a"], "auto": {"n": 10, "seconds": 10.0}},
                         "b": {"mux": mux["b"], "auto": dict(mux["b"])}}}
    rows = [line for line in answer_lines(results) if line.startswith("| ") and "row" not in line]
    assert rows == ["| mux | 6 | 15.0 |", "| auto (b only) | 6 | 30.0 |"]
    assert "samples on some tasks only" in answer_lines(results)[1]
    del results["overview"]["auto"]
    assert "samples on some tasks only" not in answer_lines(results)[1]
