"""The command line's ensemble flags, built from the options' declarations, and the config they make.

Every command that takes ensemble options (``generate``, ``serve``/``playground``, ``bench``,
``eval``) gets one flag per override it honours (``config.override_fields``: the options' fields
and the members' weights), made from the field's type and its ``Option`` (as vLLM's ``EngineArgs``
makes its flags from its fields): a ``bool`` is ``--x/--no-x``, a ``Literal`` a choice, a mapping
(``params``) a repeatable ``--param KEY=VALUE``, a list (``weights``) comma-separated values, a
model (``speculative``) a switch with a flag per sub-field (``--draft``, ``--draft-k``). An option
a command cannot honour (``Option.refused``) is refused there by its flag, naming the option and
why (unless the flag would take the place of an abbreviation of the command's own flag, e.g.
``eval --method`` for ``--methods``; its help lists it). ``config_from_args`` reads the flags back.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Sequence
from typing import Any

import yaml
from pydantic.fields import FieldInfo

from tokenfuse.config import (
    EnsembleConfig,
    config_from_source,
    override_fields,
    yaml_problem,
)
from tokenfuse.engine.options import (
    EnsembleOptions,
    Option,
    bare,
    kind,
    refusal,
    union_args,
)
from tokenfuse.errors import ConfigError


def flag_of(name: str, opt: Option) -> str:
    """An option's flag: its declared one, else ``--`` and its name with dashes."""
    return opt.flag or "--" + name.replace("_", "-")


def dest_of(name: str, opt: Option) -> str:
    """Where argparse keeps a flag's value (named after the flag, as argparse does: ``--param`` -> ``param``)."""
    return flag_of(name, opt).removeprefix("--").replace("-", "_")


def add_option_flags(parser: argparse.ArgumentParser, command: str, *, own: Sequence[str] = (),
                     options: type[EnsembleOptions] | None = None) -> None:
    """One flag (or a few: ``speculative``) per override ``command`` honours (``options``: default
    ``EnsembleOptions``, a subclass adds its fields); ``own``: those the command gives flags of its
    own meaning (``eval``'s ``--gate``/``--threshold``)."""
    for name, (info, opt) in override_fields(options, command).items():
        if name not in own:
            _add(parser, name, info, opt)


def refuse_option_flags(parser: argparse.ArgumentParser, command: str, *,
                        options: type[EnsembleOptions] | None = None) -> None:
    """After the command's own flags: each option ``command`` cannot honour refused by its flags (a
    one-line error naming it and why), where a flag would not take an abbreviation's place; the
    refused ones listed in the help."""
    refused = {n: o for n, (_, o) in override_fields(options).items() if command in o.refused}
    for name, opt in refused.items():
        flags = [flag_of(name, opt), *(flag_of(sub, o) for sub, o in opt.sub.items())]
        taken = parser._option_string_actions  # argparse's own table of the flags registered so far
        for flag in flags:
            if not any(other.startswith(flag) for other in taken):
                parser.add_argument(flag, nargs="?", action=_Refused, help=argparse.SUPPRESS,
                                    message=f"{flag}: " + refusal(name, opt, command))
    if refused:
        listed = "; ".join(refusal(n, o, command) for n, o in refused.items())
        parser.epilog = " ".join(filter(None, [parser.epilog, f"Ensemble options not taken here: {listed}."]))


class _Refused(argparse.Action):
    def __init__(self, *args: Any, message: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.message = message

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(self.message)


def _add(parser: argparse.ArgumentParser, name: str, info: FieldInfo, opt: Option) -> None:
    flag, how, t = flag_of(name, opt), kind(info.annotation), bare(info.annotation)
    if how == "switch":
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=opt.help)
    elif how == "choice":
        parser.add_argument(flag, choices=typing.get_args(t), help=opt.help)
    elif how == "mapping":
        parser.add_argument(flag, action="append", metavar="KEY=VALUE",
                            help=f"{opt.help} (repeatable)")
    elif how == "list":
        parser.add_argument(flag, metavar=opt.metavar, help=opt.help)
    elif how == "model":
        parser.add_argument(flag, action="store_const", const=True, default=None, help=opt.help)
        for sub, sub_opt in opt.sub.items():
            _add(parser, sub, t.model_fields[sub], sub_opt)
    else:
        parser.add_argument(flag, type=t if t in (int, float) else str, metavar=opt.metavar, help=opt.help)


def config_from_args(args: argparse.Namespace, *, options: type[EnsembleOptions] | None = None) -> EnsembleConfig:
    """The config of a command's flags: ``--config`` or ``--models`` (default: the bundled
    ensemble), then every override flag (``add_option_flags``) and the decoding flags, each where the
    command has it (a flag the command lacks or leaves unset changes nothing)."""
    def flag(name: str) -> Any:
        return getattr(args, name, None)

    cfg = config_from_source(config=flag("config"), models=flag("models"))
    fields = override_fields(options)
    given = {}
    for name, (info, opt) in fields.items():
        value = _value(args, name, info, opt, getattr(cfg.options, name, None))
        if value is not None:
            given[name] = value
    decoding = {k: flag(k) for k in ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
                if flag(k) is not None}
    if flag("stop"):
        decoding["stop"] = list(flag("stop"))
    return cfg.with_overrides(**given, decoding=decoding, origin=flag("config") or "command line",
                              names={n: flag_of(n, o) for n, (_, o) in fields.items()})


def _value(args: argparse.Namespace, name: str, info: FieldInfo, opt: Option, current: Any) -> Any:
    """An override's value from its flags (``None``: not given)."""
    value, how = getattr(args, dest_of(name, opt), None), kind(info.annotation)
    if how == "mapping":
        return dict(key_value(item, flag_of(name, opt)) for item in value) if value else None
    if how == "list":
        return items(value, flag_of(name, opt), bare(info.annotation)) if value else None
    if how == "model":
        subs = {sub: getattr(args, dest_of(sub, o), None) for sub, o in opt.sub.items()}
        if not value and all(v is None for v in subs.values()):
            return None
        return (current.model_dump() if current is not None else {}) | {k: v for k, v in subs.items() if v is not None}
    return value


def items(text: str, flag: str, annotation: Any = list[float]) -> list[Any]:
    """``--weights 2,1`` -> ``[2.0, 1.0]``: comma-separated values of the list's item type."""
    lists = [a for a in union_args(annotation) if typing.get_origin(a) is list]
    item = (typing.get_args(lists[0]) or (str,))[0] if lists else str
    try:
        return [item(w) for w in text.split(",")]
    except ValueError:
        what = "numbers" if item in (int, float) else f"{getattr(item, '__name__', item)} values"
        raise ConfigError(f"{flag}: expected comma-separated {what}, got {text!r}") from None


def key_value(item: str, flag: str = "--param") -> tuple[str, Any]:
    """``--param KEY=VALUE`` -> ``(KEY, VALUE as YAML)``."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{flag}: expected KEY=VALUE, got {item!r}")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ConfigError(f"{flag} {key.strip()}: the value is not valid YAML ({yaml_problem(err)}): "
                          f"{value!r}") from None
