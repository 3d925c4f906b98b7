"""What an ensemble is, apart from its loaded members: one frozen, validated value.

``EnsembleOptions`` holds the method and its parameters (the combiner's own and the strategies'
adaptive ones, ``tokenfuse.engine.strategies``), the primary member, thresholded mode (``gate``,
``threshold``), agreement skip, the re-sync window, likelihood scoring, member threads and
speculative decoding. Every rule that needs nothing but the options is checked here, once, when
the value is made (pydantic validation); the rules that need the members' names
(``check_members``) are checked by the ``Ensemble``, and by a config (which holds these options as
its ``options`` value beside its members). ``replace`` is the one override rule (a different method
clears the parameters; parameters merge key by key). Members' weights and scores are the ensemble's
(``Ensemble(weights=..., scores=...)``: their config's, or ``Ensemble.variant(weights=...)``), never
written to the members.

Each option is declared once, on its field (``Annotated[type, Option(...)]``: help, flag, where it
cannot be honoured); every surface that gives options is built from these declarations
(``option_fields``): the command line's flags, the server's per-request schema, the lm-eval
plugin's model arguments, ``Ensemble.describe`` and ``EnsembleConfig.with_overrides``' keys.
"""

from __future__ import annotations

import functools
import operator
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from tokenfuse.combiners import combiner_class, validate_params
from tokenfuse.engine.strategies import check_strategies, strategy_params
from tokenfuse.errors import ConfigError

# Where options are given (``Option.refused`` names the ones that cannot honour an option): the command
# line's commands (``generate``; ``serve``, also ``playground``; ``bench``; ``eval``), the server's
# per-request ``"tokenfuse"`` field (``server``) and the lm-eval plugin's model arguments (``lm_eval``).
SURFACES = ("generate", "serve", "bench", "eval", "server", "lm_eval")


@dataclass(frozen=True)
class Option:
    """What an option is on every surface that gives it (``SURFACES``), declared once beside its field
    (``Annotated[type, Option(...)]``): each surface is built from the fields and these (the command
    line's flags: ``tokenfuse.config.add_option_flags``; the server's request schema; the lm-eval
    plugin's model arguments), so a new option is one field.

    * ``help``: its one-line help (the flag's, the request field's description);
    * ``flag``: the command line's flag (default ``--`` and the name with dashes); ``metavar`` its value's name;
    * ``text``: how it is written as text where that is not plain (help and messages);
    * ``sub``: for an option that is a model of its own (``speculative``), a flag per sub-field:
      ``{field: Option(help, flag=...)}`` (the option's own flag then switches it on with the defaults);
    * ``refused``: ``{surface: why}`` for each surface that cannot honour it; there it is refused
      with a message naming the option, the surface and why (never silently dropped).
    """

    help: str
    flag: str | None = None
    metavar: str | None = None
    text: str | None = None
    sub: Mapping[str, Option] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.refused) - set(SURFACES)
        if unknown:
            raise ValueError(f"Option.refused: unknown surface(s) {', '.join(sorted(unknown))}; surfaces: "
                             f"{', '.join(SURFACES)}")


def option_of(info: FieldInfo) -> Option | None:
    """The ``Option`` declared on a field (``Annotated`` metadata), if any."""
    return next((m for m in info.metadata if isinstance(m, Option)), None)


def option_fields(model: type[BaseModel] | None = None, surface: str | None = None) -> dict[str, tuple[FieldInfo, Option]]:
    """The declared options of ``model`` (default ``EnsembleOptions``; a subclass adds its own) in field
    order, each ``(field, Option)``; with ``surface``, only those it honours. A field without an
    ``Option`` is an error: every option is declared on every surface."""
    fields = (model or EnsembleOptions).model_fields
    out = {}
    for name, info in fields.items():
        opt = option_of(info)
        if opt is None:
            raise TypeError(f"{(model or EnsembleOptions).__name__}.{name}: an option field needs its declaration, "
                            "Annotated[type, Option(help=...)] (tokenfuse.engine.options.Option)")
        if surface is None or surface not in opt.refused:
            out[name] = (info, opt)
    return out


