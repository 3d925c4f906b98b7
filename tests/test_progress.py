"""Progress on a terminal (tqdm bars) and off it (one line per finished step); transformers' log lines
through Python logging."""

from __future__ import annotations

import io
import json
import logging

import pytest

from tokenfuse.progress import StepLines, on_terminal, progress_bar


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class Clock:
    """tqdm's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr("tqdm.std.time", c)  # tqdm reads its clock from here when a bar is made
    monkeypatch.delenv("COLUMNS", raising=False)  # the bar's width when the stream has no size
    monkeypatch.delenv("LINES", raising=False)
    return c


def loading(stream, clock, **kw) -> None:
    with progress_bar(total=3, desc="loading members", unit="model", file=stream, **kw) as bar:
        for _ in range(3):
            clock.now += 2.0
            bar.update(1)


def test_off_a_terminal_one_line_when_the_step_ends(clock):
    stream = io.StringIO()
    loading(stream, clock)
    assert stream.getvalue() == "loading members: 3/3 models in 6.0 s, 30.0 models/min\n"


def test_on_a_terminal_a_bar(clock):
    stream = Terminal()
    loading(stream, clock)
    bar = "loading members: {}|{}| {}/3 [{}, {}]"
    frames = [bar.format("  0%", " " * 10, 0, "00:00<?", "?model/s"),
              bar.format(" 33%", "###3      ", 1, "00:02<00:04", " 2.00s/model"),
              bar.format(" 67%", "######6   ", 2, "00:04<00:02", " 2.00s/model"),
              bar.format("100%", "#" * 10, 3, "00:06<00:00", " 2.00s/model"),
              bar.format("100%", "#" * 10, 3, "00:06<00:00", " 2.00s/model")]  # redrawn when it closes
    assert stream.getvalue() == "".join("\r" + f for f in frames) + "\n"


@pytest.mark.parametrize("stream", [io.StringIO(), Terminal()])
def test_disabled_shows_nothing_in_either_mode(clock, stream):
    loading(stream, clock, enabled=False)
    assert stream.getvalue() == ""


def test_the_line_carries_the_postfix_and_counts_only_this_runs_items(clock):
    stream = io.StringIO()
    with progress_bar(total=40, desc="eval arc_easy gac", file=stream, initial=10) as bar:
        clock.now += 45.0
        bar.update(30)
        bar.set_postfix_str("acc=0.550")
    assert stream.getvalue() == "eval arc_easy gac: 40/40 items in 45.0 s, 40.0 items/min, acc=0.550\n"


def test_an_iterated_display_one_without_a_total_and_one_step(clock):
    stream = io.StringIO()
    for _ in progress_bar(["a", "b"], desc="DeePEn relative matrices", unit="member", file=stream):
        clock.now += 3.0
    with progress_bar(desc="rows", unit="row", file=stream) as bar:
        bar.update(5)
    with progress_bar(total=1, desc="building the gemma3-270m tokenizer", unit="step", file=stream) as bar:
        clock.now += 0.94
        bar.update(1)
    assert stream.getvalue() == ("DeePEn relative matrices: 2/2 members in 6.0 s, 20.0 members/min\n"
                                 "rows: 5 rows in 0.0 s, 0.0 rows/min\n"
                                 "building the gemma3-270m tokenizer: 1/1 steps in 0.9 s\n")  # one step: no rate


def test_the_mode_follows_the_stream():
    with progress_bar(total=1, file=io.StringIO()) as plain, progress_bar(total=1, file=Terminal()) as bar:
        assert isinstance(plain, StepLines) and not isinstance(bar, StepLines)
    assert on_terminal(Terminal()) and not on_terminal(io.StringIO())
    closed = io.StringIO()
    closed.close()
    assert not on_terminal(closed) and not on_terminal(object())


def test_the_default_stream_is_standard_error_at_call_time(clock, capsys):
    loading(None, clock)  # capsys's stderr is no terminal
    assert capsys.readouterr() == ("", "loading members: 3/3 models in 6.0 s, 30.0 models/min\n")


# ---------------------------------------------------------------------------------------- transformers' logs
@pytest.fixture
def routed(monkeypatch):
    """``route_transformers_logs`` (standard error taken for no terminal); transformers restored afterwards."""
    from transformers.utils import logging as hf_logging

    from tokenfuse.logs import route_transformers_logs

    monkeypatch.setattr("tokenfuse.logs.on_terminal", lambda: False)  # standard error is no terminal
    before = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled())
    route_transformers_logs()
    route_transformers_logs()  # twice: nothing doubles
    yield hf_logging
    hf_logging.enable_default_handler()
    hf_logging.disable_propagation()
    logging.getLogger("transformers").handlers[:] = [h for h in logging.getLogger("transformers").handlers
                                                     if not isinstance(h, logging.NullHandler)]
    hf_logging.set_verbosity(before[0])
    if before[1]:
        hf_logging.enable_progress_bar()


def test_transformers_lines_are_silent_by_default(routed, capfd):
    routed.set_verbosity_warning()
    routed.get_logger("transformers.models.gemma3").warning("a notice")
    assert capfd.readouterr() == ("", "")
    assert not routed.is_progress_bar_enabled()  # standard error is no terminal: no transformers bars


def test_transformers_lines_show_with_a_handler_as_verbose_sets_one(routed):
    routed.set_verbosity_debug()  # what TRANSFORMERS_VERBOSITY=debug (--verbose) gives
    shown = io.StringIO()
    handler = logging.StreamHandler(shown)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        routed.get_logger("transformers.models.gemma3").debug("a detail")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    assert shown.getvalue() == "transformers.models.gemma3: a detail\n"


# ---------------------------------------------------------------------------------------- a command's steps
def arc_data(tmp_path):
    """Two ARC-Easy test items and one dev item under ``tmp_path/data``; the test file's path."""
    data = tmp_path / "data" / "arc" / "easy_test.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text("".join(json.dumps({"id": f"arc-{i}", "question": q, "choices": ch, "answer": a}) + "\n"
                            for i, (q, ch, a) in enumerate([("Which is a liquid?", ["rock", "water"], "B"),
                                                            ("Which is hot?", ["ice", "fire"], "B")])))
    (data.parent / "easy_dev.jsonl").write_text(json.dumps({"id": "arc-dev-0", "question": "Which is cold?",
                                                            "choices": ["ice", "fire"], "answer": "A"}) + "\n")
    return data


