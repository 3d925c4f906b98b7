"""The OpenAI-compatible HTTP API: ``create_app(ensemble, settings)`` (tests run it in-process).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health``. Streaming answers are Server-Sent Events in OpenAI's chunk format ending with
``data: [DONE]``. Generation runs on the scheduler thread (``scheduler.py``); this module only
validates, hands jobs over and turns their updates into responses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import random
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenfuse.config import EnsembleConfig
from tokenfuse.engine.generate import Ensemble
from tokenfuse.engine.sampling import Sampling
from tokenfuse.server.errors import (
    APIError,
    BadRequest,
    ContextLengthExceeded,
    InvalidRequestBody,
    ModelNotFound,
    NotFound,
    RequestTooLarge,
    ServerBusy,
    Unauthorized,
    from_exception,
)
from tokenfuse.server.scheduler import ContextError, EnsemblePool, Job, Scheduler, Update, make_poster
from tokenfuse.server.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("tokenfuse.server")


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


def create_app(ensemble: Ensemble, *, config: EnsembleConfig | None = None,
               settings: ServerSettings = ServerSettings()) -> FastAPI:
    """The FastAPI app serving ``ensemble`` (its members are shared by every request).

    ``config`` is the ensemble's config (default: derived from the ensemble); per-request
    ``"tokenfuse"`` options are applied on top of it.
    """
    pool = EnsemblePool(ensemble, config)
    decoding = pool.cfg.decoding
    scheduler = Scheduler(pool, max_batch=settings.max_batch, max_queue=settings.max_queue,
                          on_member_failure=settings.on_member_failure or pool.cfg.on_member_failure)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="tokenfuse", version="1", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.settings = settings
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)

    # ---------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(_req, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, err: RequestValidationError):
        errors = err.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            e: APIError = BadRequest(f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
                                     code="invalid_json")
        else:
            msgs = []
            for e_ in errors[:5]:
                where = ".".join(str(p) for p in e_.get("loc", ()) if p != "body") or "body"
                msgs.append(f"{where}: {e_.get('msg', 'invalid')}")
            e = InvalidRequestBody("; ".join(msgs), param=".".join(loc) or None, code="invalid_value")
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, err: StarletteHTTPException):
        e = NotFound(f"no route {_req.method} {_req.url.path}") if err.status_code == 404 else \
            APIError(str(err.detail))
        e.status = err.status_code
        return JSONResponse(e.body(), status_code=err.status_code)

    # ---------------------------------------------------------------- auth
    async def auth(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise Unauthorized("missing or incorrect API key (send `Authorization: Bearer <key>`)")

    # ---------------------------------------------------------------- routes
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": settings.model_name, "running": scheduler.active,
                "members": [m.name for m in ensemble.members]}

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models():
        return {"object": "list", "data": [_model_card(settings.model_name, created, ensemble, pool.cfg)]}

    @app.get("/v1/models/{model_id}", dependencies=[Depends(auth)])
    async def model(model_id: str):
        _check_model(model_id, settings)
        return _model_card(settings.model_name, created, ensemble, pool.cfg)

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(body: CompletionRequest, request: Request):
        prompts = _prompts(body.prompt)
        for p in prompts:
            _check_prompt_chars(len(p), settings)
        jobs_of = lambda post: _jobs(body, prompts, chat=False, post=post, settings=settings,  # noqa: E731
                                     default_max=decoding.max_new_tokens, decoding=decoding)
        echo = prompts if body.echo else None
        return await _serve(request, body, jobs_of, chat=False, echo=echo)

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as err:
            raise BadRequest(str(err), param="messages") from None
        _check_prompt_chars(sum(len(m["content"]) for m in messages), settings)
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        jobs_of = lambda post: _jobs(body, [messages], chat=True, post=post, settings=settings,  # noqa: E731
                                     default_max=decoding.max_new_tokens, decoding=decoding)
        return await _serve(request, body, jobs_of, chat=True)

    async def _serve(request: Request, body, jobs_of, *, chat: bool, echo: list[str] | None = None):
        _check_model(body.model, settings)
        for name, why in body.unsupported():
            raise BadRequest(f"{name}: {why}", param=name, code="unsupported_parameter")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Update] = asyncio.Queue()
        jobs = jobs_of(make_poster(loop, q))
        try:
            scheduler.submit(jobs)
        except queue.Full:
            raise ServerBusy("too many requests are waiting; retry later") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        early: list[Update] = []  # updates that arrived before every sequence was admitted
        streaming = False
        try:
            # Wait until every sequence is admitted, so a prompt that does not fit is a proper 400
            # even for a streaming request.
            opened = 0
            while opened < len(jobs):
                u = await _next(request, q)
                if u.error is not None:
                    raise _client_error(u.error, chat=chat)
                if u.opened:
                    opened += 1
                else:
                    early.append(u)
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                streaming = True
                return EventSourceResponse(
                    _stream(rid, jobs, early, q, chat=chat, echo=echo, include_usage=include_usage,
                            created=int(time.time())), sep="\n", ping=15)
            return JSONResponse(await _complete(request, rid, jobs, early, q, chat=chat, echo=echo))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the sequences are cancelled below
        finally:
            if not streaming:  # a stream cancels its own jobs when it ends
                scheduler.cancel([j for j in jobs if not j.done])

    async def _complete(request: Request, rid: str, jobs: list[Job], early: list[Update], q: asyncio.Queue, *,
                        chat: bool, echo: list[str] | None) -> dict:
        texts = {j.index: "" for j in jobs}
        finish: dict[int, str] = {}
        infos: dict[int, dict] = {}
        while len(finish) < len(jobs):
            u = early.pop(0) if early else await _next(request, q)
            if u.error is not None:
                raise _client_error(u.error, chat=chat)
            texts[u.index] += u.text
            if u.finish_reason:
                finish[u.index], infos[u.index] = u.finish_reason, u.info
        n = len(jobs) // (len(echo) if echo else 1)
        choices = []
        for j in jobs:
            text = texts[j.index]
            if echo:
                text = echo[j.index // n] + text
            if chat:
                choices.append({"index": j.index, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": finish[j.index]})
            else:
                choices.append({"index": j.index, "text": text, "logprobs": None, "finish_reason": finish[j.index]})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": settings.model_name, "choices": choices, "usage": _usage(jobs, infos),
                "tokenfuse": _summary(infos)}

    async def _stream(rid: str, jobs: list[Job], early: list[Update], q: asyncio.Queue, *, chat: bool,
                      echo: list[str] | None, include_usage: bool, created: int):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict], **extra) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": settings.model_name, "choices": choices}
            if include_usage:
                body["usage"] = None
            body.update(extra)
            return json.dumps(body, ensure_ascii=False)

        def choice(index: int, text: str | None, finish_reason: str | None, *, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

        finish: dict[int, str] = {}
        infos: dict[int, dict] = {}
        try:
            if chat:
                for j in jobs:
                    yield chunk([choice(j.index, None, None, role=True)])
            elif echo:
                n = len(jobs) // len(echo)
                for j in jobs:
                    yield chunk([choice(j.index, echo[j.index // n], None)])
            failed = False
            while len(finish) < len(jobs):
                # (sse-starlette watches for a disconnect and cancels this generator)
                u: Update = early.pop(0) if early else await q.get()
                if u.error is not None:
                    yield json.dumps(_client_error(u.error, chat=chat).body())
                    failed = True
                    break
                if u.text:
                    yield chunk([choice(u.index, u.text, None)])
                if u.finish_reason:
                    finish[u.index], infos[u.index] = u.finish_reason, u.info
                    yield chunk([choice(u.index, None, u.finish_reason)])
            if include_usage and not failed:
                yield chunk([], usage=_usage(jobs, infos), tokenfuse=_summary(infos))
            yield "[DONE]"
        finally:
            scheduler.cancel([j for j in jobs if not j.done])

    return app


# ---------------------------------------------------------------------------- helpers

class ClientGone(Exception):
    """The client disconnected while its request was being served."""


async def _next(request: Request, q: asyncio.Queue, *, every: float = 0.1) -> Update:
    """The next update for a request; raises ``ClientGone`` once the client has disconnected
    (checked at most every ``every`` seconds, whether or not updates keep coming)."""
    last = getattr(request.state, "checked", 0.0)
    getter = asyncio.ensure_future(q.get())
    try:
        while True:
            wait = max(0.0, last + every - time.monotonic())
            done, _ = await asyncio.wait({getter}, timeout=wait) if wait > 0 else (set(), None)
            if done:
                return getter.result()
            last = request.state.checked = time.monotonic()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        getter.cancel()


def _client_error(err: BaseException, *, chat: bool = False) -> APIError:
    if isinstance(err, ContextError):
        return ContextLengthExceeded(str(err), param="messages" if chat else "prompt")
    api = from_exception(err)
    if api.status >= 500:
        log.error("request failed: %s: %s", type(err).__name__, err)
    return api


def _check_model(model: str | None, settings: ServerSettings) -> None:
    if model is not None and model != settings.model_name:
        raise ModelNotFound(f"model {model!r} is not served here; this server serves {settings.model_name!r}",
                            param="model")


def _check_prompt_chars(n: int, settings: ServerSettings) -> None:
    if n > settings.max_prompt_chars:
        raise BadRequest(f"prompt of {n} characters is longer than this server's limit of "
                         f"{settings.max_prompt_chars}", param="prompt", code="prompt_too_long")


def _prompts(prompt: Any) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if not prompt:
        raise BadRequest("prompt: at least one prompt is needed", param="prompt")
    raise BadRequest("prompt: token-id prompts are not supported (the members have different tokenizers); "
                     "send text", param="prompt", code="unsupported_parameter")


def _jobs(body, prompts: list, *, chat: bool, post, settings: ServerSettings, default_max: int,
          decoding) -> list[Job]:
    max_tokens = body.max_tokens if body.max_tokens is not None else default_max
    if max_tokens > settings.max_tokens:
        raise BadRequest(f"max_tokens: {max_tokens} is more than this server's limit of {settings.max_tokens}",
                         param="max_tokens", code="max_tokens_too_large")
    if body.n * len(prompts) > settings.max_n:
        raise BadRequest(f"n: {body.n} choices for {len(prompts)} prompt(s) is more than this server's limit of "
                         f"{settings.max_n} sequences per request", param="n")
    temperature = body.temperature if body.temperature is not None else decoding.temperature
    top_p = body.top_p if body.top_p is not None else decoding.top_p
    top_k = body.top_k if body.top_k is not None else decoding.top_k
    seed = body.seed if body.seed is not None else decoding.seed
    if temperature > 0 and seed is None:
        seed = random.randrange(2**62)  # unseeded sampling differs between requests, as clients expect
    stop = body.stop if body.stop else list(decoding.stop)
    options = body.tokenfuse.as_options() if body.tokenfuse else None
    jobs = []
    for i, p in enumerate(prompts):
        for j in range(body.n):
            sampling = Sampling(temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                                seed=None if seed is None else seed + j)
            jobs.append(Job(prompt=p, chat=chat, sampling=sampling, stop=stop, max_new_tokens=max_tokens,
                            index=i * body.n + j, options=options, post=post, truncate=settings.truncate_prompt))
    return jobs


def _usage(jobs: list[Job], infos: dict[int, dict]) -> dict:
    """Token counts: prompt tokens in the primary member's tokenizer (once per prompt), completion
    tokens = chosen pieces (one piece is one token of some member)."""
    seen, prompt = set(), 0
    for j in jobs:
        info = infos.get(j.index)
        if info and id(j.prompt) not in seen:
            seen.add(id(j.prompt))
            prompt += info["prompt_tokens"][info["primary"]]
    completion = sum(i["completion_tokens"] for i in infos.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _summary(infos: dict[int, dict]) -> dict:
    """The ``"tokenfuse"`` field of a response: what the ensemble did."""
    if not infos:
        return {}
    first = infos[min(infos)]
    return {
        "prompt_tokens": first["prompt_tokens"],
        "ensembled_steps": sum(i["ensembled_steps"] for i in infos.values()),
        "skipped_steps": sum(i["skipped_steps"] for i in infos.values()),
        "unavailable_members": sorted({m for i in infos.values() for m in i["unavailable_members"]}),
        "truncated": any(i["truncated"] for i in infos.values()),
    }


def _model_card(name: str, created: int, ens: Ensemble, cfg: EnsembleConfig) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "tokenfuse",
            "tokenfuse": {"members": [{"name": m.name, "weight": m.weight} for m in ens.members],
                          "method": cfg.method, "params": cfg.params, "gate": cfg.gate, "threshold": cfg.threshold}}
