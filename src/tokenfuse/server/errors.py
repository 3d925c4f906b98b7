"""Errors a client sees, as OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}``.

The status comes from the exception's *type*, never from its message text. A user mistake is a
4xx with a message naming the field; an unexpected failure is a 500 whose message says so (the
traceback goes to the server log only). ``add_exception_handlers(app)`` answers every error of
the app in that shape: ours, FastAPI's validation errors and Starlette's HTTP errors (404, 405).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenfuse.errors import ConfigError, MemberUnavailableError, ModelLoadError, TokenfuseError
from tokenfuse.server.scheduler import ContextError

log = logging.getLogger("tokenfuse.server")


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error answer (the routes declare it for their 4xx in the OpenAPI schema)."""

    error: ErrorObject


class BadRequest(APIError):
    """A well-formed request this server cannot serve (an unsupported value, bad options)."""

    code = "invalid_value"


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class InvalidRequestBody(BadRequest):
    """The body is not JSON or does not match the request schema (FastAPI's validation errors,
    re-shaped): 400, as OpenAI and vLLM answer, with ``param`` the field path and ``code`` one of
    ``VALIDATION_CODES``."""


class Unauthorized(APIError):
    status = 401
    code = "invalid_api_key"


class ModelNotFound(APIError):
    status = 404
    code = "model_not_found"


class NotFound(APIError):
    status = 404
    code = "not_found"


class RequestTooLarge(APIError):
    status = 413
    code = "request_too_large"


class ServerBusy(APIError):
    status = 503
    type = "server_error"
    code = "server_busy"


class MemberUnavailable(APIError):
    status = 503
    type = "server_error"
    code = "member_unavailable"


class InternalError(APIError):
    status = 500
    type = "server_error"
    code = "internal_error"


def from_exception(err: BaseException) -> APIError:
    """The API error for any exception (by type)."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, ConfigError):
        return BadRequest(str(err), param="tokenfuse", code="invalid_ensemble_options")
    if isinstance(err, MemberUnavailableError):
        return MemberUnavailable(str(err))
    if isinstance(err, ModelLoadError):
        return InternalError(str(err), code="model_load_error")
    if isinstance(err, TokenfuseError):
        return InternalError(f"{type(err).__name__}: {err}")
    return InternalError(f"internal error ({type(err).__name__}); see the server log")


def client_error(err: BaseException, *, chat: bool = False) -> APIError:
    """The API error for a failure the scheduler reported for a request (a 5xx is logged)."""
    if isinstance(err, ContextError):
        return ContextLengthExceeded(str(err), param="messages" if chat else "prompt")
    api = from_exception(err)
    if api.status >= 500:
        log.error("request failed: %s: %s", type(err).__name__, err)
    return api


# ---------------------------------------------------------------------------- exception handlers

def _respond(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _api_error(_req: Request, err: APIError) -> JSONResponse:
    return _respond(err)


# The ``code`` of a body that does not match the request schema (docs/serving.md, "Errors").
VALIDATION_CODES = {
    "invalid_json": "the body is not valid JSON (or not a JSON object)",
    "missing": "a required field is missing (or null where a value is needed)",
    "invalid_type": "a field has the wrong type (a string for a number, an object for a list, ...)",
    "invalid_value": "a field has the right type but a value out of range or not among the allowed ones",
    "unknown_parameter": "a field that this object does not have (in the strict `tokenfuse` options)",
}


def validation_code(error_type: str) -> str:
    """The ``code`` (``VALIDATION_CODES``) of one pydantic error type."""
    if error_type in ("missing", "union_tag_not_found"):
        return "missing"
    if error_type == "extra_forbidden":
        return "unknown_parameter"
    if error_type in ("json_invalid", "json_type"):
        return "invalid_json"
    if error_type.endswith(("_type", "_parsing")) or error_type in ("int_from_float", "is_instance_of",
                                                                   "string_unicode"):
        return "invalid_type"
    return "invalid_value"


async def _invalid_body(_req: Request, err: RequestValidationError) -> JSONResponse:
    """FastAPI's validation errors as one 400: ``param`` the first bad field's path
    (``messages.0.content``), ``code`` from ``validation_code``, and up to five fields in the message."""
    errors = err.errors()
    body = getattr(err, "body", None)
    if not errors:
        return _respond(InvalidRequestBody("the body does not match the request schema"))
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return _respond(InvalidRequestBody(f"the body is not valid JSON: {detail}".strip(), code="invalid_json"))
    if not isinstance(body, dict) and tuple(first.get("loc", ()))[:1] == ("body",):
        if body is None:
            return _respond(InvalidRequestBody("the body is missing: send a JSON object", code="missing"))
        return _respond(InvalidRequestBody(f"the body must be a JSON object, got {_json_kind(body)}",
                                           code="invalid_json"))
    located = [(_where(e, body), e) for e in errors]
    # the first bad field; of a union's branches, the one that got deepest into the value sent
    # (``content: [{"text": "a"}]`` is about ``messages.0.content.0.type``, not "not a string")
    head = located[0][0]
    param, chosen = max((w for w in located if w[0] == head or w[0].startswith(head + ".")),
                        key=lambda w: len(w[0].split(".")))
    by_param: dict[str, list[str]] = {param: []}
    for where, e in located:
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if msg not in by_param.setdefault(where, []):
            by_param[where].append(msg)
    parts = [f"{where or 'body'}: {_alternatives(msgs)}" for where, msgs in list(by_param.items())[:5]]
    return _respond(InvalidRequestBody("; ".join(parts), param=param or None,
                                       code=validation_code(str(chosen.get("type", "")))))


def _alternatives(msgs: list[str]) -> str:
    """A union's errors as one phrase: ``Input should be a valid string or a valid list``."""
    rest = [m.removeprefix("Input should be ") for m in msgs[1:]]
    return " or ".join([msgs[0], *rest])


def _json_kind(value: object) -> str:
    return {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array"}.get(type(value), type(value).__name__)


def _where(error: dict, body: object) -> str:
    """A validation error's field path in the request body (``messages.0.content``).

    The path follows the error's ``loc`` through the body; the labels pydantic adds for the
    branches of a union (``prompt.str``, ``content.list[ContentPart]``) are not in the body and are
    left out, and a missing field's name ends the path. A key's control characters are written escaped
    (the message stays one line).
    """
    loc = list(error.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    path: list[str] = []
    cur = body
    for i, part in enumerate(loc):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            cur = cur[part]
        elif i + 1 < len(loc):
            continue  # a union branch's label
        elif error.get("type") in ("missing", "extra_forbidden"):
            pass  # the missing field itself
        else:
            break
        path.append("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(part)))  # a key "\n" as \n
    return ".".join(path)


async def _http_error(req: Request, err: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (no route, wrong method) in OpenAI's error shape, status kept."""
    api = NotFound(f"no route {req.method} {req.url.path}") if err.status_code == 404 else \
        APIError(str(err.detail), code="method_not_allowed" if err.status_code == 405 else "http_error")
    api.status = err.status_code
    return _respond(api)


def add_exception_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` as an OpenAI error object."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(StarletteHTTPException, _http_error)
