"""The one configuration of an ensemble: a YAML file validated by pydantic.

Errors name the field (``members.1.weight``) and what to write instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tokenfuse.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False
    n_ctx: int = Field(4096, ge=16)  # llamacpp: context length per sequence
    n_threads: int | None = Field(None, ge=1)  # llamacpp: threads (default: all cores)
    multi_seq: int = Field(0, ge=0, le=64)  # llamacpp: >0 = one shared context, batched decode (see README)
    prefix_cache: bool = True  # llamacpp: a new sequence reuses the cached keys/values of a shared prefix
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
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)


class EnsembleConfig(_Strict):
    """An ensemble: members, the combining method and its parameters, gate/threshold, decoding."""

    members: list[MemberConfig] = Field(min_length=1)
    method: str = "gac"
    params: dict[str, Any] = Field(default_factory=dict)
    primary: str | None = None  # default: the member with the highest `score`, else the first listed
    agreement_skip: bool | None = None  # None: on for greedy decoding with gac/unite, off otherwise
    gate: str | None = None
    threshold: float | None = Field(None, ge=0, le=1)
    window: int = Field(8, ge=1, le=256)
    parallel: bool = True  # forward members in threads (measured faster on a 2-core CPU; see README)
    decoding: DecodingConfig = Field(default_factory=DecodingConfig)
    cache_dir: str | None = None
    placement: Literal["local", "ray"] = "local"  # ray: each member in a Ray actor (extra tokenfuse[ray])
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"  # Ray placement group
    ray_address: str | None = None  # ray.init(address=...) when Ray is not initialised yet (None: local)
    on_member_failure: Literal["error", "skip"] = "error"  # skip: a failed remote/Ray member is left out

    @field_validator("method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        from tokenfuse.combiners import REGISTRY

        if v not in REGISTRY:
            raise ValueError(f"unknown method {v!r}; available: {', '.join(sorted(REGISTRY))}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> EnsembleConfig:
        names = [m.name for m in self.members]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"members: names must be unique; repeated: {', '.join(sorted(dup))}")
        if self.gate is not None and self.gate not in names:
            raise ValueError(f"gate: {self.gate!r} is not a member name (members: {', '.join(names)})")
        if self.primary is not None and self.primary not in names:
            raise ValueError(f"primary: {self.primary!r} is not a member name (members: {', '.join(names)})")
        if self.threshold is not None and self.gate is None:
            raise ValueError("threshold: thresholded GaC needs `gate: <member name>`")
        if all(m.weight == 0 for m in self.members):
            raise ValueError("members: at least one member needs weight > 0")
        from tokenfuse.combiners import REGISTRY

        if getattr(REGISTRY.get(self.method), "needs", "full") == "full":
            for i, m in enumerate(self.members):
                if m.backend == "openai" and m.topk_fill == "error":
                    raise ValueError(
                        f"members.{i}.backend: {m.name!r} is served over the OpenAI API, which gives only top-k "
                        f"log-probabilities, but method {self.method!r} needs full distributions; use "
                        "`method: unite`, or set `topk_fill: uniform` on the member (docs/serving.md)")
        return self

    @property
    def primary_name(self) -> str:
        """The primary member: ``primary`` if set, else the highest ``score``, else the first member."""
        if self.primary is not None:
            return self.primary
        scored = [m for m in self.members if m.score is not None]
        if scored:
            return max(scored, key=lambda m: m.score).name  # max keeps the first of equal scores
        return self.members[0].name

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(exclude_none=True), sort_keys=False)


def _format(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{origin}: {loc}: {msg}")
    return "\n".join(lines)


def parse_config(data: Any, *, origin: str = "config") -> EnsembleConfig:
    """Validate a mapping (e.g. parsed YAML) into an ``EnsembleConfig``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping with `members:`, got {type(data).__name__}")
    try:
        return EnsembleConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format(err, origin)) from None


def load_config(path: str | Path) -> EnsembleConfig:
    """Read and validate a YAML config file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML: {err}") from None
    return parse_config(data, origin=str(p))


def config_from_models(models: str | list[str], **overrides: Any) -> EnsembleConfig:
    """A config from a comma-separated list of member names/sources (the CLI's ``--models``)."""
    names = [m.strip() for m in (models.split(",") if isinstance(models, str) else models) if m.strip()]
    members = [{"name": _short(n), "source": n} for n in names]
    return parse_config({"members": members, **{k: v for k, v in overrides.items() if v is not None}},
                        origin="--models")


def _short(source: str) -> str:
    p = Path(source)
    return p.stem if p.suffix == ".gguf" else (p.name or source)