def union_args(annotation: Any) -> tuple[Any, ...]:
    """The types of a union (``int | str`` -> ``(int, str)``), or the one type."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def bare(annotation: Any) -> Any:
    """A field's type without ``None`` (``float | None`` -> ``float``)."""
    args = [a for a in union_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 else functools.reduce(operator.or_, args)


def kind(annotation: Any) -> str:
    """How an option is written as flags: ``switch``, ``choice``, ``mapping``, ``list``, ``model`` or ``value``."""
    t = bare(annotation)
    origins = {typing.get_origin(a) or a for a in union_args(t)}
    if t is bool:
        return "switch"
    if typing.get_origin(t) is Literal:
        return "choice"
    if list in origins:
        return "list"
    if dict in origins:
        return "mapping"
    if isinstance(t, type) and issubclass(t, BaseModel):
        return "model"
    return "value"


def refusal(name: str, opt: Option, surface: str) -> str:
    """The one message refusing option ``name`` on ``surface``."""
    where = {"server": "the server's per-request options", "lm_eval": "the lm-eval plugin's model arguments"}
    return (f"{name}: not taken by {where.get(surface, f'`tokenfuse {surface}`')}: {opt.refused[surface]}")


class SpeculativeOptions(BaseModel):
    """Speculative decoding of greedy sequences (``tokenfuse.engine.speculative``): the drafter member
    (default: the one with the smallest weights) proposes up to ``k`` pieces per round, every
    member checks them in one chunked forward; ``adapt``: the next round drafts one more piece than
    were accepted."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    draft: str | None = None
    k: int = Field(4, ge=1, le=32)
    adapt: bool = True


class EnsembleOptions(BaseModel):
    """An ensemble's options (module docstring). Attributes:

    * ``method``: a registered combiner (``gac``, ``unite``, ``deepen``, ``contrast``; ``byte`` generates
      byte by byte: ``tokenfuse.engine.bytegen``, without what it ``lacks``); ``params`` its parameters
      and the adaptive ones (``boundary``, ``confidence``, ``prompt_weights``, ...);
    * ``primary``: the primary member's name (``None``: the member with the highest ``score``, else
      the first). Greedy ties go to the piece it finds more likely; it is the default ``gate`` and
      segments given text into steps (likelihood scoring);
    * ``agreement_skip``: take the piece every computed member ranks first without combining
      (``None``: on for greedy decoding with combiners where this is exact, ``gac`` and ``unite``);
    * ``threshold``, ``gate``: thresholded mode (GaC Eq. 5): the gate member (default: the primary)
      alone where its top probability is above ``threshold``; ``gate`` needs a threshold (the old
      spelling ``params.select``: ``read_old_spellings``);
    * ``window``: look-behind window (member tokens) for re-synchronisation;
    * ``scoring``: ``loglikelihood``'s path, ``one-forward`` or ``stepwise`` (the reference;
      docs/evaluation.md, "One-forward scoring");
    * ``parallel``: forward the members in threads (measured faster on a 2-core CPU; docs/benchmarks.md);
    * ``speculative``: speculative decoding of greedy sequences (``None``: off; on the bundled llama.cpp
      members it was measured slower: docs/benchmarks.md).

    The adaptive parameters and what they do: docs/methods.md, "Adaptive combination".
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    method: Annotated[str, Option(
        "combiner: gac (default), unite, deepen, contrast, byte (byte by byte)",
        refused={"eval": "it runs the methods of --methods (the config's own: `method:` in --config)"})] = "gac"
    params: Annotated[dict[str, Any], Option(
        "the method's parameters and the adaptive ones, e.g. k=5 for unite", flag="--param",
        text="KEY=VALUE (repeatable); model_args: a YAML mapping, params={k: 5}")] = Field(default_factory=dict)
    primary: Annotated[str | None, Option("primary member (default: the highest score in the config, else the first)",
                                          metavar="NAME")] = None
    agreement_skip: Annotated[bool | None, Option(
        "skip alignment when every member's top piece agrees (default: on for greedy gac/unite, and contrast "
        "with beta 0)")] = None
    gate: Annotated[str | None, Option("gate member of --threshold (default: the primary member)", metavar="NAME")] = None
    threshold: Annotated[float | None, Option(
        "thresholded mode: ensemble only when the gate's top probability <= T", metavar="T")] = Field(None, ge=0, le=1)
    window: Annotated[int, Option("look-behind window (member tokens) for re-synchronisation (default 8)",
                                  metavar="N")] = Field(8, ge=1, le=256)
    scoring: Annotated[Literal["one-forward", "stepwise"], Option(
        "likelihood scoring path (default one-forward; stepwise: the piece-by-piece reference)")] = "one-forward"
    parallel: Annotated[bool, Option(
        "forward the members in threads (default: on)",
        refused={"server": "the member threads are the server's own (serve's --parallel/--no-parallel or the "
                           "config)"})] = True
    speculative: Annotated[SpeculativeOptions | None, Option(
        "speculative decoding (greedy only; the same output as without it on transformers members, not always on "
        "llama.cpp ones, and measured slower there: docs/benchmarks.md)",
        sub={"draft": Option("the drafting member (implies --speculative; default: the smallest)", flag="--draft",
                             metavar="NAME"),
             "k": Option("pieces drafted per round at most (implies --speculative; default 4)", flag="--draft-k",
                         metavar="K")},
        refused={"bench": "bench times speculative decoding in its own rows (--speculative-k)"})] = None

    @field_validator("speculative", mode="before")
    @classmethod
    def _speculative_switch(cls, value: Any) -> Any:
        """``true``: on with the defaults; ``false``: off (a switch, as the command line's ``--speculative``)."""
        return ({} if value else None) if isinstance(value, bool) else value

    @field_validator("params", mode="before")
    @classmethod
    def _no_params(cls, params: Any) -> Any:
        return {} if params is None else params

    @model_validator(mode="before")
    @classmethod
    def _old_spellings(cls, data: Any) -> Any:
        return read_old_spellings(data)

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> EnsembleOptions:
        """The options' rules; those that need the members' names first where they are known when the
        options are made (a config's: validation context ``members``, ``(names, weights, hint)``;
        bare options meet their members in the ``Ensemble``)."""
        members = (info.context or {}).get("members")
        try:
            validate_params(self.method, self.params, extra=strategy_params())
            self._check_lacks()
            if members is not None:
                names, weights, hint = members
                try:
                    self.check_members(names, weights)
                except ConfigError as err:
                    raise ConfigError(str(err) + hint) from None
            check_strategies(self)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return self

    def _check_lacks(self) -> None:
        """``gate`` and ``speculative`` where the method lacks them (``Combiner.lacks``: ``byte``, which
        chooses bytes, has no pieces to gate or to draft)."""
        method = combiner_class(self.method)
        for name, value in (("gate", self.gate), ("speculative", self.speculative)):
            if value is not None:
                method.refuse(name)

    @property
    def primary_label(self) -> str:
        """The primary member as an error message names it."""
        return self.primary or "the primary member"

    def replace(self, **changes: Any) -> EnsembleOptions:
        """These options with ``changes`` applied and validated again (``merged`` says how)."""
        return type(self).model_validate(merged(self.model_dump(), changes))

    def check_members(self, names: Sequence[str], weights: Sequence[float]) -> None:
        """The rules that need the members: at least one, unique names, ``primary``/``gate``/
        ``speculative.draft`` among them, some positive weight. Raises ``ConfigError`` naming the field."""
        if not names:
            raise ConfigError("members: an ensemble needs at least one member")
        dup = sorted({n for n in names if list(names).count(n) > 1})
        if dup:
            raise ConfigError(f"members: names must be unique; repeated: {', '.join(dup)}")
        draft = self.speculative.draft if self.speculative is not None else None
        for field_name, value in (("gate", self.gate), ("primary", self.primary), ("speculative.draft", draft)):
            if value is not None and value not in names:
                raise ConfigError(f"{field_name}: {value!r} is not a member (members: {', '.join(names)})")
        if all(w <= 0 for w in weights):
            raise ConfigError("members.weight: at least one member needs a positive weight")

    def primary_of(self, names: Sequence[str], scores: Sequence[float | None]) -> str:
        """The primary member's name: ``primary`` if set, else the highest score, else the first."""
        return primary_of(self.primary, names, scores)


