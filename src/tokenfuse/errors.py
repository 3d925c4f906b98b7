"""Typed errors. The CLI turns them into one clear line; the server into an OpenAI error object."""

from __future__ import annotations


class TokenfuseError(Exception):
    """Base class of every error tokenfuse raises on purpose."""


class ConfigError(TokenfuseError):
    """A configuration value is missing or wrong; the message names the field and the fix."""


class ModelNotInstalledError(TokenfuseError):
    """A bundled model's package is not installed; the message gives the exact pip command."""


class ModelLoadError(TokenfuseError):
    """A model or tokenizer could not be loaded from the given source."""


class AlignmentError(TokenfuseError):
    """A member's vocabulary cannot be mapped to exact bytes."""


class SyncError(TokenfuseError):
    """A member's token ids no longer decode to the shared text (an engine bug, never user input)."""


class MemberUnavailableError(TokenfuseError):
    """A member could not answer (its server or actor failed after retries)."""

    def __init__(self, member: str, message: str) -> None:
        super().__init__(f"member {member!r} is unavailable: {message}")
        self.member = member
