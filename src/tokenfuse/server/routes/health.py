"""``GET /health``: liveness, the served model, running sequences and members (no API key needed)."""

from __future__ import annotations

from fastapi import APIRouter

from tokenfuse.server.state import StateDep

router = APIRouter()


@router.get("/health")
async def health(state: StateDep):
    return {"status": "ok", "model": state.settings.model_name, "running": state.scheduler.active,
            "members": [m.name for m in state.ensemble.members]}
