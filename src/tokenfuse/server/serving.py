"""A request's life on the scheduler: its jobs submitted, every sequence admitted (so a prompt that
does not fit is a proper 400 even for a stream), then its updates collected into one response or
streamed as Server-Sent Events ending with ``data: [DONE]``. Its jobs are cancelled when the
response ends, fails, or the client goes away."""

from __future__ import annotations

import asyncio
import json
import queue
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from tokenfuse.server import responses
from tokenfuse.server.errors import ServerBusy, client_error
from tokenfuse.server.jobs import check_request, make_jobs
from tokenfuse.server.logprobs import Asked
from tokenfuse.server.scheduler import Job, Update, make_poster
from tokenfuse.server.schemas import ChatCompletionRequest, CompletionRequest
from tokenfuse.server.state import ServerState


async def respond(request: Request, state: ServerState, body: CompletionRequest | ChatCompletionRequest,
                  prompts: list, *, chat: bool, echo: list[str] | None = None) -> Response:
    """Generate ``body.n`` choices for each prompt; a JSON response, or an SSE stream if ``body.stream``."""
    check_request(body, state.settings)
    q: asyncio.Queue[Update] = asyncio.Queue()
    jobs = make_jobs(body, prompts, chat=chat, post=make_poster(asyncio.get_running_loop(), q),
                     settings=state.settings, decoding=state.config.decoding)
    asked = Asked.of(body, chat=chat)
    for j in jobs:  # what the sequences record beyond their text
        j.trace, j.score_prompt = asked.trace_options(), asked.score_prompt
    try:
        state.scheduler.submit(jobs)
    except queue.Full:
        raise ServerBusy("too many requests are waiting; retry later") from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    updates = Updates(request, q)
    streaming = False
    try:
        await updates.admitted(len(jobs), chat=chat)
        if body.stream:
            chunks = responses.Chunks(rid, chat=chat, model=state.settings.model_name, created=int(time.time()),
                                      include_usage=bool(body.stream_options and body.stream_options.include_usage),
                                      asked=asked)
            streaming = True
            return EventSourceResponse(_stream(state, jobs, updates, chunks, echo=echo), sep="\n", ping=15)
        texts, finish, infos, steps = await _collect(jobs, updates, chat=chat)
        return JSONResponse(responses.completion(rid, jobs, texts, finish, infos, chat=chat,
                                                 model=state.settings.model_name, echo=echo, steps=steps, asked=asked))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the sequences are cancelled below
    finally:
        if not streaming:  # a stream cancels its own jobs when it ends
            state.scheduler.cancel([j for j in jobs if not j.done])


class ClientGone(Exception):
    """The client disconnected while its request was being served."""


class Updates:
    """The updates of one request's jobs in arrival order, those that came while waiting for
    admission first."""

    def __init__(self, request: Request, q: asyncio.Queue[Update]) -> None:
        self.request = request
        self.q = q
        self.early: deque[Update] = deque()

    async def admitted(self, n: int, *, chat: bool) -> None:
        """Wait until all ``n`` sequences are admitted; raise the API error of one that is not."""
        opened = 0
        while opened < n:
            u = await _next(self.request, self.q)
            if u.error is not None:
                raise client_error(u.error, chat=chat)
            if u.opened:
                opened += 1
            else:
                self.early.append(u)

    async def next(self, *, watch: bool = True) -> Update:
        """The next update; with ``watch``, raise ``ClientGone`` once the client has disconnected."""
        if self.early:
            return self.early.popleft()
        return await _next(self.request, self.q) if watch else await self.q.get()


async def _collect(jobs: list[Job], updates: Updates, *, chat: bool) -> tuple[dict, dict, dict, dict]:
    """Every job's whole text, finish reason, info and steps (traced jobs) (index -> value), once
    all have finished."""
    texts = {j.index: "" for j in jobs}
    steps: dict[int, list] = {j.index: [] for j in jobs}
    finish: dict[int, str] = {}
    infos: dict[int, dict] = {}
    while len(finish) < len(jobs):
        u = await updates.next()
        if u.error is not None:
            raise client_error(u.error, chat=chat)
        texts[u.index] += u.text
        steps[u.index] += u.steps or []
        if u.finish_reason:
            finish[u.index], infos[u.index] = u.finish_reason, u.info
    return texts, finish, infos, steps


async def _stream(state: ServerState, jobs: list[Job], updates: Updates, chunks: responses.Chunks, *,
                  echo: list[str] | None) -> AsyncIterator[str]:
    """The SSE data of a stream: the role (chat) or echoed prompt of each choice, its text as it
    comes, its finish reason, the usage chunk if asked, ``[DONE]``. A failure mid-stream is sent as
    an error object and the stream ends without usage."""
    finish: dict[int, str] = {}
    infos: dict[int, dict] = {}
    try:
        for j in jobs:
            if chunks.chat:
                yield chunks.choice(j.index, role=True)
            elif echo:
                yield chunks.echo(j, responses.echoed(echo, jobs, j.index))
        failed = False
        while len(finish) < len(jobs):
            u = await updates.next(watch=False)  # sse-starlette watches for a disconnect and cancels this
            if u.error is not None:
                yield json.dumps(client_error(u.error, chat=chunks.chat).body())
                failed = True
                break
            if u.text or u.steps:
                yield chunks.choice(u.index, u.text, steps=u.steps)
            if u.finish_reason:
                finish[u.index], infos[u.index] = u.finish_reason, u.info
                yield chunks.choice(u.index, None, u.finish_reason)
        if chunks.include_usage and not failed:
            yield chunks.final(jobs, infos)
        yield "[DONE]"
    finally:
        state.scheduler.cancel([j for j in jobs if not j.done])


async def _next(request: Request, q: asyncio.Queue[Update], *, every: float = 0.1) -> Update:
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
