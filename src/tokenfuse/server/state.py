"""What every route shares: the server's limits (``ServerSettings``), its live objects
(``ServerState``, kept in ``app.state.server``) and the FastAPI dependencies that hand them out
(``StateDep``, ``require_api_key``)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from tokenfuse.server.errors import ModelNotFound, Unauthorized

if TYPE_CHECKING:
    from tokenfuse.config import EnsembleConfig
    from tokenfuse.engine import Ensemble
    from tokenfuse.server.scheduler import Scheduler


@dataclass(frozen=True)
class ServerSettings:
    """Server limits and identity.

    Attributes:
        model_name: the id clients send as ``model`` (``/v1/models`` lists it).
        api_key: when set, every ``/v1`` request needs ``Authorization: Bearer <api_key>``.
        max_tokens: the largest ``max_tokens`` a request may ask for.
        max_prompt_chars: the longest prompt (characters, all messages together).
        max_body_bytes: the largest request body (413 beyond).
        max_n: the largest ``n`` (choices per prompt) times prompts per request.
        max_batch: sequences stepped together at most; more wait in a queue of ``max_queue``.
        truncate_prompt: drop the start of a prompt that does not fit the smallest member context
            (text: oldest characters; chat: oldest messages after the system message) instead of
            answering 400 ``context_length_exceeded``.
        on_member_failure: ``error`` or ``skip`` (see ``Scheduler``); ``None``: the config's.
    """

    model_name: str = "tokenfuse"
    api_key: str | None = None
    max_tokens: int = 4096
    max_prompt_chars: int = 100_000
    max_body_bytes: int = 1 << 20
    max_n: int = 16
    max_batch: int = 16
    max_queue: int = 256
    truncate_prompt: bool = False
    on_member_failure: str | None = None

    def check_model(self, model: str | None) -> None:
        """404 ``model_not_found`` for a ``model`` other than the served one (``None``: this one)."""
        if model is not None and model != self.model_name:
            raise ModelNotFound(f"model {model!r} is not served here; this server serves {self.model_name!r}",
                                param="model")


@dataclass(frozen=True)
class ServerState:
    """One app's shared objects: the served ensemble and its config (per-request options apply on
    top of it), the limits, the scheduler thread that runs every sequence, and the app's creation
    time (the model card's ``created``)."""

    ensemble: Ensemble
    config: EnsembleConfig
    settings: ServerSettings
    scheduler: Scheduler
    created: int


def server_state(request: Request) -> ServerState:
    """The ``ServerState`` of the app serving ``request``."""
    return request.app.state.server


StateDep = Annotated[ServerState, Depends(server_state)]


async def require_api_key(request: Request, state: StateDep) -> None:
    """Refuse (401) a request without ``Authorization: Bearer <api_key>`` when the server has a key."""
    key = state.settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise Unauthorized("missing or incorrect API key (send `Authorization: Bearer <key>`)")
