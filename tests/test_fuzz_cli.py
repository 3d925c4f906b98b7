"""Bad input to the command line, fuzzed: random YAML configs (random values and types for every
field at every level of the config schema, random keys, random file contents) and random flag
values for ``tokenfuse generate``, run in-process through ``tokenfuse.cli.main``. No member is
loaded: the loader is replaced by one that hands back the resolved config. Every input either
gets that far (the config is valid and every number in it finite) or exits 2 with one line on
stderr naming the field or flag; never a traceback. Last, random sampling and ensemble flags run
through generation on tiny random-weight members."""

from __future__ import annotations

import io
import math
import re

import pytest
import yaml
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

import tokenfuse.load
from tokenfuse.cli import main
from tokenfuse.config import DecodingConfig, EnsembleConfig, MemberConfig
from tokenfuse.engine import EnsembleOptions

FUZZ = settings(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

LEVELS = {"top": (*EnsembleOptions.model_fields, *EnsembleConfig.model_fields), "member": tuple(MemberConfig.model_fields),
          "decoding": tuple(DecodingConfig.model_fields)}
FIELDS = {key for keys in LEVELS.values() for key in keys}
NAMES = ("a", "b")  # the members of the base config


class Loaded(Exception):
    """Raised by the stand-in loader: the command line got as far as loading members."""

    def __init__(self, cfg: EnsembleConfig) -> None:
        self.cfg = cfg


@pytest.fixture
def loads(monkeypatch):
    """``load_ensemble`` replaced: no member is ever loaded, the resolved config is handed back."""
    def load_ensemble(cfg, **_):
        raise Loaded(cfg)

    monkeypatch.setattr(tokenfuse.load, "load_ensemble", load_ensemble)
    monkeypatch.setattr("sys.stdin", io.StringIO("a prompt from stdin"))


def run(capsys, argv: list[str]) -> tuple[int | EnsembleConfig, str, str]:
    """``main(argv)``: its exit status, or the config it went on to load, with stdout and stderr."""
    try:
        result: int | EnsembleConfig = main(argv)
    except Loaded as done:
        result = done.cfg
    out, err = capsys.readouterr()
    return result, out, err


def finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(finite(v) for v in value)
    return True


def one_line(err: str) -> str:
    """The one stderr line of a refused command line (no traceback, no usage block), without its prefix."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("tokenfuse: error: "), err
    return lines[0].removeprefix("tokenfuse: error: ")


def loaded_or_refused(capsys, argv: list[str]) -> str | None:
    """Run ``argv``: ``None`` when it got to loading (with a finite config), else its one error line."""
    result, out, err = run(capsys, argv)
    if currently_in_test_context():  # the share of each outcome, with --hypothesis-show-statistics
        event("loaded" if isinstance(result, EnsembleConfig) else f"exit {result}")
    if isinstance(result, EnsembleConfig):
        assert err == "" and finite(result.model_dump()), result
        return None
    assert (result, out) == (2, ""), err
    return one_line(err)


# ---------------------------------------------------------------------------------------- configs
printable = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), min_size=1, max_size=8)
EDGES = [math.inf, -math.inf, math.nan, 0, -1, 1e-300, 1e300, 2**63, 2**64, -2**63 - 1, 0.5, 1, 2, 1.5, -0.0]
scalars = (st.none() | st.booleans() | st.integers() | st.floats() | printable | st.sampled_from(EDGES)
           | st.sampled_from(["", "a", "b", "gac", "unite", "deepen", "auto", "openai", "llamacpp", "transformers",
                              "float16", "ray", "local", "skip", "error", "PACK", "http://x/v1", "-1", "1e9"]))
values = (scalars | st.sampled_from([{}, {"k": 3}, {"k": 0}, {"name": "a"}, [{"name": "c"}], ["\n", "User:"], [""]])
          | st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(printable, c, max_size=3),
                         max_leaves=5))


def mutated(level: str, key: str, value, index: int = 0) -> dict:
    """The base config with ``key`` of ``level`` (the top, member ``index``, or ``decoding``) set to ``value``."""
    cfg: dict = {"members": [{"name": n} for n in NAMES]}
    if level == "top":
        cfg[key] = value
    elif level == "decoding":
        cfg["decoding"] = {key: value}
    else:
        cfg["members"][index][key] = value
    return cfg


def check_config(capsys, path, cfg: dict, key: str) -> None:
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True), encoding="utf-8")
    line = loaded_or_refused(capsys, ["generate", "hi", "--config", str(path)])
    if line is not None:  # "<file>: <field path>: ...", the path starting at a field of the schema or the key
        rest = line.removeprefix(f"{path}: ")
        assert rest != line and any(rest.startswith((f"{k}:", f"{k}.")) for k in (*FIELDS, key)), (line, key)


@pytest.mark.parametrize("level, key", [(level, key) for level, keys in LEVELS.items() for key in keys])
@settings(FUZZ, max_examples=12)
@given(value=values, index=st.integers(0, len(NAMES) - 1))
def test_every_config_field_fuzzed(capsys, tmp_path_factory, loads, level, key, value, index):
    """Each field of each level of the schema set to random values and types."""
    check_config(capsys, tmp_path_factory.mktemp("cfg") / "random.yaml", mutated(level, key, value, index), key)


@settings(FUZZ, max_examples=40)
@given(level=st.sampled_from(sorted(LEVELS)), key=printable, value=values)
def test_unknown_config_keys_fuzzed(capsys, tmp_path_factory, loads, level, key, value):
    check_config(capsys, tmp_path_factory.mktemp("cfg") / "random.yaml", mutated(level, key, value), key)


@settings(FUZZ, max_examples=80)
@given(text=st.text(max_size=40) | st.binary(max_size=40).map(lambda b: b.decode("latin-1"))
       | st.sampled_from(["members: [a", "members:\n - name: a\n  weight: 1", "- 1\n- 2", "null", "members: 3",
                          "{members: [{name: a}], ? [x]: y}", "members: [{name: a, weight: !!binary aGk=}]",
                          "a: &x [*x]", "members: [{name: 2024-01-01}]", "\ufeffmembers: [{name: a}]",
                          "members: [{name: a}]\nmembers: [{name: b}]", "members: !!set {a}"]),
       raw=st.booleans())
def test_random_file_contents(capsys, tmp_path_factory, loads, text, raw):
    """Any file content: broken YAML, non-mappings, YAML tags, bytes that are not UTF-8."""
    path = tmp_path_factory.mktemp("cfg") / "random.yaml"
    if raw:
        path.write_bytes(text.encode("latin-1", errors="replace"))
    else:
        path.write_text(text, encoding="utf-8")
    line = loaded_or_refused(capsys, ["generate", "hi", "--config", str(path)])
    assert line is None or line.startswith(f"{path}: ")


def test_config_errors_are_one_line_naming_each_field(capsys, tmp_path, loads):
    path = tmp_path / "bad.yaml"
    path.write_text("members:\n  - name: a\n    weight: .nan\n    colour: red\n"
                    "decoding:\n  seed: 99999999999999999999\n", encoding="utf-8")
    assert loaded_or_refused(capsys, ["generate", "hi", "--config", str(path)]) == (
        f"{path}: members.0.weight: Input should be a finite number; "
        f"{path}: members.0.colour: Extra inputs are not permitted; "
        f"{path}: decoding.seed: Input should be less than 9223372036854775808")
    path.write_bytes(b"members:\n  - name: \xff\n")
    assert loaded_or_refused(capsys, ["generate", "hi", "--config", str(path)]) == (
        f"{path}: not a UTF-8 text file (byte 19); write the config as UTF-8 YAML")
    path.write_text("members: [a\n", encoding="utf-8")
    assert loaded_or_refused(capsys, ["generate", "hi", "--config", str(path)]) == (
        f"{path}: not valid YAML: expected ',' or ']', but got '<stream end>' at line 2, column 1")


# ---------------------------------------------------------------------------------------- flags
edge_words = st.sampled_from(["nan", "inf", "-inf", "1e999", "-1", "0", "0.5", "1", "2", "1e-300", "1.5", "-0", "",
                              " ", "x", "0x10", "1_0", str(2**63), str(2**64), str(-2**63 - 1)])
numberish = st.one_of(edge_words, edge_words, st.integers().map(str), st.floats().map(repr), printable)
yaml_words = st.sampled_from(["[", "{", "{a: 1}", "[1, 2]", "'", "*x", "&a", "!!binary x", "!!python/name:os.system",
                              "null", "true", "a: b: c", "- 1", "? x"])
names = st.sampled_from(["a", "b", "c", "", "a,b", "A", "-a"]) | printable
VALUED = {
    "--method": st.sampled_from(["gac", "unite", "deepen", "gca", ""]) | printable,
    "--param": st.tuples(st.sampled_from(["k", "", " ", "x"]) | printable, st.sampled_from(["=", "", ":"]),
                         st.one_of(yaml_words, yaml_words, numberish)).map("".join),
    "--primary": names, "--gate": names, "--threshold": numberish,
    "--weights": st.lists(numberish, max_size=3).map(",".join),
    "--max-new-tokens": numberish, "--temperature": numberish, "--top-p": numberish, "--top-k": numberish,
    "--seed": numberish, "--stop": printable | st.just(""), "--trace-k": numberish,
    "--models": st.sampled_from(["a,b", "a", ",", "a,a", "", "x.gguf,y.gguf"]) | printable,
    "--config": st.sampled_from(["", ".", "/", "missing.yaml", "/dev/null"]) | printable,
}
SWITCHES = ["--agreement-skip", "--no-agreement-skip", "--chat", "--stream", "--json", "--quiet", "--trace"]
# well-formed flags the fuzzed one is mixed with
VALID = [["--method", "unite"], ["--param", "k=3"], ["--temperature", "0.7"], ["--top-p", "0.9"], ["--top-k", "5"],
         ["--seed", "3"], ["--max-new-tokens", "4"], ["--stop", "x"], ["--gate", "a", "--threshold", "0.5"],
         ["--weights", "2,1"], ["--primary", "b"], *([s] for s in SWITCHES)]


def check_flags(capsys, argv: list[str], flag: str, value: str = "") -> None:
    line = loaded_or_refused(capsys, ["generate", *argv])
    if line is None:
        return
    named = (flag in line or any(a in line for a in argv if a.startswith("--"))
             or any(line.startswith(f"{a}: ") for a in (*argv, value) if a))  # e.g. the file given to --config
    field = re.match(r"(?:command line|--models|.*?): ([\w.]+)[:.]", line)
    assert named or (field and field.group(1).split(".")[0] in FIELDS) or line.startswith(
        ("unrecognized arguments:", "the following arguments are required:", "argument ")), (line, argv)


@pytest.mark.parametrize("flag", sorted(VALUED))
@settings(FUZZ, max_examples=40)
@given(data=st.data(), others=st.lists(st.sampled_from(VALID), max_size=2), equals=st.booleans())
def test_every_generate_flag_fuzzed(capsys, loads, flag, data, others, equals):
    """One flag with a random value among up to two well-formed ones."""
    value = data.draw(VALUED[flag])
    argv = ["hi", "--models", "a,b"] if flag not in ("--models", "--config") else ["hi"]
    argv += [a for o in others for a in o] + ([f"{flag}={value}"] if equals else [flag, value])
    check_flags(capsys, argv, flag, value)


@settings(FUZZ, max_examples=40)
@given(args=st.lists(st.sampled_from([*SWITCHES, *VALUED, "--nope", "-x", "--max-new", "--", "-"]) | printable,
                     max_size=5))
def test_random_argument_lists(capsys, loads, args):
    """Any words after ``generate`` (flags without values, unknown flags, several prompts)."""
    check_flags(capsys, ["--models", "a,b", *args], "")


@pytest.mark.parametrize("argv, line", [
    (["--top-p", "x"], "argument --top-p: invalid float value: 'x' (see `tokenfuse generate --help`)"),
    (["--max-new-tokens", "1.5"],
     "argument --max-new-tokens: invalid int value: '1.5' (see `tokenfuse generate --help`)"),
    (["--temperature", "inf"], "command line: decoding.temperature: Input should be a finite number"),
    (["--weights", "nan,1"], "command line: members.0.weight: Input should be a finite number"),
    (["--seed", str(2**64)], "command line: decoding.seed: Input should be less than 9223372036854775808"),
    (["--param", "k=["], "--param k: the value is not valid YAML (expected the node content, but found "
                         "'<stream end>' at line 1, column 2): '['"),
    (["--nope"], "unrecognized arguments: --nope (see `tokenfuse --help`)"),
])
def test_flag_errors_name_the_flag(capsys, loads, argv, line):
    assert loaded_or_refused(capsys, ["generate", "hi", "--models", "a,b", *argv]) == line


# ---------------------------------------------------------------------------------------- generating
@pytest.fixture(scope="module")
def tiny(make_tiny, one_thread):
    return {"a": make_tiny("smollm2", seed=0, name="a"), "b": make_tiny("gemma3", seed=2, name="b")}


@pytest.fixture
def generates(monkeypatch, tiny, align_cache):
    """``load_ensemble`` building the config's ensemble on tiny members ``a`` and ``b``."""
    from tokenfuse.engine import Ensemble

    def load_ensemble(cfg, **_):
        members = [tiny[m.name] for m in cfg.members]
        return Ensemble(members, method=cfg.method, params=cfg.params, gate=cfg.gate, threshold=cfg.threshold,
                        window=cfg.window, weights=[c.weight for c in cfg.members], align_cache=align_cache)

    monkeypatch.setattr(tokenfuse.load, "load_ensemble", load_ensemble)


def floats_text(lo: float, hi: float, *edges: str):
    return st.floats(lo, hi).map(repr) | st.sampled_from(edges)


# values mostly in range, at their edges (5e-324 is 0 for float32), and some refused
GENERATING = {
    "--temperature": floats_text(0, 3, "5e-324", "1e-45", "1e-300", "0", "2", "100", "1e300", "-1"),
    "--top-p": floats_text(1e-9, 1, "5e-324", "1e-45", "1", "0.9999999", "0"),
    "--top-k": st.integers(-1, 10**6).map(str) | st.sampled_from([str(2**63), "0", "1"]),
    "--seed": st.integers(-2**63, 2**63 - 1).map(str) | st.sampled_from([str(2**63), "0"]),
    "--stop": st.sampled_from(["", " ", "h", "\n", "é"]) | printable,
    "--method": st.sampled_from(["gac", "unite", "deepen"]),
    "--param": st.sampled_from(["k=1", "k=2", "k=50", "k=0", "top_k=3", "n=2"]),
    "--weights": st.lists(floats_text(0, 5, "0", "1e-300", "1e300"), min_size=2, max_size=2).map(",".join),
    "--threshold": floats_text(0, 1, "0", "1"),
    "--primary": st.sampled_from(["a", "b"]),
    "--gate": st.sampled_from(["a", "b"]),
}


@settings(FUZZ, max_examples=40)
@given(fuzzed=st.lists(st.sampled_from(sorted(GENERATING)), min_size=1, max_size=3, unique=True).flatmap(
           lambda flags: st.tuples(*(GENERATING[f].map(lambda v, f=f: f"{f}={v}") for f in flags))),
       others=st.lists(st.sampled_from(VALID), max_size=2))
def test_random_flags_generate_or_refuse(capsys, generates, fuzzed, others):
    """Random sampling and ensemble flags through generation on tiny members (2 pieces): the text,
    or one line; never a traceback (a temperature or top_p too small for float32 was one)."""
    argv = ["generate", "hi", "--models", "a,b", *(a for o in others for a in o), *fuzzed, "--max-new-tokens", "2"]
    result, out, err = run(capsys, argv)
    event(f"exit {result}")
    if result == 0:
        assert err == "" and out.endswith("\n"), err
    else:
        assert (result, out) == (2, ""), err
        one_line(err)
