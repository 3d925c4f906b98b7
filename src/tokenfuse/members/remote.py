"""Member backend: a model behind an OpenAI-compatible server (``backend: openai``)."""

from __future__ import annotations

from tokenfuse.errors import TokenfuseError


class MemberUnavailableError(TokenfuseError):
    """A member could not answer (its server or actor failed after retries)."""

    def __init__(self, member: str, message: str) -> None:
        super().__init__(f"member {member!r} is unavailable: {message}")
        self.member = member
