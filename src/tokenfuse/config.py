"""The one configuration of an ensemble: a YAML file validated by pydantic.

An ``EnsembleConfig`` is the ensemble's options (``tokenfuse.engine.options.EnsembleOptions``,
which validates them), its members, their placement and the decoding defaults. Owns: the members'
fields and the checks that need them, and the entry points' overrides (``with_overrides``: the
options' one override rule, ``engine.options.merged``, plus weights and decoding; the command
line's flags for them: ``tokenfuse.flags``). The config holds its options by composition
(``cfg.options``, an ``EnsembleOptions``), written at the top level of the YAML as before and read
as ``cfg.method``, ``cfg.params``, ... Errors name the field (``members.1.weight``) and what to
write instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.fields import FieldInfo

from tokenfuse.bundled import DEFAULT_ENSEMBLE
from tokenfuse.combiners import combiner_class
from tokenfuse.engine.options import (
    EnsembleOptions,
    Option,
    merged,
    option_fields,
    options_error,
    read_old_spellings,
)
from tokenfuse.errors import ConfigError


def _multi_seq(value: Any) -> Any:
    """``multi_seq``: ``auto`` or a number of sequence slots (one error naming the field, not one per
    form it may take)."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 64):
        return value
    raise ValueError(f"expected `auto` or a number of sequence slots from 0 to 64, got {value!r}")


