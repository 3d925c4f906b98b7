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
    with pytest.raises(TaskDataError, match=r"arc/challenge_dev\.jsonl"):
        _arc_without_dev(tmp_path).dev_items()
    tq = task("triviaqa", num_fewshot=1)
    shots = {s["id"] for s in tq.shots(None)}
    assert shots and not shots & {it["id"] for it in tq.dev_items()}
    pool = [json.loads(x)["id"] for x in (DATA / "triviaqa" / "dev.jsonl").read_text().splitlines()]
    assert {it["id"] for it in tq.dev_items()} | shots == set(pool)


def _arc_without_dev(tmp_path):
    (tmp_path / "arc").mkdir()
    (tmp_path / "arc" / "challenge_test.jsonl").write_text((DATA / "arc" / "challenge_test.jsonl").read_text())
    return load_task("arc_challenge", tmp_path)


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
