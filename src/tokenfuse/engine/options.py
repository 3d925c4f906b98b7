"""What an ensemble is, apart from its loaded members: one frozen, validated value.

``EnsembleOptions`` holds the method and its parameters (the combiner's own and the strategies'
adaptive ones, ``tokenfuse.engine.strategies``), the primary member, thresholded mode (``gate``,
``threshold``), agreement skip, the re-sync window, likelihood scoring, member threads and
speculative decoding. Every rule that needs nothing but the options is checked here, once, when
the value is made (pydantic validation); the rules that need the members' names
(``check_members``) are checked by the ``Ensemble``, and by a config, which knows its members,
before the rest. ``replace`` is the one
override rule (a different method clears the parameters; parameters merge key by key). Members'
weights and scores are the ensemble's (``Ensemble(weights=..., scores=...)``: their config's, or
``Ensemble.variant(weights=...)``), never written to the members.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from tokenfuse.combiners import combiner_class, validate_params
from tokenfuse.engine.strategies import check_strategies, strategy_params
from tokenfuse.errors import ConfigError


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
    method: str = "gac"
    params: dict[str, Any] = Field(default_factory=dict)
    primary: str | None = None
    agreement_skip: bool | None = None
    gate: str | None = None
    threshold: float | None = Field(None, ge=0, le=1)
    window: int = Field(8, ge=1, le=256)
    scoring: Literal["one-forward", "stepwise"] = "one-forward"
    parallel: bool = True
    speculative: SpeculativeOptions | None = None

    @field_validator("params", mode="before")
    @classmethod
    def _no_params(cls, params: Any) -> Any:
        return {} if params is None else params

    @model_validator(mode="before")
    @classmethod
    def _old_spellings(cls, data: Any) -> Any:
        return read_old_spellings(data)

    @model_validator(mode="after")
    def _consistent(self) -> EnsembleOptions:
        try:
            validate_params(self.method, self.params, extra=strategy_params())
            self._check_lacks()
            self._check_known_members()
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

    def _check_known_members(self) -> None:
        """``check_members`` where the members are known when the options are made (a config's);
        bare options meet their members in the ``Ensemble``."""

    @property
    def primary_label(self) -> str:
        """The primary member as an error message names it."""
        return self.primary or "the primary member"

    @property
    def options(self) -> EnsembleOptions:
        """The options alone (an ``EnsembleConfig`` is these plus members, placement and decoding)."""
        return EnsembleOptions.model_validate({k: getattr(self, k) for k in EnsembleOptions.model_fields})

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
    (the options' own checks name their field in the message)."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        text = f"{loc}: {msg}" if loc else msg
        lines.append(f"{origin}: {text}" if origin else text)
    return "; ".join(lines)