def primary_of(primary: str | None, names: Sequence[str], scores: Sequence[float | None]) -> str:
    """``primary`` if set, else the member with the highest score, else the first."""
    if primary is not None:
        return primary
    scored = [(s, n) for n, s in zip(names, scores) if s is not None]
    if scored:
        return max(scored, key=lambda x: x[0])[1]  # max keeps the first of equal scores
    return names[0]


def _primary_label(data: Mapping[str, Any]) -> str:
    """The primary member as an error message names it, from options or a config not validated yet."""
    if data.get("primary") is not None:
        return str(data["primary"])
    members = [m if isinstance(m, Mapping) else vars(m) for m in data.get("members") or []]
    names = [m.get("name") for m in members]
    if not names or not all(isinstance(n, str) for n in names):
        return "the primary member"
    return primary_of(None, names, [s if isinstance(s := m.get("score"), (int, float)) else None for m in members])


class _OldSelect(BaseModel):
    """The old spelling of thresholded mode on the primary member (``read_old_spellings``)."""

    model_config = ConfigDict(allow_inf_nan=False)
    select: float | None = Field(None, ge=0, le=1)
    select_boundary: bool = True


def read_old_spellings(data: Any) -> Any:
    """Options given in an old spelling, in the one spelling (a one-line ``FutureWarning`` once).

    ``params.select: t`` (selective ensembling, with ``select_boundary``) is thresholded mode on the
    primary member: ``threshold: t`` and ``params.boundary`` (its word-boundary rule, on unless
    ``select_boundary: false``); ``select: null`` is dropped. Where the method takes no adaptive
    parameters the keys are left for its own check to name.
    """
    if not isinstance(data, Mapping) or not isinstance(data.get("params"), Mapping):
        return data
    params = data["params"]
    if "select" not in params and "select_boundary" not in params:
        return data
    try:
        if not combiner_class(data.get("method") or "gac").adaptive:
            return data
    except ConfigError:
        return data  # an unknown method: its own check names it
    params = dict(params)
    method = data.get("method") or "gac"
    try:
        old = _OldSelect(select=params.pop("select", None), select_boundary=params.pop("select_boundary", True))
    except ValidationError as err:
        e = err.errors()[0]
        raise ValueError(f"params.{e['loc'][0]}: {method}: {e['msg']}") from None
    select, boundary = old.select, old.select_boundary
    out = {**data, "params": params}
    if select is None:
        return out
    if data.get("gate") is not None or data.get("threshold") is not None:
        raise ValueError(f"params.select: selective ensembling gates on the primary member "
                         f"({_primary_label(data)}); drop `gate` and `threshold`, or drop "
                         "`select` (set `primary` to choose the member)")
    warnings.warn("params.select is now spelled `threshold` (the gate: the primary member) with `params.boundary` "
                  "(its word-boundary rule; on unless select_boundary: false)", FutureWarning, stacklevel=2)
    params["boundary"] = boundary
    return out | {"threshold": select}


