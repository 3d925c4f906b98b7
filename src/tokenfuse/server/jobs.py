"""A request turned into scheduler jobs: its prompts and model checked against the server's limits,
its sampling fields filled from the config's ``decoding`` defaults, one ``Job`` per choice of each
prompt. Every refusal is a 4xx naming the field."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenfuse.engine import Sampling
from tokenfuse.server.errors import BadRequest
from tokenfuse.server.scheduler import Job, Update

if TYPE_CHECKING:
    from tokenfuse.config import DecodingConfig
    from tokenfuse.server.schemas import ChatCompletionRequest, CompletionRequest
    from tokenfuse.server.state import ServerSettings


def text_prompts(prompt: Any, settings: ServerSettings) -> list[str]:
    """A completion request's prompts (a string or a list of strings), each within the length limit."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif not prompt:
        raise BadRequest("prompt: at least one prompt is needed", param="prompt")
    else:
        raise BadRequest("prompt: token-id prompts are not supported (the members have different tokenizers); "
                         "send text", param="prompt", code="unsupported_parameter")
    for p in prompts:
        check_prompt_chars(len(p), settings)
    return prompts


def chat_messages(body: ChatCompletionRequest, settings: ServerSettings) -> list[dict]:
    """A chat request's messages as ``{"role", "content"}`` (text parts joined), within the length limit."""
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    except ValueError as err:
        raise BadRequest(str(err), param="messages") from None
    check_prompt_chars(sum(len(m["content"]) for m in messages), settings)
    return messages


def check_prompt_chars(n: int, settings: ServerSettings) -> None:
    if n > settings.max_prompt_chars:
        raise BadRequest(f"prompt of {n} characters is longer than this server's limit of "
                         f"{settings.max_prompt_chars}", param="prompt", code="prompt_too_long")


def check_request(body: CompletionRequest | ChatCompletionRequest, settings: ServerSettings) -> None:
    """404 for another ``model`` than the served one; 400 for a field this server cannot honour."""
    settings.check_model(body.model)
    for name, why in body.unsupported():
        raise BadRequest(f"{name}: {why}", param=name, code="unsupported_parameter")


def make_jobs(body: CompletionRequest | ChatCompletionRequest, prompts: list, *, chat: bool,
              post: Callable[[Update], None], settings: ServerSettings, decoding: DecodingConfig) -> list[Job]:
    """``body.n`` jobs per prompt, indexed prompt-major (choice ``i * n + j``); their updates go to ``post``."""
    max_tokens = _max_tokens(body, len(prompts), settings, decoding)
    samplings = _samplings(body, decoding)
    stop = body.stop if body.stop else list(decoding.stop)
    options = body.tokenfuse.as_options() if body.tokenfuse else None
    return [Job(prompt=p, chat=chat, sampling=sampling, stop=stop, max_new_tokens=max_tokens,
                index=i * body.n + j, options=options, post=post, truncate=settings.truncate_prompt)
            for i, p in enumerate(prompts) for j, sampling in enumerate(samplings)]


def _max_tokens(body, n_prompts: int, settings: ServerSettings, decoding: DecodingConfig) -> int:
    """The request's ``max_tokens`` (default: the config's), after the server's token and ``n`` limits."""
    requested = body.requested_max_tokens()
    max_tokens = requested if requested is not None else decoding.max_new_tokens
    if max_tokens > settings.max_tokens:
        raise BadRequest(f"max_tokens: {max_tokens} is more than this server's limit of {settings.max_tokens}",
                         param="max_tokens", code="max_tokens_too_large")
    if body.n * n_prompts > settings.max_n:
        raise BadRequest(f"n: {body.n} choices for {n_prompts} prompt(s) is more than this server's limit of "
                         f"{settings.max_n} sequences per request", param="n")
    return max_tokens


def _samplings(body, decoding: DecodingConfig) -> list[Sampling]:
    """The sampling of each of the ``n`` choices: fields left out take the config's; choice ``j``
    uses ``seed + j``, and unseeded sampling draws a fresh seed (requests differ, as clients expect)."""
    temperature = body.temperature if body.temperature is not None else decoding.temperature
    top_p = body.top_p if body.top_p is not None else decoding.top_p
    top_k = body.top_k if body.top_k is not None else decoding.top_k
    seed = body.seed if body.seed is not None else decoding.seed
    if temperature > 0 and seed is None:
        seed = random.randrange(2**62)
    return [Sampling(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=None if seed is None else seed + j)
            for j in range(body.n)]
