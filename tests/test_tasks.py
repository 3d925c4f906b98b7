"""Benchmark tasks: exact prompts on hand-written fixture items (tests/data/bench), and grading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenfuse.errors import TokenfuseError
from tokenfuse.tasks import DATA_ENV, TASKS, TaskDataError, load_task, resolve_data_dir
from tokenfuse.tasks.bbh import split_cot_prompt
from tokenfuse.tasks.scoring import (extract_bbh, extract_letter, extract_yes_no, last_number, match_any_alias,
                                     normalize_answer, same_number)

DATA = Path(__file__).resolve().parent / "data" / "bench"


def task(name: str, **kw):
    return load_task(name, DATA, **kw)


def item(t, item_id: str) -> dict:
    """An item of the fixture, evaluated or dev (the prompts are the same)."""
    found = [it for it in t.items if it["id"] == item_id]
    return found[0] if found else next(it for it in t.dev_items() if it["id"] == item_id)


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


# ---------------------------------------------------------------------------------------- data
def test_data_dir_argument_then_environment_then_error(monkeypatch, tmp_path):
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert resolve_data_dir(DATA) == DATA
    assert resolve_data_dir() == tmp_path
    monkeypatch.delenv(DATA_ENV)
    with pytest.raises(TaskDataError) as info:
        resolve_data_dir()
    assert "--data" in str(info.value) and DATA_ENV in str(info.value)


def test_missing_file_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(TaskDataError) as info:
        load_task("gsm8k", tmp_path)
    msg = str(info.value)
    assert str(tmp_path / "gsm8k" / "test.jsonl") in msg and "--data" in msg and DATA_ENV in msg


def test_missing_directory_and_unknown_task(tmp_path):
    with pytest.raises(TaskDataError, match="--data"):
        load_task("arc_challenge", tmp_path / "nowhere")
    with pytest.raises(TaskDataError, match="did you mean 'arc_easy'"):
        load_task("arc_eazy", DATA)


def test_bad_json_line_names_file_and_line(tmp_path):
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa" / "validation.jsonl").write_text('{"id": "a"}\n{oops\n')
    with pytest.raises(TaskDataError, match=r"validation\.jsonl:2: not valid JSON"):
        load_task("piqa", tmp_path)


def test_every_task_loads_the_fixture():
    for name in TASKS:
        t = task(name, num_fewshot=2 if name == "nq_open" else None)  # 5 shots would take all 4 NQ items
        assert t.items, name
        for it in t.items:
            assert isinstance(t.prompt(it), str)
            messages = t.prompt(it, chat=True)
            assert [m["role"] for m in messages][-1] == "user"
            assert t.max_new_tokens > 0


def test_dev_items_never_reach_the_evaluated_items(tmp_path):
    """Without a dev file about one item in ten (by the id's hash) is a dev item; with one (ARC),
    the dev file's items; TriviaQA's dev file less the shots taken from it."""
    from tokenfuse.tasks.base import DEV_SHARE, is_dev

    rows = [{"id": f"q{i}", "goal": "g", "sol1": "a", "sol2": "b", "label": 0} for i in range(200)]
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa" / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = load_task("piqa", tmp_path)
    dev, test = [it["id"] for it in t.dev_items()], [it["id"] for it in t.items]
    assert sorted(dev + test, key=lambda x: int(x[1:])) == [r["id"] for r in rows] and not set(dev) & set(test)
    assert dev == [r["id"] for r in rows if is_dev(r)] and 200 // DEV_SHARE // 2 < len(dev) < 2 * 200 // DEV_SHARE
    assert t.dev_subset(5) == t.dev_subset(5) and len(t.dev_subset(5)) == 5 and all(it["id"] in dev for it in t.dev_subset(5))
    arc = task("arc_challenge")  # ARC's dev file is its own split
    assert [it["id"] for it in arc.dev_items()] == ["ARC-dev-toy-1", "ARC-dev-toy-2", "ARC-dev-toy-3"]
    assert [it["id"] for it in arc.items] == ["ARC-toy-1", "ARC-toy-2", "ARC-toy-3"]
    tq = task("triviaqa", num_fewshot=1)
    shots = {s["id"] for s in tq.shots(None)}
    assert shots and not shots & {it["id"] for it in tq.dev_items()}
    pool = [json.loads(x)["id"] for x in (DATA / "triviaqa" / "dev.jsonl").read_text().splitlines()]
    assert {it["id"] for it in tq.dev_items()} | shots == set(pool)


# ---------------------------------------------------------------------------------------- dev pools
def _write(root: Path, rel: str, rows: list[dict]) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _mc(prefix: str, n: int, **extra) -> list[dict]:
    return [{"id": f"{prefix}-{i}", "question": f"q{i}", "choices": ["x", "y", "z"], "answer": "B", **extra}
            for i in range(n)]


def _qa(prefix: str, n: int) -> list[dict]:
    return [{"id": f"{prefix}-{i}", "question": f"q{i}", "answer": f"a{i}", "aliases": [f"a{i}"]} for i in range(n)]


def _gsm(prefix: str, n: int) -> list[dict]:
    return [{"id": f"{prefix}-{i}", "question": f"q{i}", "answer": str(i), "solution": f"{i}\n#### {i}"}
            for i in range(n)]


N = 80  # items per fake test file: the hash split keeps a few of them (fixed by the ids)
# every file a task reads, in the normalised schema; the pool files per task
FAKE = {
    "gsm8k/test.jsonl": _gsm("gsm8k-test", N), "gsm8k/train.jsonl": _gsm("gsm8k-train", 30),
    "mmlu/test.jsonl": _mc("mmlu-s-test", N, subject="s") + _mc("mmlu-t-test", N, subject="t"),
    "mmlu/dev.jsonl": _mc("mmlu-s-dev", 5, subject="s") + _mc("mmlu-t-dev", 5, subject="t"),
    "arc/challenge_test.jsonl": _mc("arc-c-test", N), "arc/challenge_dev.jsonl": _mc("arc-c-dev", 12),
    "arc/easy_test.jsonl": _mc("arc-e-test", N), "arc/easy_dev.jsonl": _mc("arc-e-dev", 14),
    "piqa/validation.jsonl": _mc("piqa", N),
    "boolq/dev.jsonl": [{"id": f"boolq-{i}", "question": f"q{i}?", "passage": "p", "answer": "yes"} for i in range(N)],
    "triviaqa/test.jsonl": _qa("tq-test", N), "triviaqa/dev.jsonl": _qa("tq-dev", 20),
    "nq_open/test.jsonl": _qa("nq", N),
    "bbh/test.jsonl": [{"id": f"bbh-toy_logic-{i}", "question": f"q{i}", "answer": "True", "task": "toy_logic"}
                       for i in range(N)],
}
POOL_FILES = {"gsm8k": ["gsm8k/train.jsonl"], "mmlu": ["mmlu/dev.jsonl"], "arc_challenge": ["arc/challenge_dev.jsonl"],
              "arc_easy": ["arc/easy_dev.jsonl"], "triviaqa": ["triviaqa/dev.jsonl"]}


def _fake_data(root: Path, leave_out: tuple[str, ...] = ()) -> Path:
    for rel, rows in FAKE.items():
        if rel not in leave_out:
            _write(root, rel, rows)
    (root / "bbh" / "cot_prompts.jsonl").write_text((DATA / "bbh" / "cot_prompts.jsonl").read_text())
    return root


def _ids(items) -> list[str]:
    return [it["id"] for it in items]


def _test_file(name: str) -> list[dict]:
    files = {"gsm8k": "gsm8k/test.jsonl", "mmlu": "mmlu/test.jsonl", "arc_challenge": "arc/challenge_test.jsonl",
             "arc_easy": "arc/easy_test.jsonl", "piqa": "piqa/validation.jsonl", "boolq": "boolq/dev.jsonl",
             "triviaqa": "triviaqa/test.jsonl", "nq_open": "nq_open/test.jsonl", "bbh": "bbh/test.jsonl"}
    return FAKE[files[name]]


def test_each_tasks_dev_pool_comes_from_its_source(tmp_path):
    """GSM8K: train less the shots; ARC: its dev files; TriviaQA: its dev file less the shots; MMLU:
    its dev file plus the hash split of the test file; the others: the hash split. Dev and test
    items are disjoint, and the test items are the test file less the hash split wherever they were
    before (GSM8K keeps its share out), so committed results stay valid."""
    from tokenfuse.tasks.base import is_dev

    root = _fake_data(tmp_path)
    for name in TASKS:
        t = load_task(name, root)
        test_file = _test_file(name)
        share = [r for r in test_file if is_dev(r)]
        assert share, name  # the fake ids give each test file a hash-split share
        shots = {s["id"] for s in t.shots(t.items[0])}
        pool = [r for f in POOL_FILES.get(name, []) for r in FAKE[f]]
        if name in ("gsm8k", "triviaqa"):  # every item's shots come from the pool and leave it
            assert len(shots) == 5 and shots <= set(_ids(pool))
            expected = [r["id"] for r in pool if r["id"] not in shots]
        elif name == "mmlu":
            expected = _ids(pool) + _ids(share)
        elif name in ("arc_challenge", "arc_easy"):
            expected = _ids(pool)
        else:
            expected = [r["id"] for r in share if r["id"] not in shots]  # NQ-open's shots leave the items first
        assert _ids(t.dev_items()) == expected, name
        held = share if name not in ("arc_challenge", "arc_easy", "triviaqa") else []
        assert _ids(t.items) == [r["id"] for r in test_file if r not in held and r["id"] not in shots], name
        assert not set(_ids(t.items)) & set(_ids(t.dev_items())), name
        assert t.dev_source.startswith(" + ".join(POOL_FILES.get(name, [])) or "the hash split"), name
    assert load_task("gsm8k", root).dev_source == "gsm8k/train.jsonl (less the 5 shots taken from it)"
    assert load_task("mmlu", root).dev_source == "mmlu/dev.jsonl + the hash split of the test file"


def test_a_dev_item_is_never_its_own_exemplar(tmp_path):
    """MMLU's dev-file items are its shots: such an item gets its subject's other dev items (4 of 5);
    every other item, test or dev, keeps the subject's first five."""
    root = _fake_data(tmp_path)
    for name in TASKS:
        for shots_n in (None, 2):
            t = load_task(name, root, num_fewshot=shots_n)
            for it in t.dev_items():
                assert it["id"] not in {s["id"] for s in t.shots(it)}, (name, it["id"])
    mmlu = load_task("mmlu", root)
    dev_file_item = next(it for it in mmlu.dev_items() if it["id"] == "mmlu-s-dev-1")
    assert _ids(mmlu.shots(dev_file_item)) == ["mmlu-s-dev-0", "mmlu-s-dev-2", "mmlu-s-dev-3", "mmlu-s-dev-4"]
    assert mmlu.prompt(dev_file_item).count("Q: q1\n") == 1  # the item itself, last
    assert mmlu.cloze(dev_file_item).context.count("Question: q1\n") == 1  # the cloze form alike
    hash_dev = next(it for it in mmlu.dev_items() if "-test-" in it["id"] and it["subject"] == "s")
    assert _ids(mmlu.shots(hash_dev)) == [f"mmlu-s-dev-{i}" for i in range(5)] == _ids(mmlu.shots(mmlu.items[0]))


def test_dev_subsets_are_seeded(tmp_path):
    root = _fake_data(tmp_path)
    for name in TASKS:
        t, again = load_task(name, root), load_task(name, root)
        assert _ids(t.dev_subset(4, seed=7)) == _ids(again.dev_subset(4, seed=7))  # same seed, same items
        assert set(_ids(t.dev_subset(3, seed=7))) <= set(_ids(t.dev_subset(4, seed=7)))
    gsm = load_task("gsm8k", root)
    assert _ids(gsm.dev_subset(10, seed=1)) != _ids(gsm.dev_subset(10, seed=2))


def test_auto_dev_counts_depend_on_the_form_and_flags_win():
    """``auto`` asks for 500 dev items in the likelihood form and 200 in the generate form, for every
    row and for the members alone; an explicit --dev-limit / --member-dev-limit wins, the members
    never getting fewer than the rest; a smaller pool gives all it has, and the note says why."""
    from tokenfuse.eval.auto import DEV_LIMITS, MEMBER_DEV_LIMITS, dev_counts, dev_note

    assert DEV_LIMITS == MEMBER_DEV_LIMITS == {"likelihood": 500, "generate": 200}
    assert dev_counts("likelihood") == (500, 500) and dev_counts("generate") == (200, 200)
    assert dev_counts("generate", 50) == (50, 200) and dev_counts("generate", 300) == (300, 300)
    assert dev_counts("likelihood", None, 800) == (500, 800) and dev_counts("likelihood", 600, 100) == (600, 600)
    assert dev_note(500, 500, used=500, member_used=500, pool=1707, source="mmlu/dev.jsonl") is None
    assert dev_note(500, 500, used=299, member_used=299, pool=299, source="arc/challenge_dev.jsonl") == (
        "dev items 299 of 500 for every row and candidate, 299 of 500 for the members alone: "
        "the dev pool (arc/challenge_dev.jsonl) has 299")
    assert dev_note(50, 500, used=50, member_used=215, pool=215, source="the hash split of the test file") == (
        "dev items 215 of 500 for the members alone: the dev pool (the hash split of the test file) has 215")


@pytest.mark.parametrize("name", sorted(POOL_FILES))
def test_a_missing_dev_file_falls_back_to_the_hash_split(tmp_path, capsys, name):
    """Older data without a task's dev file: the hash split of its test file, said in one line."""
    from tokenfuse.tasks.base import is_dev

    (rel,) = POOL_FILES[name]
    root = _fake_data(tmp_path, leave_out=(rel,))
    t = load_task(name, root, num_fewshot=0)  # GSM8K's and MMLU's shots need the file
    err = capsys.readouterr().err
    assert f"{name}: {rel} not found under {root}" in err and "hash split" in err and "Traceback" not in err
    share = [r["id"] for r in _test_file(name) if is_dev(r)]
    assert _ids(t.dev_items()) == share and not set(share) & set(_ids(t.items))
    assert t.dev_source == f"the hash split of the test file (no {rel})"
    assert not capsys.readouterr().err  # said once, at load


def test_subset_is_seeded_nested_and_in_file_order():
    t = task("arc_challenge")
    assert [it["id"] for it in t.subset(2)] == ["ARC-toy-2", "ARC-toy-3"]
    assert [it["id"] for it in t.subset(1)] == ["ARC-toy-2"]  # a smaller limit is a subset of a larger one
    assert t.subset(2) == task("arc_challenge").subset(2)  # the same items for everyone
    assert t.subset(None) == t.items and t.subset(10) == t.items
    real = load_task("arc_challenge", DATA).subset(2, seed=99)
    assert len(real) == 2 and real != [] and real == t.subset(2, seed=99)
    ids = [it["id"] for it in t.items]
    for seed in range(5):
        chosen = [it["id"] for it in t.subset(2, seed=seed)]
        assert chosen == sorted(chosen, key=ids.index)


# ---------------------------------------------------------------------------------------- prompts
def test_gsm8k_prompts():
    t = task("gsm8k", num_fewshot=2)
    it = item(t, "gsm8k-test-0")
    assert t.prompt(it) == (
        "Question: Sam has 2 cats and 3 dogs. How many pets?\nAnswer: 2 + 3 = <<2+3=5>>5 pets.\n#### 5\n\n"
        "Question: Lee had 10 sweets and ate 4. How many are left?\nAnswer: 10 - 4 = <<10-4=6>>6 sweets.\n#### 6\n\n"
        "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:")
    assert t.prompt(it, chat=True) == [
        user("Question: Sam has 2 cats and 3 dogs. How many pets?"),
        assistant("2 + 3 = <<2+3=5>>5 pets.\n#### 5"),
        user("Question: Lee had 10 sweets and ate 4. How many are left?"),
        assistant("10 - 4 = <<10-4=6>>6 sweets.\n#### 6"),
        user("Question: Tom has 3 apples and buys 4 more. How many apples does he have?"),
    ]
    assert t.stop() == ["\n\n", "Question:"] and t.stop(chat=True) == ["Question:"] and t.max_new_tokens == 256
    both = t.prompt(it, chat="mixed")  # an ensemble of members with and without a chat template
    assert both.messages == t.prompt(it, chat=True) and both.raw == t.prompt(it)
    assert t.stop(chat="mixed") == ["Question:"]  # the raw form's blank-line stop would cut chat reasoning
    assert len(task("gsm8k").shots(it)) == 3  # default 5 shots, capped by the 3-item fixture pool
    assert task("gsm8k", num_fewshot=0).prompt(it) == (
        "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:")


def test_mmlu_prompts_and_cloze():
    t = task("mmlu")
    it = item(t, "mmlu-toy_physics-test-0")
    assert t.prompt(it) == (
        "The following are multiple choice questions (with answers) about toy physics.\n\n"
        "Q: Light is a\n(A) wave (B) rock (C) sound (D) smell\nA: (A)\n\n"
        "Q: Ice is frozen\n(A) air (B) water (C) fire (D) sand\nA: (B)\n\n"
        "Q: What falls faster in a vacuum?\n(A) A feather (B) A rock (C) Neither (D) Both rise\nA:")
    assert t.prompt(it, chat=True) == [
        user("The following are multiple choice questions (with answers) about toy physics.\n\n"
             "Q: Light is a\n(A) wave (B) rock (C) sound (D) smell"),
        assistant("(A)"),
        user("Q: Ice is frozen\n(A) air (B) water (C) fire (D) sand"),
        assistant("(B)"),
        user("Q: What falls faster in a vacuum?\n(A) A feather (B) A rock (C) Neither (D) Both rise"),
    ]
    c = t.cloze(it)
    assert c.context == ("The following are questions (with answers) about toy physics.\n\n"
                         "Question: Light is a\nAnswer: wave\n\nQuestion: Ice is frozen\nAnswer: water\n\n"
                         "Question: What falls faster in a vacuum?\nAnswer:")
    assert c.continuations == (" A feather", " A rock", " Neither", " Both rise") and c.gold == 2
    assert t.score(it, " (C)").correct and not t.score(it, " (B)").correct


def test_arc_prompts_and_cloze():
    t = task("arc_challenge")
    it = item(t, "ARC-toy-1")
    assert t.prompt(it) == ("Question: Which object is a magnet most likely to attract?\n"
                            "A. a glass cup\nB. an iron nail\nC. a wooden spoon\nD. a rubber ball\nAnswer:")
    assert t.prompt(it, chat=True) == [user(
        "Question: Which object is a magnet most likely to attract?\n"
        "A. a glass cup\nB. an iron nail\nC. a wooden spoon\nD. a rubber ball\n\n"
        "Answer with the letter of the correct option.")]
    assert t.stop() == ["\n"] and t.stop(chat=True) == ["\n\n", "Question:"]
    c = t.cloze(it)
    assert c.context == "Question: Which object is a magnet most likely to attract?\nAnswer:"
    assert c.continuations == (" a glass cup", " an iron nail", " a wooden spoon", " a rubber ball") and c.gold == 1
    five = item(t, "ARC-toy-3")  # five options: letters follow the count
    assert t.prompt(five).endswith("D. salt\nE. wood\nAnswer:") and t.cloze(five).gold == 2
    assert task("arc_easy").items[0]["id"] == "ARC-easy-toy-1"


def test_piqa_prompt_keeps_trailing_spaces():
    t = task("piqa")
    it = item(t, "piqa-valid-0")
    assert t.prompt(it) == ("Question: To keep bread fresh\nA. store it in a sealed bag. \n"
                            "B. leave it in the rain.\nAnswer:")
    assert t.cloze(it).continuations == (" store it in a sealed bag. ", " leave it in the rain.")
    assert t.cloze(it).gold == 0


def test_boolq_prompts_and_cloze():
    t = task("boolq")
    it, no_mark = item(t, "boolq-dev-0"), item(t, "boolq-dev-1")
    assert t.prompt(it) == ("The Sun is the star at the centre of the Solar System.\n"
                            "Question: is the sun a star?\nAnswer:")
    assert t.prompt(no_mark) == "Whales are marine mammals.\nQuestion: is a whale a fish?\nAnswer:"  # "?" added
    assert t.prompt(it, chat=True) == [user(
        "The Sun is the star at the centre of the Solar System.\nQuestion: is the sun a star?\n\nAnswer yes or no.")]
    assert t.cloze(it).continuations == (" no", " yes") and t.cloze(it).gold == 1 and t.cloze(no_mark).gold == 0
    assert t.score(it, " Yes, it is.").correct and t.score(no_mark, " false").correct
    assert not t.score(it, " maybe").correct and t.score(it, " maybe").extracted is None


def test_triviaqa_prompts_skip_unusable_shot_answers():
    t = task("triviaqa", num_fewshot=2)
    it = item(t, "triviaqa-test-0")
    # the emoji answer and the one with a comma (a stop string) are not used as demonstrations
    assert [s["id"] for s in t.shots(it)] == ["triviaqa-dev-0", "triviaqa-dev-2"]
    assert len(task("triviaqa").shots(it)) == 2
    assert t.prompt(it) == ("Question: What is the capital of France?\nAnswer: Paris\n\n"
                            "Question: What colour is the sky on a clear day?\nAnswer: Blue\n\n"
                            "Question: Which planet is known as the Red Planet?\nAnswer:")
    assert t.prompt(it, chat=True) == [
        user("Question: What is the capital of France?"), assistant("Paris"),
        user("Question: What colour is the sky on a clear day?"), assistant("Blue"),
        user("Question: Which planet is known as the Red Planet?"),
    ]
    assert t.prompt(item(t, "triviaqa-test-1")).endswith("Question: Who wrote Hamlet?\nAnswer:")
    assert t.stop() == ["\n", ".", ","] == t.stop(chat=True)


def test_nq_open_prompts_and_shots_leave_the_evaluated_items():
    t = task("nq_open", num_fewshot=2)
    assert [s["id"] for s in t.shots(None)] == ["nq_open-dev-3", "nq_open-dev-2"]
    # the shots leave the items; of the rest, the hash split keeps nq_open-dev-0 for choosing configurations
    assert [it["id"] for it in t.items] == ["nq_open-dev-1"]
    assert [it["id"] for it in t.dev_items()] == ["nq_open-dev-0"]
    it = item(t, "nq_open-dev-0")
    assert t.prompt(it) == ("Answer these questions:\nQ: when did the first moon landing happen?\nA: 1969\n"
                            "Q: what is the largest ocean?\nA: the Pacific Ocean\nQ: who painted the mona lisa?\nA:")
    assert t.prompt(it, chat=True) == [
        user("Answer these questions:\nQ: when did the first moon landing happen?"), assistant("1969"),
        user("Q: what is the largest ocean?"), assistant("the Pacific Ocean"),
        user("Q: who painted the mona lisa?"),
    ]


def test_bbh_prompts_reproduce_the_official_prompt():
    t = task("bbh")
    it = item(t, "bbh-toy_logic-0")
    official = json.loads((DATA / "bbh" / "cot_prompts.jsonl").read_text().splitlines()[0])["prompt"]
    assert t.prompt(it) == official + "\n\nQ: not ( False ) is\nA: Let's think step by step."
    assert t.prompt(it, chat=True) == [
        user("Evaluate a tiny Boolean expression.\n\nQ: not True is"),
        assistant("Let's think step by step.\nnot True = False. So the answer is False."),
        user("Q: True or False is"),
        assistant("Let's think step by step.\nTrue or False = True. So the answer is True."),
        user("Q: not ( False ) is"),
    ]
    assert t.stop() == ["\n\n", "\nQ:"] and t.stop(chat=True) == ["\n\nQ:"]
    assert t.stop(chat="mixed") == ["\n\nQ:", "\nQ:"]
    assert split_cot_prompt(official) == ("Evaluate a tiny Boolean expression.", [
        ("not True is", "\nnot True = False. So the answer is False."),
        ("True or False is", "\nTrue or False = True. So the answer is True."),
    ])


def test_cloze_only_for_multiple_choice():
    for name in ("gsm8k", "triviaqa", "nq_open", "bbh"):
        t = task(name, num_fewshot=2)
        with pytest.raises(TaskDataError, match="not multiple choice"):
            t.cloze(t.items[0])


# ---------------------------------------------------------------------------------------- grading
@pytest.mark.parametrize("text, number", [
    ("so 3 + 4 = 7.\n#### 7", "7"),
    ("The answer is 1,200 pens.", "1200"),
    ("She pays $-3.50 back", "-3.50"),
    ("first 12 then 30.", "30"),
    ("no digits here", None),
    ("", None),
])
def test_last_number(text, number):
    assert last_number(text) == number


def test_same_number_and_gsm8k_score():
    assert same_number("18.00", "18") and same_number("1,200", "1200") and not same_number("17", "18")
    assert not same_number(None, "18") and not same_number("x", "18")
    t = task("gsm8k")
    it = item(t, "gsm8k-test-1")  # gold 1200
    assert t.score(it, "100 * 12 = 1,200 pens.\n#### 1,200").correct
    s = t.score(it, "It is 1200, no wait, 1100")
    assert (s.correct, s.extracted) == (False, "1100")  # the last number counts
    assert t.score(it, "I do not know") == type(s)(False, None)


def test_normalize_answer_squad():
    assert normalize_answer("  The  Beatles! ") == "beatles"
    assert normalize_answer("An Apple, a day") == "apple day"
    assert normalize_answer("Théâtre") == "théâtre"
    assert normalize_answer("J. R. R. Tolkien") == "j r r tolkien"


def test_alias_match_and_empty_prediction_is_never_correct():
    aliases = ["William Shakespeare", "Shakespeare", "The", "..."]  # the last two normalise to ""
    assert match_any_alias("shakespeare.", aliases)
    assert match_any_alias("  the William SHAKESPEARE ", aliases)
    assert not match_any_alias("Marlowe", aliases)
    for empty in ("", "   ", "the", "!?", None):
        assert not match_any_alias(empty, aliases)
    t = task("triviaqa")
    it = item(t, "triviaqa-test-0")
    assert t.score(it, " the red planet").correct and t.score(it, "Mars").correct
    assert not t.score(it, "").correct and t.score(it, " ").extracted == ""


@pytest.mark.parametrize("output, letter", [
    (" B", "B"),
    ("(C) an iron nail", "C"),
    ("D. a rubber ball", "D"),
    ("The answer is (B).", "B"),
    ("The correct answer is C", "C"),
    ("Answer: D", "D"),
    ("A", "A"),
    ("A.", "A"),
    ("A magnet attracts an iron nail.", "B"),  # the article "A" is not a letter; the option text decides
    ("I think it is (D)", "D"),
    ("an iron nail", "B"),
    ("E", None),  # no option E among four
    ("a glass cup or an iron nail", None),  # two option texts: undecided
    ("", None),
])
def test_extract_letter(output, letter):
    choices = ["a glass cup", "an iron nail", "a wooden spoon", "a rubber ball"]
    assert extract_letter(output, choices) == letter


def test_letter_score_on_arc():
    t = task("arc_challenge")
    it = item(t, "ARC-toy-1")
    assert t.score(it, " B") == type(t.score(it, ""))(True, "B")
    assert t.score(it, "The answer is A") == type(t.score(it, ""))(False, "A")


def test_extract_yes_no():
    assert extract_yes_no(" Yes.") == "yes" and extract_yes_no("No, it is not") == "no"
    assert extract_yes_no("True") == "yes" and extract_yes_no(" false") == "no"
    assert extract_yes_no("Not sure; nobody knows") is None  # whole words only


@pytest.mark.parametrize("output, answer", [
    ("\nnot False = True. So the answer is True.", "True"),
    ("So the answer is (B).", "(B)"),
    ("So the answer is } ] >.", "} ] >"),
    ("the answer is (A). Hmm, no. So the answer is (C).\nmore text", "(C)"),
    ("The Answer Is valid", "valid"),
    ("So the answer is 3.5.", "3.5"),
    ("I have no idea", None),
    ("So the answer is .", None),
])
def test_extract_bbh(output, answer):
    assert extract_bbh(output) == answer


def test_bbh_exact_match():
    t = task("bbh")
    it = item(t, "bbh-toy_logic-0")  # gold "True"
    assert t.score(it, "\nnot False = True. So the answer is True.").correct
    assert not t.score(it, "So the answer is true.").correct  # exact match: case counts
    assert not t.score(it, "True").correct  # no "the answer is": nothing extracted


# ---------------------------------------------------------------------------------------- running a task
def _member(chat_template: bool):
    return type("M", (), {"has_chat_template": chat_template})()


def test_prompt_form_rule():
    from tokenfuse.tasks import prompt_form, uses_chat

    chat, raw = _member(True), _member(False)
    assert (uses_chat(chat), uses_chat(raw)) == (True, False)
    assert (uses_chat(raw, "chat"), uses_chat(chat, "raw")) == (True, False)
    assert (prompt_form([chat, chat]), prompt_form([raw]), prompt_form([chat, raw])) == (True, False, "mixed")
    assert prompt_form([chat, raw], "raw") is False
    with pytest.raises(TokenfuseError, match="--prompt-form: expected one of auto, chat, raw"):
        uses_chat(chat, "text")


def test_generate_graded_uses_the_tasks_prompts_stops_and_grading():
    from tokenfuse.engine import Sampling
    from tokenfuse.tasks import generate_graded

    t = task("arc_challenge")
    items = t.items[:2]
    answers = {t.prompt(it, chat=True)[-1]["content"]: f"The answer is {it['answer']}." for it in items}
    wrong = "A" if items[1]["answer"] != "A" else "B"
    answers[t.prompt(items[1], chat=True)[-1]["content"]] = f"The answer is {wrong}."
    calls = []

    class FakeEnsemble:
        def generate(self, prompts, **kw):
            calls.append(kw)
            return [type("G", (), {"text": answers[p[-1]["content"]], "output": b""})() for p in prompts]

    graded = generate_graded(FakeEnsemble(), t, items, chat=True)
    assert calls == [{"max_new_tokens": t.max_new_tokens, "sampling": Sampling(), "stop": t.stop(chat=True),
                      "chat": True}]
    assert [g.item for g in graded] == items
    assert [(g.score.correct, g.score.extracted) for g in graded] == [(True, items[0]["answer"]), (False, wrong)]
    assert graded[0].text == f"The answer is {items[0]['answer']}."
    generate_graded(FakeEnsemble(), t, items[:1], chat=True, max_new_tokens=3)
    assert calls[-1]["max_new_tokens"] == 3
