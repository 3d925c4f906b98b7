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
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenfuse.errors import ConfigError, ModelLoadError, TokenfuseError
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


class BadRequest(APIError):
    """A well-formed request this server cannot serve (an unsupported value, bad options)."""


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class InvalidRequestBody(APIError):
    """The body does not match the request schema (FastAPI's validation errors, re-shaped)."""

    status = 422


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
    from tokenfuse.members.remote import MemberUnavailableError

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


async def _invalid_body(_req: Request, err: RequestValidationError) -> JSONResponse:
    """FastAPI's validation errors: 400 ``invalid_json`` for a body that is not JSON, else 422
    naming the first bad field (``param``) and up to five in the message."""
    errors = err.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return _respond(BadRequest(f"the body is not valid JSON: {detail}".strip(), code="invalid_json"))
    msgs = [f"{_where(e) or 'body'}: {e.get('msg', 'invalid')}" for e in errors[:5]]
    return _respond(InvalidRequestBody("; ".join(msgs), param=_where(first) or None, code="invalid_value"))


def _where(error: dict) -> str:
    """A validation error's field path (``tokenfuse.colour``), without FastAPI's ``body`` prefix."""
    return ".".join(str(p) for p in error.get("loc", ()) if p != "body")


async def _http_error(req: Request, err: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (no route, wrong method) in OpenAI's error shape, status kept."""
    api = NotFound(f"no route {req.method} {req.url.path}") if err.status_code == 404 else APIError(str(err.detail))
    api.status = err.status_code
    return _respond(api)


def add_exception_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` as an OpenAI error object."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(StarletteHTTPException, _http_error)
