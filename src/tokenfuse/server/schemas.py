"""Request schemas of the OpenAI-compatible API.

Sampling fields are defined once (``_Common``) and shared by completion and chat requests.
Fields a client leaves out take the ensemble config's ``decoding`` values. Fields of the OpenAI
API that an ensemble cannot honour are accepted at their neutral value and refused otherwise with
a 400 that names them (never silently ignored). Unknown fields are ignored, as most
OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
)
from pydantic_core import PydanticCustomError

from tokenfuse.config import override_fields
from tokenfuse.engine.options import EnsembleOptions, Option, bare, kind, refusal


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _RequestOptions(_Strict):
    """Per-request ensemble options (the request's ``"tokenfuse"`` field): built from the options'
    declarations (``request_options_model``)."""

    def as_options(self) -> dict | None:
        """The ensemble options (the trace fields are not any)."""
        d = self.model_dump(exclude_none=True, exclude={"trace", "trace_k"})
        return d or None


def request_options_model(options: type[EnsembleOptions] | None = None) -> type[_RequestOptions]:
    """The schema of the request's ``"tokenfuse"`` field, from the overrides' declarations
    (``tokenfuse.config.override_fields``; ``options`` default ``EnsembleOptions``): each option the
    server honours as an optional field of the option's type and constraints (``null``/left out: the
    config's; an option that is a model, ``speculative``, also ``true``/``false``: on with the
    defaults / off), each it does not (``Option.refused``) refused with a 400 naming it and why; and
    ``trace``/``trace_k``."""
    fields: dict[str, Any] = {}
    refused: dict[str, str] = {}
    for name, (info, opt) in override_fields(options).items():
        if "server" in opt.refused:
            fields[name] = (Any, Field(None, description=refusal(name, opt, "server")))
            refused[name] = refusal(name, opt, "server")
            continue
        t = bare(info.annotation)
        t = t | bool if kind(info.annotation) == "model" else t
        constraints = [m for m in info.metadata if not isinstance(m, Option)]
        fields[name] = (Annotated[(t, *constraints)] | None if constraints else t | None,
                        Field(None, description=opt.help))
    fields["trace"] = (bool, False)
    fields["trace_k"] = (int, Field(5, ge=1, le=20))

    def refuse(cls, value: Any, info: ValidationInfo) -> Any:
        raise ValueError(refused[info.field_name])

    validators = {"_refused": field_validator(*refused, mode="before")(refuse)} if refused else {}
    return create_model("TokenfuseOptions", __base__=_RequestOptions, __validators__=validators,
                        __doc__=TOKENFUSE_OPTIONS_DOC, **fields)


TOKENFUSE_OPTIONS_DOC = """Per-request ensemble options (the request's ``"tokenfuse"`` field).

Every ensemble option the server honours, as in the config (``method``, ``params``, ``primary``,
``gate``, ``threshold``, ``agreement_skip``, ``window``, ``scoring``, ``speculative``: built from the
options' declarations, ``request_options_model``), and ``weights`` (a list in member order, or
``{"member name": weight}``). Members stay loaded once; each distinct option set gets its own
light ``Ensemble`` on them. ``trace`` (with ``trace_k``, each member's top-k, default 5) asks for
the step trace in the response; it does not change the ensemble.
"""

TokenfuseOptions = request_options_model()


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0: only with echo (scoring the prompt)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM extra; -1 or 0 = off
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    tokenfuse: TokenfuseOptions | None = None  # type: ignore[valid-type]

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return [s for s in stops if s]

    def requested_max_tokens(self) -> int | None:
        """The request's token limit (``None``: the config's default)."""
        return self.max_tokens

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for each field set to a value this server cannot honour."""
        out = []
        if self.presence_penalty:
            out.append(("presence_penalty", "penalties are not supported by the ensemble"))
        if self.frequency_penalty:
            out.append(("frequency_penalty", "penalties are not supported by the ensemble"))
        if self.logit_bias:
            out.append(("logit_bias", "members have different vocabularies; logit_bias is not supported"))
        if self.min_p:
            out.append(("min_p", "min_p is not supported; use top_p or top_k"))
        return out


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.max_tokens == 0 and not self.echo:
            out.append(("max_tokens", "max_tokens 0 generates nothing; it is allowed only with echo "
                                      "(scoring the prompt)"))
        if self.best_of not in (None, 1, self.n):
            out.append(("best_of", "best_of must equal n"))
        if self.suffix:
            out.append(("suffix", "suffix (fill-in-the-middle) is not supported"))
        return out


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_needed(cls, v: str | list[ContentPart] | None, info: ValidationInfo):
        """Only an assistant message may go without content (OpenAI's rule); ``null`` is none."""
        role = info.data.get("role")
        if v is None and role is not None and role != "assistant":
            raise PydanticCustomError("missing", "a {role} message needs content: a string or a list of text parts",
                                      {"role": role})
        return v

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.type != "text" or p.text is None:
                raise ValueError(f"content part of type {p.type!r}: only text parts are supported")
            parts.append(p.text)
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name) when given, else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.requested_max_tokens() == 0:
            out.append(("max_tokens", "max_tokens 0 generates nothing; use at least 1"))
        if self.top_logprobs and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        if self.tools:
            out.append(("tools", "tool calling is not supported"))
        if self.tool_choice not in (None, "none", "auto"):
            out.append(("tool_choice", "tool calling is not supported"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(("response_format", "only response_format {\"type\": \"text\"} is supported"))
        return out
