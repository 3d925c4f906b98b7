"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one served model, its members and method."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from tokenfuse.server.state import ServerState, StateDep, require_api_key

router = APIRouter(prefix="/v1/models", dependencies=[Depends(require_api_key)])


@router.get("")
async def list_models(state: StateDep):
    return {"object": "list", "data": [model_card(state)]}


@router.get("/{model_id}")
async def get_model(model_id: str, state: StateDep):
    state.settings.check_model(model_id)
    return model_card(state)


def model_card(state: ServerState) -> dict:
    """OpenAI's model object, with what the ensemble is (``Ensemble.describe``) under ``"tokenfuse"``."""
    return {"id": state.settings.model_name, "object": "model", "created": state.created, "owned_by": "tokenfuse",
            "tokenfuse": state.ensemble.describe()}
