"""Errors a client sees, as OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}``.

The status comes from the exception's *type*, never from its message text. A user mistake is a
4xx with a message naming the field; an unexpected failure is a 500 whose message says so (the
traceback goes to the server log only).
"""

from __future__ import annotations

from tokenfuse.errors import ConfigError, ModelLoadError, TokenfuseError


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
        return BadRequest(str(err).replace("(top level): ", ""), param="tokenfuse", code="invalid_ensemble_options")
    if isinstance(err, MemberUnavailableError):
        return MemberUnavailable(str(err))
    if isinstance(err, ModelLoadError):
        return InternalError(str(err), code="model_load_error")
    if isinstance(err, TokenfuseError):
        return InternalError(f"{type(err).__name__}: {err}")
    return InternalError(f"internal error ({type(err).__name__}); see the server log")
