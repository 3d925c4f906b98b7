"""The OpenAI-compatible HTTP API: ``create_app(ensemble, settings)`` (tests run it in-process).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health`` (``routes/``), and the web playground at ``/`` (``routes/playground.py``).
Streaming answers are Server-Sent Events in OpenAI's chunk format ending with ``data: [DONE]``.
Generation runs on the scheduler thread (``scheduler.py``); the HTTP layer only validates
(``jobs.py``), hands jobs over and turns their updates into responses (``serving.py``,
``responses.py``). This module assembles the app: its shared state, error
handlers, body limit, routers and the scheduler's lifetime.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from tokenfuse.config import EnsembleConfig
from tokenfuse.engine import Ensemble
from tokenfuse.server.errors import APIError, RequestTooLarge, add_exception_handlers
from tokenfuse.server.routes import ROUTERS, playground
from tokenfuse.server.ensembles import EnsemblePool, config_of
from tokenfuse.server.scheduler import Scheduler
from tokenfuse.server.state import ServerSettings, ServerState


def create_app(ensemble: Ensemble, *, config: EnsembleConfig | None = None,
               settings: ServerSettings = ServerSettings()) -> FastAPI:
    """The FastAPI app serving ``ensemble`` (its members are shared by every request).

    ``config`` is the ensemble's config (default: derived from the ensemble); per-request
    ``"tokenfuse"`` options are applied on top of it.
    """
    config = config or config_of(ensemble)
    scheduler = Scheduler(EnsemblePool(ensemble, config), max_batch=settings.max_batch, max_queue=settings.max_queue,
                          on_member_failure=settings.on_member_failure or config.on_member_failure)
    app = FastAPI(title="tokenfuse", version="1", lifespan=_lifespan)
    app.state.server = ServerState(ensemble=ensemble, config=config, settings=settings, scheduler=scheduler,
                                   created=int(time.time()))
    app.state.scheduler = scheduler  # its counters (steps, active, closed), for tests and operators
    add_exception_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(playground.router)  # the web playground at / (no key needed for the page itself)
    app.mount("/playground", playground.static_files(), name="playground")
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The scheduler thread runs while the app is served (``submit`` also starts it on demand)."""
    scheduler = app.state.server.scheduler
    scheduler.start()
    yield
    scheduler.stop()


class BodyLimit:
    """ASGI middleware: 413 for a body over ``limit`` bytes (declared length or as it streams in)."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = RequestTooLarge(f"request body larger than {self.limit} bytes")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _send_error(too_large, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise too_large
            return msg

        try:
            await self.app(scope, limited, send)
        except RequestTooLarge as err:
            await _send_error(err, send)


async def _send_error(err: APIError, send) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
