"""``POST /v1/completions`` and ``POST /v1/chat/completions``: each route reads its prompt form
(text prompts or chat messages); ``serving.respond`` does the rest."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tokenfuse.server.errors import ErrorResponse
from tokenfuse.server.jobs import chat_messages, text_prompts
from tokenfuse.server.schemas import ChatCompletionRequest, CompletionRequest
from tokenfuse.server.serving import respond
from tokenfuse.server.state import StateDep, require_api_key

# Every refusal is a 4xx with OpenAI's error body (validation errors too: 400, not FastAPI's 422).
router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)],
                   responses={"4XX": {"model": ErrorResponse, "description": "OpenAI error object"}})


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request, state: StateDep) -> Response:
    prompts = text_prompts(body.prompt, state.settings)
    return await respond(request, state, body, prompts, chat=False, echo=prompts if body.echo else None)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep) -> Response:
    messages = chat_messages(body, state.settings)
    return await respond(request, state, body, [messages], chat=True)
