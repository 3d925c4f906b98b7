"""The YAML config: round trips, and every error names the field (and the file) it is about."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tokenfuse.bundled import DEFAULT_ENSEMBLE
from tokenfuse.config import (
    EnsembleConfig,
    config_from_models,
    load_config,
    parse_config,
)
from tokenfuse.errors import ConfigError
from tokenfuse.flags import config_from_args

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))

FULL = {
    "members": [
        {"name": "smol", "source": "smollm2-135m-instruct", "weight": 2.0},
        {"name": "gemma", "source": "/models/gemma", "dtype": "bfloat16", "device": "cpu"},
        {"name": "qwen2.5-coder-0.5b-instruct"},
    ],
    "method": "gac",
    "gate": "smol",
    "threshold": 0.4,
    "window": 16,
    "decoding": {"max_new_tokens": 32, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3,
                 "stop": ["\n\n", "User:"]},
    "cache_dir": "/tmp/tf-cache",
}


def _error(data) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, origin="cfg.yaml")
    return str(info.value)


def _members(*names, **extra):
    return [{"name": n, **extra} for n in names]


# ---------------------------------------------------------------------------------------- valid
def test_full_config_round_trips_through_yaml(tmp_path):
    cfg = parse_config(FULL)
    assert cfg.members[0].weight == 2.0 and cfg.members[2].resolved_source == "qwen2.5-coder-0.5b-instruct"
    assert cfg.members[1].resolved_source == "/models/gemma"
    text = cfg.to_yaml()
    again = parse_config(yaml.safe_load(text))
    assert again == cfg
    path = tmp_path / "ens.yaml"
    path.write_text(text, encoding="utf-8")
    assert load_config(path) == cfg
    assert load_config(str(path)).to_yaml() == text


def test_minimal_config_gets_the_defaults():
    cfg = parse_config({"members": [{"name": "gemma3-270m"}]})
    assert cfg.method == "gac" and cfg.gate is None and cfg.threshold is None and cfg.window == 8
    assert cfg.members[0].resolved_source == "gemma3-270m" and cfg.members[0].weight == 1.0
    d = cfg.decoding
    assert (d.max_new_tokens, d.temperature, d.top_p, d.top_k, d.seed, d.stop) == (64, 0.0, 1.0, 0, None, [])
    assert parse_config(yaml.safe_load(cfg.to_yaml())) == cfg
    assert "null" not in cfg.to_yaml()


def test_zero_weight_is_allowed_if_another_member_counts():
    cfg = parse_config({"members": [{"name": "a", "weight": 0}, {"name": "b"}]})
    assert [m.weight for m in cfg.members] == [0.0, 1.0]


@pytest.mark.skipif(not EXAMPLES, reason="no examples/*.yaml")
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_parse(path):
    cfg = load_config(path)
    assert isinstance(cfg, EnsembleConfig) and cfg.members
    assert parse_config(yaml.safe_load(cfg.to_yaml())) == cfg


def test_config_from_models():
    cfg = config_from_models("smollm2-135m-instruct, /models/gemma/ ,org/qwen-0.5b,x/y/tiny.gguf",
                             gate="smollm2-135m-instruct", threshold=0.5, method=None)
    assert [m.name for m in cfg.members] == ["smollm2-135m-instruct", "gemma", "qwen-0.5b", "tiny"]
    assert [m.source for m in cfg.members] == ["smollm2-135m-instruct", "/models/gemma/", "org/qwen-0.5b",
                                              "x/y/tiny.gguf"]
    assert (cfg.gate, cfg.threshold, cfg.method) == ("smollm2-135m-instruct", 0.5, "gac")
    assert config_from_models(["a", "b"]) == config_from_models("a,b")


# ---------------------------------------------------------------------------------------- errors
def test_negative_weight_names_the_field():
    msg = _error({"members": [{"name": "a", "weight": -1}, {"name": "b"}]})
    assert "members.0.weight" in msg and msg.startswith("cfg.yaml: ")
    msg = _error({"members": [{"name": "a"}, {"name": "b", "weight": "heavy"}]})
    assert "members.1.weight" in msg


def test_unknown_method_lists_the_available_ones():
    msg = _error({"members": _members("a"), "method": "gca"})
    assert "method" in msg and "'gca'" in msg and "gac" in msg


def test_a_gate_needs_a_threshold_and_a_threshold_alone_gates_on_the_primary():
    msg = _error({"members": _members("a", "b"), "gate": "b"})
    assert "threshold: gate 'b' needs a threshold" in msg
    cfg = parse_config({"members": _members("a", "b"), "threshold": 0.5, "primary": "b"})
    assert (cfg.gate, cfg.threshold, cfg.primary_name) == (None, 0.5, "b")  # the one way to threshold (selective)


def test_gate_must_be_a_member():
    msg = _error({"members": _members("a", "b"), "gate": "c", "threshold": 0.5})
    assert "gate" in msg and "'c'" in msg and "a, b" in msg


def test_duplicate_names():
    msg = _error({"members": _members("a", "b", "a")})
    assert "members" in msg and "unique" in msg and "repeated: a" in msg


@pytest.mark.parametrize("data,where", [
    ({"members": _members("a"), "temprature": 0.5}, "temprature"),
    ({"members": [{"name": "a", "wieght": 2}]}, "members.0.wieght"),
    ({"members": _members("a"), "decoding": {"max_tokens": 5}}, "decoding.max_tokens"),
])
def test_unknown_key_is_named(data, where):
    msg = _error(data)
    assert where in msg and "not permitted" in msg


@pytest.mark.parametrize("data,where", [
    ({"members": []}, "members"),
    ({"members": _members("a"), "threshold": 1.5, "gate": "a"}, "threshold"),
    ({"members": _members("a"), "decoding": {"top_p": 0}}, "decoding.top_p"),
    ({"members": _members("a"), "decoding": {"max_new_tokens": 0}}, "decoding.max_new_tokens"),
    ({"members": _members("a"), "decoding": {"temperature": -1}}, "decoding.temperature"),
    ({"members": [{"name": "a", "dtype": "int8"}]}, "members.0.dtype"),
    ({"members": [{"name": ""}]}, "members.0.name"),
    ({"members": _members("a"), "window": 0}, "window"),
])
def test_out_of_range_values_are_named(data, where):
    assert f"cfg.yaml: {where}: " in _error(data)


def test_all_zero_weights():
    msg = _error({"members": [{"name": "a", "weight": 0}, {"name": "b", "weight": 0}]})
    assert "members" in msg and "weight" in msg


def test_not_a_mapping():
    assert "members" in _error(["a", "b"])
    assert _error(None).startswith("cfg.yaml: ")


def test_missing_file_names_it(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml") as info:
        load_config(path)
    assert "not found" in str(info.value)


def test_invalid_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("members:\n  - name: a\n   weight: [1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="broken.yaml") as info:
        load_config(path)
    assert "YAML" in str(info.value)


def test_invalid_values_in_a_file_name_the_file_and_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("members:\n  - name: a\n    weight: -2\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: members.0.weight: ")
    empty = tmp_path / "empty.yaml"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(ConfigError, match="empty.yaml"):
        load_config(empty)


# ---------------------------------------------------------------------------------------- overrides
def test_method_params_are_validated_by_the_combiner():
    msg = _error({"members": _members("a"), "method": "unite", "params": {"k": 0}})
    assert msg.startswith("cfg.yaml: params.k: ")
    msg = _error({"members": _members("a"), "method": "unite", "params": {"kk": 5}})
    assert msg.startswith("cfg.yaml: params.kk: ") and "'kk'" in msg
    assert parse_config({"members": _members("a"), "method": "unite", "params": {"k": 5}}).params == {"k": 5}


def test_with_overrides_method_change_clears_params():
    cfg = parse_config({"members": _members("a", "b"), "method": "unite", "params": {"k": 5}})
    assert cfg.with_overrides(method="gac").params == {}
    assert cfg.with_overrides(method="unite").params == {"k": 5}  # the same method keeps its params
    assert cfg.with_overrides(params={"k": 7}).params == {"k": 7}  # merged into the config's
    assert cfg.with_overrides(method="gac").with_overrides(method="unite", params={"k": 3}).params == {"k": 3}
    assert cfg.with_overrides() == cfg
    assert cfg.params == {"k": 5}  # the original is unchanged


def test_with_overrides_fields_and_none():
    cfg = parse_config({"members": _members("a", "b"), "gate": "a", "threshold": 0.4})
    new = cfg.with_overrides(gate=None, threshold=None, primary="b", agreement_skip=False)
    assert (new.gate, new.threshold, new.primary_name, new.agreement_skip) == (None, None, "b", False)
    assert cfg.with_overrides(threshold=0.7).threshold == 0.7 and cfg.gate == "a"
    dec = cfg.with_overrides(decoding={"temperature": 0.5, "stop": ["\n"]}).decoding
    assert (dec.temperature, dec.stop, dec.max_new_tokens) == (0.5, ["\n"], 64)


def test_with_overrides_weights_by_list_or_name():
    cfg = parse_config({"members": _members("a", "b", "c")})
    assert [m.weight for m in cfg.with_overrides(weights=[1, 2, 0.5]).members] == [1.0, 2.0, 0.5]
    assert [m.weight for m in cfg.with_overrides(weights={"c": 0}).members] == [1.0, 1.0, 0.0]
    with pytest.raises(ConfigError) as info:
        cfg.with_overrides(weights=[1, 2], origin="tokenfuse")
    assert str(info.value) == "tokenfuse: weights: 2 weights for 3 members (a, b, c)"
    with pytest.raises(ConfigError) as info:
        cfg.with_overrides(weights={"d": 1}, origin="tokenfuse")
    assert str(info.value) == "tokenfuse: weights: 'd' not a member (members: a, b, c)"
    with pytest.raises(ConfigError) as info:
        cfg.with_overrides(weights=[1, 1, 1], names={"weights": "--weights"}, origin="x.yaml", gate="d")
    assert str(info.value).startswith("x.yaml: gate: 'd' is not a member")
    with pytest.raises(ConfigError) as info:
        cfg.with_overrides(weights=[-1, 1, 1], origin="tokenfuse")
    assert str(info.value).startswith("tokenfuse: members.0.weight: ")
    with pytest.raises(ConfigError) as info:
        cfg.with_overrides(weights=[0, 0, 0], origin="tokenfuse")
    assert str(info.value).startswith("tokenfuse: members.weight: at least one member needs a positive weight")


def test_with_overrides_refuses_unknown_options():
    cfg = parse_config({"members": _members("a")})
    with pytest.raises(ConfigError) as info:
        cfg.with_overrides(colour="red", origin="tokenfuse")
    assert str(info.value) == ("tokenfuse: unknown option(s) colour; "
                               "allowed: method, params, primary, agreement_skip, gate, threshold, window, scoring, parallel, "
                               "speculative, weights")
    with pytest.raises(ConfigError, match="^model_args: method: unknown combiner 'gca'"):
        cfg.with_overrides(method="gca", origin="model_args")
    with pytest.raises(ConfigError, match="^overrides: params: expected a mapping"):
        cfg.with_overrides(params=["k"])


def _args(**kw):
    import argparse

    return argparse.Namespace(**kw)


def test_from_args_flags(tmp_path):
    path = tmp_path / "ens.yaml"
    path.write_text(yaml.safe_dump({"members": _members("a", "b"), "method": "unite", "params": {"k": 5}}))
    cfg = config_from_args(_args(config=str(path), models=None, param=["k=7"], weights="1,0.5",
                                 gate="a", threshold=0.3, max_new_tokens=9, stop=["\n"], top_k=None))
    assert (cfg.method, cfg.params, cfg.gate, cfg.threshold) == ("unite", {"k": 7}, "a", 0.3)
    assert [m.weight for m in cfg.members] == [1.0, 0.5]
    assert (cfg.decoding.max_new_tokens, cfg.decoding.stop, cfg.decoding.top_k) == (9, ["\n"], 0)
    assert config_from_args(_args(config=str(path), method="gac")).params == {}
    default = config_from_args(_args())  # a command without ensemble flags: the bundled ensemble
    assert [m.name for m in default.members] == list(DEFAULT_ENSEMBLE)


@pytest.mark.parametrize("kw,message", [
    ({"param": ["k"]}, "--param: expected KEY=VALUE, got 'k'"),
    ({"weights": "1,x"}, "--weights: expected comma-separated numbers, got '1,x'"),
    ({"weights": "1,2,3"}, "--weights: 3 weights for 2 members (a, b)"),
    ({"method": "unite", "param": ["k=0"]}, "command line: params.k: "),
])
def test_from_args_errors_name_the_flag(kw, message):
    with pytest.raises(ConfigError) as info:
        config_from_args(_args(models="a,b", **kw))
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("extra, message", [
    ({"params": {"select": 2}}, "cfg.yaml: params.select: gac: Input should be less than or equal to 1"),
    ({"params": {"select": 0.5}, "gate": "a", "threshold": 0.3},
     "cfg.yaml: params.select: selective ensembling gates on the primary member (a); drop `gate` and `threshold`"),
    ({"params": {"confidence": "max"}}, "cfg.yaml: params.confidence: gac: Input should be 'none', 'top' or 'entropy'"),
    ({"params": {"prompt_weights": -1}}, "cfg.yaml: params.prompt_weights: gac: Input should be greater than 0"),
    ({"params": {"prompt_weights": 0.1}, "placement": "ray"},
     "cfg.yaml: placement: params.prompt_weights (PackLLM) needs every member's log-probabilities"),
    ({"method": "unite", "params": {"prompt_weights": 0.1},
      "members": [{"name": "a"}, {"name": "b", "backend": "openai", "base_url": "http://127.0.0.1:1/v1"}]},
     "cfg.yaml: members.1.backend: params.prompt_weights (PackLLM) needs member 'b''s log-probabilities"),
    ({"method": "deepen", "params": {"select": 0.5}}, "cfg.yaml: params.select: deepen: unexpected keyword argument"),
])
def test_adaptive_params_are_checked_against_the_config(extra, message):
    assert _error({"members": _members("a", "b"), **extra}).startswith(message)


def test_adaptive_params_round_trip():
    cfg = parse_config({"members": _members("a", "b"), "method": "unite",
                        "params": {"k": 4, "select": 0.6, "select_boundary": False, "confidence": "entropy",
                                   "sharpness": 2.0, "prompt_weights": 0.2}})
    assert parse_config(yaml.safe_load(cfg.to_yaml())) == cfg
    assert (cfg.threshold, cfg.params["boundary"]) == (0.6, False)  # the old spelling, read as the one
    off = cfg.with_overrides(threshold=None, params={"select": None})
    assert (off.threshold, off.params.get("select")) == (None, None)



def test_multi_seq_is_auto_by_default_and_its_errors_name_the_field():
    assert parse_config({"members": _members("a")}).members[0].multi_seq == "auto"
    cfg = parse_config({"members": _members("a", multi_seq=0) + _members("b", multi_seq=64)
                        + _members("c", multi_seq="auto")})
    assert [m.multi_seq for m in cfg.members] == [0, 64, "auto"] and parse_config(yaml.safe_load(cfg.to_yaml())) == cfg
    for bad in (-1, 65, "many", "8", True, 2.5, None):
        msg = _error({"members": _members("a", multi_seq=bad)})
        assert msg.startswith("cfg.yaml: members.0.multi_seq: expected `auto` or a number") and msg.count(";") == 0, msg


def test_exact_calls_round_trips():
    cfg = parse_config({"members": _members("smollm2-135m-instruct", exact_calls=True, multi_seq=4)})
    assert cfg.members[0].exact_calls and not parse_config({"members": _members("a")}).members[0].exact_calls
    assert parse_config(yaml.safe_load(cfg.to_yaml())) == cfg