MultiSeq = Annotated[int | Literal["auto"], BeforeValidator(_multi_seq)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # .inf / .nan are no weight or temperature


class MemberConfig(_Strict):
    """One member.

    ``source`` is a bundled model name, a Hugging Face model id, a local directory or a ``.gguf``
    file; it defaults to ``name`` (so ``- name: gemma3-270m`` is a whole member). ``backend: auto``
    runs GGUF sources (bundled models, ``.gguf`` files) with llama.cpp on CPU when
    llama-cpp-python is installed, everything else with transformers.
    """

    name: str = Field(min_length=1)
    source: str | None = None
    gguf_file: str | None = None
    backend: Literal["auto", "transformers", "llamacpp", "openai"] = "auto"
    weight: float = Field(1.0, ge=0)
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # transformers: auto = bfloat16 on CUDA, float32 on CPU
    batched: bool = True  # transformers: all rows of a step in one forward (false: one forward per sequence)
    trust_remote_code: bool = False
    n_ctx: int = Field(4096, ge=16)  # llamacpp: context length per sequence
    n_threads: int | None = Field(None, ge=1)  # llamacpp: fixed threads (default: the cores shared out per call)
    # llamacpp: sequence slots of one shared context, each step's new ids in one batched decode; "auto":
    # 8 with exact_calls (batched = one by one), else 0 (a context per sequence); docs/configuration.md
    multi_seq: MultiSeq = "auto"
    prefix_cache: bool = True  # llamacpp: a new sequence reuses the cached keys/values of a shared prefix
    exact_calls: bool = False  # llamacpp: numbers independent of how ids are cut into calls (docs/methods.md)
    score: float | None = None  # e.g. dev accuracy from `tokenfuse select`; picks the default primary member
    # backend openai: a model behind an OpenAI-compatible server (docs/serving.md)
    base_url: str | None = None  # e.g. http://127.0.0.1:8080/v1
    model: str | None = None  # the server's model id (default: the member's name)
    api_key: str | None = None  # sent as `Authorization: Bearer ...`; or `api_key_env`
    api_key_env: str | None = None  # name of an environment variable holding the key
    tokenizer: str | None = None  # local tokenizer for byte alignment: bundled name or tokenizer.json dir (default: source)
    top_k: int = Field(20, ge=1, le=1000)  # openai: next-token log-probabilities asked per step
    timeout: float = Field(30.0, gt=0)  # openai: seconds per HTTP request
    retries: int = Field(2, ge=0, le=10)  # openai: retries after a failed request (with backoff)
    prompt_format: Literal["auto", "ids", "text"] = "auto"  # openai: token ids where the server accepts them
    topk_fill: Literal["error", "uniform"] = "error"  # openai: for full-distribution methods (gac), see docs
    # placement: ray — the resources of this member's actor
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _remote_fields(self) -> MemberConfig:
        if self.backend == "openai" and not self.base_url:
            raise ValueError("base_url: backend openai needs the server's URL, e.g. http://127.0.0.1:8080/v1")
        if self.backend != "openai":
            for f in ("base_url", "model", "api_key", "api_key_env"):
                if getattr(self, f) is not None:
                    raise ValueError(f"{f}: only for `backend: openai` (this member's backend is {self.backend})")
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: expected an http:// or https:// URL, got {self.base_url!r}")
        return self

    @property
    def resolved_source(self) -> str:
        return self.source or self.name


class DecodingConfig(_Strict):
    """Decoding defaults (every one can be overridden per call or on the command line)."""

    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # a 64-bit integer (what the sampler's generator takes)
    stop: list[str] = Field(default_factory=list)


class MemberOverrides(BaseModel):
    """The override that is the members', not an option (the ensemble's weights: ``with_overrides``'
    ``weights``), declared as the options are (``engine.options.Option``) so that every surface has it."""

    weights: Annotated[list[float] | dict[str, float] | None, Option(
        "comma-separated member weights, in member order", metavar="W,W,...",
        text="a list in member order or {member name: weight}; model_args: W+W+...")] = None


def override_fields(options: type[EnsembleOptions] | None = None,
                    surface: str | None = None) -> dict[str, tuple[FieldInfo, Option]]:
    """What an entry point may override, declared (``engine.options.option_fields``): the options'
    fields (``options``, default ``EnsembleOptions``) and the members' weights; with ``surface``,
    only those it honours."""
    return {**option_fields(options, surface), **option_fields(MemberOverrides, surface)}


# The ensemble fields a caller may override (command line, server requests, lm-eval model_args, eval rows).
ENSEMBLE_OPTIONS = tuple(override_fields())


class EnsembleConfig(_Strict):
    """An ensemble: its options (``options``, an ``EnsembleOptions``; written at the top level of the
    YAML and read back there, and each readable as ``cfg.<option>``), its members, their placement
    and the decoding defaults."""

    members: list[MemberConfig] = Field(min_length=1)
    options: EnsembleOptions = Field(default_factory=EnsembleOptions)  # validated knowing the members (below)
    decoding: DecodingConfig = Field(default_factory=DecodingConfig)
    cache_dir: str | None = None
    placement: Literal["local", "ray"] = "local"  # ray: each member in a Ray actor (extra tokenfuse[ray])
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"  # Ray placement group
    ray_address: str | None = None  # ray.init(address=...) when Ray is not initialised yet (None: local)
    ray_max_restarts: int = Field(0, ge=0)  # ray: restarts of a dead member actor (its sequences are re-sent whole)
    ray_call_timeout: float | None = Field(None, gt=0)  # ray: seconds before a member call counts as unavailable
    on_member_failure: Literal["error", "skip"] = "error"  # skip: a failed remote/Ray member is left out

    @model_validator(mode="before")
    @classmethod
    def _gather_options(cls, data: Any) -> Any:
        """The options, written at the top level (``method: unite``), into the ``options`` value (or an
        ``EnsembleOptions`` given as ``options=``, the top-level keys applied over it)."""
        if not isinstance(data, Mapping):
            return data
        data = read_old_spellings(data)  # here: its messages name the primary among the members
        given = data.get("options")
        if "options" in data and not isinstance(given, EnsembleOptions):
            raise ValueError("options: Extra inputs are not permitted (the options are written at the top level: "
                             f"{', '.join(EnsembleOptions.model_fields)})")
        own = {k: v for k, v in data.items() if k in EnsembleOptions.model_fields}
        rest = {k: v for k, v in data.items() if k not in own and k != "options"}
        if given is None:
            return {"options": own, **rest}
        return {"options": given.model_dump() | own if own else given, **rest}

    @field_validator("options", mode="wrap")
    @classmethod
    def _options_with_members(cls, value: Any, handler: Any, info: ValidationInfo) -> EnsembleOptions:
        """The options validated with the members' names known (``EnsembleOptions``' rules that need
        them come before those that do not, as for bare options in the ``Ensemble``)."""
        members = info.data.get("members")
        if members is None:  # the members' own errors are named; the options are checked alone
            return handler(value)
        if isinstance(value, EnsembleOptions):
            value = value.model_dump()
        context = {"members": ([m.name for m in members], [m.weight for m in members], _repeat_hint(members))}
        return EnsembleOptions.model_validate(value, context=context)

    @model_serializer(mode="wrap")
    def _options_at_top(self, handler: Any) -> dict[str, Any]:
        """Dumped as it is written: the options at the top level, first (``to_yaml``, ``with_overrides``)."""
        data = handler(self)
        return {**data.pop("options", {}), **data}

    @model_validator(mode="after")
    def _with_members(self) -> EnsembleConfig:
        """What only the config knows: members' backends and placement against the options."""
        self._adaptive_consistent()
        self._speculative_consistent()
        if combiner_class(self.method).needs != "topk":  # full rows (the ``byte`` method's views read them too)
            for i, m in enumerate(self.members):
                if m.backend == "openai" and m.topk_fill == "error":
                    raise ValueError(
                        f"members.{i}.backend: {m.name!r} is served over the OpenAI API, which gives only top-k "
                        f"log-probabilities, but method {self.method!r} needs full distributions; use "
                        "`method: unite`, or set `topk_fill: uniform` on the member (docs/serving.md)")
        return self

    def _adaptive_consistent(self) -> None:
        """PackLLM prompt weights need every member's log-probabilities in this process."""
        if self.params.get("prompt_weights") is not None:
            if self.placement == "ray":
                raise ValueError("placement: params.prompt_weights (PackLLM) needs every member's log-probabilities "
                                 "at each prompt position, which Ray members do not give; use `placement: local`")
            for i, m in enumerate(self.members):
                if m.backend == "openai":
                    raise ValueError(f"members.{i}.backend: params.prompt_weights (PackLLM) needs member {m.name!r}'s "
                                     "log-probabilities at every prompt position, which the OpenAI API does not give")

    def _speculative_consistent(self) -> None:
        """The drafter runs in this process (the engine checks its loaded members again)."""
        spec = self.speculative
        if spec is None or spec.draft is None:
            return
        names = [m.name for m in self.members]
        if self.placement == "ray" or self.members[names.index(spec.draft)].backend == "openai":
            raise ValueError(f"speculative.draft: {spec.draft!r} does not run in this process (placement: local, "
                             "backend llamacpp or transformers); speculative decoding drafts with a local member")

    @property
    def primary_name(self) -> str:
        """The primary member: ``primary`` if set, else the highest ``score``, else the first member."""
        return self.options.primary_of([m.name for m in self.members], [m.score for m in self.members])

    def to_yaml(self) -> str:
        data = self.model_dump(exclude_none=True)
        data = {"members": data.pop("members"), **data}  # members first, as people write it
        return yaml.safe_dump(data, sort_keys=False)

    def with_overrides(self, *, decoding: Mapping[str, Any] | None = None, origin: str = "overrides",
                       names: Mapping[str, str] | None = None, **options: Any) -> EnsembleConfig:
        """This config with ``options`` applied and validated again: the one override rule of every
        entry point (command line, server requests, lm-eval ``model_args``, eval rows).

        ``options`` are ``ENSEMBLE_OPTIONS``; a key that is given is applied, ``None`` included
        (``gate=None`` drops the gate), so pass only what was asked for:

        * ``method``: a different method clears ``params`` (another method's parameters do not
          carry over); the same method keeps them;
        * ``params``: merged key by key into the (possibly cleared) parameters;
        * every other option (``primary``, ``gate``, ``threshold``, ``window``, ...;
          ``speculative``: a mapping of ``SpeculativeOptions``' fields, ``true``: on with the
          defaults, ``None``/``false``: off): replaced;
        * ``weights``: a list in member order, or ``{member name: weight}`` (the others kept).

        ``decoding`` fields (``DecodingConfig``) are merged into the decoding defaults.

        Raises ``ConfigError``: an option's own mistake is named ``names[key]`` if given (e.g. the
        command line's ``--weights``), else ``"<origin>: <key>"``; the result's validation errors
        read ``"<origin>: <field>: <message>"``.
        """
        unknown = set(options) - set(ENSEMBLE_OPTIONS)
        if unknown:
            raise ConfigError(f"{origin}: unknown option(s) {', '.join(sorted(unknown))}; "
                              f"allowed: {', '.join(ENSEMBLE_OPTIONS)}")
        label = {k: f"{origin}: {k}" for k in ENSEMBLE_OPTIONS} | dict(names or {})
        params = options.get("params")
        if params is not None and not isinstance(params, Mapping):
            raise ConfigError(f"{label['params']}: expected a mapping of parameter names to values, got {params!r}")
        weights = options.pop("weights", None)
        data = merged(self.model_dump(), options)  # the options' one override rule
        if weights is not None:
            for m, w in zip(data["members"], _weights(weights, self.members, label["weights"])):
                m["weight"] = w
        if decoding:
            data["decoding"] = {**data["decoding"], **decoding}
        return parse_config(data, origin=origin)


def _delegate(name: str) -> property:
    return property(lambda self: getattr(self.options, name), doc=f"``options.{name}`` (``EnsembleOptions``)")


for _name in EnsembleOptions.model_fields:  # cfg.method, cfg.params, ...: the options', read-only
    setattr(EnsembleConfig, _name, _delegate(_name))
del _name


def _repeat_hint(members: list[MemberConfig]) -> str:
    """How to ensemble a model with itself, for members that repeat a name ("" when none does)."""
    names = [m.name for m in members]
    dup = next((m for m in members if names.count(m.name) > 1), None)
    if dup is None:
        return ""
    src = dup.resolved_source
    return (f"; to ensemble a model with itself give each copy its own name with the same source "
            f"(`name: {dup.name}#2`, `source: {src}`), or repeat it in --models ({src},{src})")


def _weights(weights: Any, members: list[MemberConfig], label: str) -> list[Any]:
    """Every member's weight from a list in member order or a ``{name: weight}`` mapping (others kept);
    the values are checked by the config's validation (``members.<i>.weight``)."""
    names = [m.name for m in members]
    if isinstance(weights, Mapping):
        bad = [n for n in weights if n not in names]
        if bad:
            raise ConfigError(f"{label}: {', '.join(map(repr, bad))} not a member (members: {', '.join(names)})")
        return [weights.get(m.name, m.weight) for m in members]
    if isinstance(weights, (list, tuple)):
        if len(weights) != len(names):
            raise ConfigError(f"{label}: {len(weights)} weights for {len(names)} members ({', '.join(names)})")
        return list(weights)
    raise ConfigError(f"{label}: expected a list in member order or a mapping of member names, got {weights!r}")


def yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (``line 2, column 5``)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or " ".join(str(err).split())
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def parse_config(data: Any, *, origin: str = "config") -> EnsembleConfig:
    """Validate a mapping (e.g. parsed YAML) into an ``EnsembleConfig``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping with `members:`, got {type(data).__name__}")
    try:
        return EnsembleConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(options_error(err, origin)) from None


def load_config(path: str | Path) -> EnsembleConfig:
    """Read and validate a YAML config file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML: {yaml_problem(err)}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{p}: not a UTF-8 text file (byte {err.start}); write the config as UTF-8 YAML") from None
    except OSError as err:
        raise ConfigError(f"{p}: cannot read the config file: {err.strerror or err}") from None
    return parse_config(data, origin=str(p))


def config_from_source(*, config: str | Path | None = None, models: str | list[str] | None = None) -> EnsembleConfig:
    """The config file ``config`` if given, else members from ``models`` (comma-separated), else the
    bundled default ensemble."""
    if config:
        return load_config(config)
    return config_from_models(models or ",".join(DEFAULT_ENSEMBLE))


def config_from_models(models: str | list[str], **overrides: Any) -> EnsembleConfig:
    """A config from a comma-separated list of member names/sources (the CLI's ``--models``).

    Each member is named after its source (a ``.gguf`` file's stem, a directory's name); a name
    given again gets ``#2``, ``#3``, ...: ``gemma3-270m,gemma3-270m`` is the members ``gemma3-270m``
    and ``gemma3-270m#2`` (loaded once, ``tokenfuse.load.load_ensemble``)."""
    sources = [m.strip() for m in (models.split(",") if isinstance(models, str) else models) if m.strip()]
    members: list[dict[str, str]] = []
    for source in sources:  # a repeated model is a self-ensemble: its copies are name, name#2, ...
        name, copy = _short(source), 1
        while any(m["name"] == name for m in members):
            copy += 1
            name = f"{_short(source)}#{copy}"
        members.append({"name": name, "source": source})
    return parse_config({"members": members, **{k: v for k, v in overrides.items() if v is not None}},
                        origin="--models")


def _short(source: str) -> str:
    p = Path(source)
    return p.stem if p.suffix == ".gguf" else (p.name or source)
