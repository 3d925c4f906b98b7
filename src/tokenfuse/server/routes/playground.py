"""The web playground: ``GET /`` (the page) and ``/playground/*`` (its script and style sheet).

Plain files shipped inside the package (``tokenfuse/server/static/``: no CDN, no build step). The
page itself needs no API key; it asks for one and sends it as ``Authorization: Bearer`` to the
``/v1`` endpoints it calls (``/v1/models`` for the members, the completion endpoints streamed with
``"tokenfuse": {"trace": true}``). The only thing filled in per request is the list of combining
methods, from the combiner registry. See docs/serving.md, "Playground".
"""

from __future__ import annotations

import html
from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

from tokenfuse.combiners import REGISTRY

STATIC = Path(__file__).resolve().parent.parent / "static"
METHODS_MARK = "<!-- methods -->"

router = APIRouter()


@router.get("/", include_in_schema=False)
async def page() -> HTMLResponse:
    return HTMLResponse(index_html(), headers={"Cache-Control": "no-cache"})


@cache
def index_html() -> str:
    """The page with one ``<option>`` per registered combining method."""
    options = "".join(f'<option value="{html.escape(m)}">{html.escape(m)}</option>' for m in sorted(REGISTRY))
    return (STATIC / "index.html").read_text(encoding="utf-8").replace(METHODS_MARK, options)


def static_files() -> StaticFiles:
    """The page's script and style sheet (``create_app`` mounts them at ``/playground``)."""
    return StaticFiles(directory=STATIC)
