"""The ``tokenfuse`` command, run in-process. Model loading is replaced by tiny members."""

from __future__ import annotations

import io
import json

import pytest

import tokenfuse.load
from tokenfuse import __version__
from tokenfuse.bundled import DEFAULT_ENSEMBLE
from tokenfuse.cli import main
from tokenfuse.engine import Ensemble

FAMILY_SEED = {"smollm2": 0, "qwen": 1, "gemma3": 2}


@pytest.fixture(scope="module")
def tiny_members(make_tiny):
    return {family: make_tiny(family, seed=seed, name=family) for family, seed in FAMILY_SEED.items()}


@pytest.fixture
def fake_load(monkeypatch, tiny_members, align_cache):
    """``tokenfuse.load.load_ensemble`` returning tiny members named after the config's members.

    A member's name must be a tokenizer family (``smollm2``, ``qwen``, ``gemma3``); everything
    else (weights, method, gate, threshold, window) comes from the config the CLI resolved.
    """
    seen = []

    def load_ensemble(cfg, *, progress=True):
        seen.append(cfg)
        members = [tiny_members[m.name] for m in cfg.members]
        return Ensemble(members, cfg.options, weights=[c.weight for c in cfg.members], align_cache=align_cache)

    monkeypatch.setattr(tokenfuse.load, "load_ensemble", load_ensemble)
    return seen


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tokenfuse: error: ")
    assert "Traceback" not in err
    return lines[0]


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------- basics
def test_models_lists_the_bundled_models(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENFUSE_CACHE", str(tmp_path))
    code, out, err = run(capsys, "models")
    assert code == 0 and err == ""
    assert out.splitlines()[0] == f"cache: {tmp_path}"
    for name in DEFAULT_ENSEMBLE:
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name


def test_version_and_no_command(capsys):
    assert run(capsys, "--version") == (0, f"{__version__}\n", "")
    code, out, _ = run(capsys)
    assert code == 2 and "generate" in out


# ---------------------------------------------------------------------------------------- user errors
def test_missing_config_file(capsys, tmp_path):
    path = tmp_path / "missing.yaml"
    code, out, err = run(capsys, "generate", "hi", "--config", str(path))
    assert (code, out) == (2, "")
    assert one_error_line(err) == f"tokenfuse: error: {path}: config file not found"


def test_invalid_config_values(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("members:\n  - name: a\n    weight: -1\n  - name: b\n", encoding="utf-8")
    code, out, err = run(capsys, "generate", "hi", "--config", str(path))
    assert (code, out) == (2, "")
    line = one_error_line(err)
    assert f"{path}: members.0.weight: " in line


def test_invalid_yaml(capsys, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("members: [a\n", encoding="utf-8")
    code, _, err = run(capsys, "generate", "hi", "--config", str(path))
    assert code == 2
    # the YAML parser's message spans lines; the first names the file
    assert err.startswith(f"tokenfuse: error: {path}: not valid YAML") and "Traceback" not in err


@pytest.mark.parametrize("argv,needle", [
    (["--models", "smollm2,qwen", "--weights", "1"], "--weights: 1 weights for 2 members"),
    (["--models", "smollm2,qwen", "--weights", "1,2,3"], "--weights: 3 weights for 2 members"),
    (["--models", "smollm2,qwen", "--weights", "1,heavy"], "--weights"),
    (["--models", "smollm2,qwen", "--weights=-1,1"], "members.0.weight"),
    (["--models", "smollm2,qwen", "--gate", "qwen"], "threshold: gate 'qwen' needs a threshold"),
    (["--models", "smollm2,qwen", "--gate", "gemma3"], "gate: 'gemma3' is not a member"),
    (["--models", "smollm2,qwen", "--method", "gca"], "available: byte, contrast, deepen, gac, unite"),
    (["--models", "smollm2,qwen", "--top-p", "0"], "decoding.top_p"),
])
def test_flag_errors_are_one_line(capsys, fake_load, argv, needle):
    code, out, err = run(capsys, "generate", "hi", *argv)
    assert (code, out) == (2, "")
    assert needle in one_error_line(err)
    assert fake_load == []  # rejected before any model is loaded


@pytest.mark.parametrize("argv,needle", [
    (["--thresholds", "x"], "--thresholds: expected comma-separated numbers in [0, 1]"),
    (["--thresholds", "0.3,1.5"], "--thresholds"),
    (["--methods", "gac,foo"], "--methods: unknown method foo; choose from byte, contrast, deepen, gac, unite"),
    (["--backends", "gpu"], "--backends: unknown backend gpu"),
    (["--repeats", "0"], "--repeats: expected a whole number >= 1"),
    (["--max-new-tokens", "many"], "--max-new-tokens"),
    (["--speculative-k", "0"], "--speculative-k: expected comma-separated whole numbers >= 1"),
    (["--streams", "0"], "--streams: expected comma-separated whole numbers >= 1 (e.g. 1,8,32); got '0'"),
    (["--streams", "a"], "--streams: expected comma-separated whole numbers >= 1"),
    (["--streams", ""], "--streams: expected comma-separated whole numbers >= 1 (e.g. 1,8,32); got ''"),
    (["--streams", "1,8,0"], "--streams: expected comma-separated whole numbers >= 1"),
    (["--streams", "1.5"], "--streams: expected comma-separated whole numbers >= 1"),
    (["--streams"], "argument --streams: expected one argument"),
])
def test_bench_flag_errors_are_one_line(capsys, fake_load, argv, needle):
    code, out, err = run(capsys, "bench", *argv)
    assert (code, out) == (2, "")
    assert needle in one_error_line(err)
    assert fake_load == []


@pytest.mark.parametrize("typo,hint", [("gemma3-27m", "gemma3-270m"),
                                       ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct"),
                                       ("smollm2-135m", "smollm2-135m-instruct")])
def test_unknown_bundled_name_suggests_one(capsys, monkeypatch, tmp_path, typo, hint):
    monkeypatch.setenv("TOKENFUSE_CACHE", str(tmp_path))
    code, out, err = run(capsys, "generate", "hi", "--models", typo, "--quiet")
    assert (code, out) == (2, "")
    line = one_error_line(err)
    assert "members.0.source" in line and repr(typo) in line and f"did you mean {hint!r}?" in line


# ---------------------------------------------------------------------------------------- generating
MODELS = ["--models", "smollm2,qwen,gemma3"]


def test_generate_json(capsys, fake_load):
    code, out, err = run(capsys, "generate", "The capital of France is", *MODELS, "--max-new-tokens", "12",
                         "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert {"text", "steps", "ensembled_steps", "timings_s", "finish_reason", "members"} <= set(data)
    assert data["steps"] == 12 and data["ensembled_steps"] == 12 and data["finish_reason"] == "length"
    assert {"forward", "align", "combine", "choose", "resync", "total"} <= set(data["timings_s"])
    assert [m["name"] for m in data["members"]] == ["smollm2", "qwen", "gemma3"]
    # the same text as the library gives for the same config
    ens = tokenfuse.load.load_ensemble(fake_load[0])
    assert data["text"] == ens.generate("The capital of France is", max_new_tokens=12).text


def test_generate_speculative_flags(capsys, fake_load):
    code, out, err = run(capsys, "generate", "The capital of France is", *MODELS, "--max-new-tokens", "12",
                         "--draft", "qwen", "--draft-k", "3", "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["speculative"]["draft"] == "qwen" and 0 <= data["speculative"]["accepted"] <= data["speculative"]["drafted"]
    assert fake_load[0].speculative.model_dump() == {"draft": "qwen", "k": 3, "adapt": True}
    plain = json.loads(run(capsys, "generate", "The capital of France is", *MODELS, "--max-new-tokens", "12", "--json")[1])
    assert data["text"] == plain["text"] and "speculative" not in plain
    code, out, err = run(capsys, "generate", "hi", *MODELS, "--draft", "llama")
    assert (code, out) == (2, "")
    assert "speculative.draft: 'llama' is not a member (members: smollm2, qwen, gemma3)" in one_error_line(err)


def test_generate_passes_the_flags_through(capsys, fake_load):
    args = ["generate", "def fib(n):", *MODELS, "--max-new-tokens", "20", "--gate", "smollm2", "--threshold",
            "0.06", "--weights", "1,2,0.5", "--json"]
    code, out, _ = run(capsys, *args)
    assert code == 0
    data = json.loads(out)
    cfg = fake_load[0]
    assert (cfg.gate, cfg.threshold, [m.weight for m in cfg.members]) == ("smollm2", 0.06, [1.0, 2.0, 0.5])
    assert [m["weight"] for m in data["members"]] == [1.0, 2.0, 0.5]
    assert (data["gate"], data["threshold"]) == ("smollm2", 0.06)
    assert 0 < data["ensembled_steps"] < data["steps"] == 20
    assert data["ensembled_share"] == round(data["ensembled_steps"] / 20, 4)


@pytest.mark.parametrize("extra", [[], ["--stop", "an"], ["--temperature", "0.9", "--seed", "4"], ["--chat"]])
def test_stream_prints_the_same_text(capsys, fake_load, monkeypatch, extra):
    base = ["generate", "Once upon a time", "--models", "smollm2,gemma3", "--max-new-tokens", "16", *extra]
    code, plain, _ = run(capsys, *base)
    assert code == 0
    streams = []
    real_stream = Ensemble.stream

    def stream(self, prompt, **kw):
        streams.append(prompt)
        yield from real_stream(self, prompt, **kw)

    monkeypatch.setattr(Ensemble, "stream", stream)
    code, streamed, _ = run(capsys, *base, "--stream")
    assert code == 0 and streams == ["Once upon a time"]
    assert streamed == plain
    assert plain.endswith("\n") and len(plain) > 1


def test_stop_flag_trims(capsys, fake_load):
    base = ["generate", "Once upon a time", "--models", "smollm2", "--max-new-tokens", "16", "--json"]
    full = json.loads(run(capsys, *base)[1])["text"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    data = json.loads(run(capsys, *base, "--stop", "\x00", "--stop", stop)[1])
    assert data["finish_reason"] == "stop" and data["text"] == full[:full.index(stop)]


def test_prompt_from_stdin(capsys, fake_load, monkeypatch):
    base = ["--models", "qwen", "--max-new-tokens", "8"]
    _, direct, _ = run(capsys, "generate", "def fib(n):", *base)
    monkeypatch.setattr("sys.stdin", io.StringIO("def fib(n):"))
    code, piped, _ = run(capsys, "generate", "-", *base)
    assert code == 0 and piped == direct