def test_eval_writes_one_line_per_task_and_row(make_tiny, one_thread, tmp_path, clock, capsys):
    from tokenfuse.config import config_from_models
    from tokenfuse.engine import Ensemble
    from tokenfuse.eval.records import item_file, read_records
    from tokenfuse.eval.runner import EvalSettings, run_eval

    data = arc_data(tmp_path)
    qa = tmp_path / "data" / "triviaqa"
    qa.mkdir()
    for split in ("test", "dev"):
        (qa / f"{split}.jsonl").write_text(json.dumps({"id": "tq-0", "question": "2+2?", "answer": "4",
                                                        "aliases": ["4"]}) + "\n")
    members = [make_tiny("smollm2", seed=1, name="s"), make_tiny("qwen", seed=2, name="q")]
    out = tmp_path / "out"
    settings = EvalSettings(tasks=["arc_easy", "triviaqa"], methods=["single", "gac"], limit=2,
                            data=str(tmp_path / "data"), out=str(out), batch_size=2, num_fewshot=0,
                            max_new_tokens={"triviaqa": 2})
    run_eval(config_from_models("s,q", primary="s"), settings, members=members, union=Ensemble(members).union,
             log=lambda msg: None)
    for method in ("single:s", "single:q", "gac"):
        assert len(read_records(item_file(out, "arc_easy", "likelihood", method))) == 2
    # the likelihood form runs its rows together: one line for the task, with the share of members'
    # forwards one row took from another (gac takes s's as primary; one-word options cut alike for q)
    lines = ["eval arc_easy-likelihood (3 rows): 2/2 items in 0.0 s, 0.0 items/min, shared=75%\n"]
    # the generate form too (batch by batch, each row after the other): one line; one item, no rate
    lines.append("eval triviaqa-generate (3 rows): 1/1 items in 0.0 s\n")
    for method in ("single:s", "single:q", "gac"):
        assert len(read_records(item_file(out, "triviaqa", "generate", method))) == 1
    assert capsys.readouterr() == ("", "".join(lines))


def test_eval_off_a_terminal_writes_a_line_a_minute_while_a_task_runs(make_tiny, one_thread, tmp_path, clock,
                                                                      capsys, monkeypatch):
    """A long task is not silent until it ends: after a batch, once a minute has passed since the
    last line, one line says how far it is (the progress display's own line still ends it)."""
    from tokenfuse.config import config_from_models
    from tokenfuse.engine import Ensemble
    from tokenfuse.eval import batches, runner

    arc_data(tmp_path)
    score = batches.likelihood_records

    def slow(*a, **k):  # each row's batch takes 40 s: a batch of the 3 rows 120 s
        clock.now += 40.0
        return score(*a, **k)

    monkeypatch.setattr(batches, "likelihood_records", slow)
    members = [make_tiny("smollm2", seed=1, name="s"), make_tiny("qwen", seed=2, name="q")]
    settings = runner.EvalSettings(tasks=["arc_easy"], methods=["single", "gac"], limit=2, data=str(tmp_path / "data"),
                                   out=str(tmp_path / "out"), batch_size=2, num_fewshot=0)
    runner.run_eval(config_from_models("s,q", primary="s"), settings, members=members,
                    union=Ensemble(members).union, log=lambda msg: None)
    assert capsys.readouterr() == ("", "eval arc_easy-likelihood (3 rows): 1/2 items, 120.0 s\n"
                                       "eval arc_easy-likelihood (3 rows): 2/2 items in 240.0 s, 0.5 items/min, "
                                       "shared=75%\n")