def merged(data: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (options as a mapping) with ``changes``: a given key is applied, ``None`` included
    (``gate=None`` drops the gate); a different ``method`` clears ``params`` (another method's
    parameters do not carry over); ``params`` merge key by key into the (possibly cleared) ones."""
    out = dict(data)
    if "method" in changes and changes["method"] != data.get("method"):
        out["params"] = {}
    for key, value in changes.items():
        if key == "params":
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"params: expected a mapping of parameter names to values, got {value!r}")
            out["params"] = {**out.get("params", {}), **value}
        else:
            out[key] = value
    return out


def own_params(options: EnsembleOptions) -> dict[str, Any]:
    """The method's own parameters: ``options.params`` without the strategies' keys."""
    theirs = {k for model in strategy_params() for k in model.model_fields}
    return {k: v for k, v in options.params.items() if k not in theirs}


def options_error(err: ValidationError, origin: str | None = None) -> str:
    """Every validation error on one line, each naming its field: ``<origin>: members.1.weight: ...``
    (the options' own checks name their field in the message; a config's ``options`` value is named
    as it is written, at the top level: ``threshold``, not ``options.threshold``)."""
    lines = []
    for e in err.errors():
        where = e["loc"][1:] if e["loc"][:1] == ("options",) else e["loc"]  # a config's options: named as written
        loc = ".".join(str(p) for p in where)
        msg = e["msg"].removeprefix("Value error, ")
        text = f"{loc}: {msg}" if loc else msg
        lines.append(f"{origin}: {text}" if origin else text)
    return "; ".join(lines)
