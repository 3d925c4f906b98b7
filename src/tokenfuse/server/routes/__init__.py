"""The HTTP routes, one ``APIRouter`` per concern: ``health`` (no key), ``models`` and
``completions`` (``/v1``, behind the API key). ``ROUTERS`` is what ``create_app`` includes."""

from __future__ import annotations

from tokenfuse.server.routes import completions, health, models

ROUTERS = (health.router, models.router, completions.router)
