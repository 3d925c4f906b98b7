"""Every surface that gives ensemble options is built from the options' declarations
(``tokenfuse.engine.options.Option`` on the fields of ``EnsembleOptions``): a new option field
appears on the command line, in the server's request schema and among the lm-eval plugin's model
arguments with nothing else written; an option a surface cannot honour is refused there, by name."""

from __future__ import annotations

import argparse
from typing import Annotated

import pytest
from pydantic import ValidationError

from tokenfuse.config import ENSEMBLE_OPTIONS, override_fields
from tokenfuse.engine import EnsembleOptions
from tokenfuse.engine.options import Option, option_fields
from tokenfuse.errors import ConfigError
from tokenfuse.flags import add_option_flags, config_from_args, refuse_option_flags


class WithDummy(EnsembleOptions):
    """The options with one more, as a new option is added: one field and its declaration."""

    dummy: Annotated[int | None, Option("a dummy option for the test", metavar="N")] = None
    hidden: Annotated[str | None, Option("an option no surface but the command line honours",
                                         refused={"server": "not here", "lm_eval": "nor here", "eval": "nor here"})] = None


def _parser(command: str, options=WithDummy) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"tokenfuse {command}", exit_on_error=False)
    add_option_flags(p, command, options=options)
    refuse_option_flags(p, command, options=options)
    return p


def test_every_option_is_declared_and_every_surface_lists_it():
    assert tuple(option_fields()) == tuple(EnsembleOptions.model_fields)
    assert ENSEMBLE_OPTIONS == (*EnsembleOptions.model_fields, "weights")
    flags = {a.dest for a in _parser("generate", EnsembleOptions)._actions}
    assert {"method", "param", "primary", "agreement_skip", "gate", "threshold", "window", "scoring", "parallel",
            "speculative", "draft", "draft_k", "weights"} <= flags


def test_a_new_option_field_appears_on_every_surface():
    """A dummy option field: its flag, its request field and its model argument, from the same builders."""
    ns = _parser("generate").parse_args(["--dummy", "3", "--hidden", "x", "--window", "4"])
    assert (ns.dummy, ns.hidden, ns.window) == (3, "x", 4)
    assert "--dummy N" in _parser("serve").format_help() and "--dummy" in _parser("bench").format_help()
    assert "--dummy" in _parser("eval").format_help()
    assert set(override_fields(WithDummy, "server")) == {*ENSEMBLE_OPTIONS, "dummy"} - {"parallel"}

    pytest.importorskip("fastapi")
    from tokenfuse.server.schemas import request_options_model

    schema = request_options_model(WithDummy)
    assert schema(dummy=3).as_options() == {"dummy": 3}
    with pytest.raises(ValidationError, match="dummy"):
        schema(dummy="many")
    with pytest.raises(ValidationError, match="hidden: not taken by the server's per-request options: not here"):
        schema(hidden="x")

    pytest.importorskip("lm_eval")
    from tokenfuse.lm_eval_plugin import model_arguments, model_options

    assert "dummy" in model_arguments(WithDummy) and "hidden" not in model_arguments(WithDummy)
    assert model_options({"dummy": 3, "params": "{k: 5}"}, WithDummy) == {"dummy": 3, "params": {"k": 5}}
    with pytest.raises(ConfigError, match="model_args: hidden: not taken by the lm-eval plugin's model arguments"):
        model_options({"hidden": "x"}, WithDummy)


def test_an_option_a_command_cannot_honour_is_refused_there(capsys):
    """``eval`` takes no ``--hidden`` (declared refused there): its flag says so, by name."""
    with pytest.raises(SystemExit):
        _parser("eval").parse_args(["--hidden", "x"])
    assert "--hidden: hidden: not taken by `tokenfuse eval`: nor here" in capsys.readouterr().err
    assert "hidden: not taken by `tokenfuse eval`: nor here" in " ".join(_parser("eval").format_help().split())


def test_the_command_line_refuses_unhonoured_options():
    from tokenfuse.cli import UsageError, build_parser

    with pytest.raises(UsageError, match="--draft: speculative: not taken by `tokenfuse bench`"):
        build_parser().parse_args(["bench", "--draft", "a"])
    args = build_parser().parse_args(["bench", "--speculative", "2"])  # still --speculative-k, abbreviated
    assert args.speculative_k == (2,)
    args = build_parser().parse_args(["eval", "--method", "gac"])  # still --methods, abbreviated
    assert args.methods == "gac"


def test_new_flags_reach_the_config():
    ns = _parser("generate", EnsembleOptions).parse_args(
        ["--window", "4", "--no-parallel", "--scoring", "stepwise", "--draft-k", "2", "--weights", "2,1"])
    ns.models = "a,b"
    cfg = config_from_args(ns)
    assert (cfg.window, cfg.parallel, cfg.scoring, cfg.speculative.k) == (4, False, "stepwise", 2)
    assert [m.weight for m in cfg.members] == [2.0, 1.0]
    ns = _parser("generate", EnsembleOptions).parse_args(["--speculative"])
    ns.models = "a,b"
    assert config_from_args(ns).speculative.model_dump() == {"draft": None, "k": 4, "adapt": True}
