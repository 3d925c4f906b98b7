"""An OpenAI-compatible HTTP server for an ensemble (extra: ``pip install "tokenfuse[server]"``).

``create_app(ensemble, settings=ServerSettings(...))`` builds the FastAPI app (tests run it
in-process); ``serve(...)`` runs it with uvicorn. Generation is batched at the step level by one
scheduler thread (``scheduler.py``); the routes are module-level routers (``routes/``) that reach
the app's ``ServerState`` (``state.py``) through FastAPI dependencies; see docs/serving.md.
"""

from __future__ import annotations

from tokenfuse.server.app import create_app
from tokenfuse.server.state import ServerSettings

__all__ = ["ServerSettings", "create_app", "serve"]


def serve(ensemble, *, config=None, settings: ServerSettings = ServerSettings(), host: str = "127.0.0.1",
          port: int = 8000, log_level: str = "info") -> None:
    """Serve ``ensemble`` over HTTP until interrupted (binds 127.0.0.1 unless told otherwise)."""
    import uvicorn

    app = create_app(ensemble, config=config, settings=settings)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
