"""OpenAI's response bodies: a whole (chat) completion, the chunks of a streamed one, and the
``usage`` and ``"tokenfuse"`` (what the ensemble did) fields both carry. A request that asked for
``logprobs`` gets them per choice (``logprobs.py``); one that asked for the trace gets
``tokenfuse.trace``: ``[{"index": choice, "steps": [...]}]`` (a streamed chunk: its new steps)."""

from __future__ import annotations

import json
import time

from tokenfuse.server import logprobs as lp
from tokenfuse.server.logprobs import Asked
from tokenfuse.server.scheduler import Job


def echoed(echo: list[str] | None, jobs: list[Job], index: int) -> str:
    """The prompt choice ``index`` repeats when the request asked for ``echo`` (else ``""``)."""
    if not echo:
        return ""
    return echo[index // (len(jobs) // len(echo))]


def echo_text(job: Job, echo: list[str] | None, jobs: list[Job]) -> str:
    """What a choice echoes: the prompt, or with scored pieces the text they spell (the prompt as served)."""
    if job.prompt_logprobs is not None:
        return scored_prompt(job)
    return echoed(echo, jobs, job.index)


def scored_prompt(job: Job) -> str:
    """The text a job's scored prompt pieces spell."""
    return "".join(lp.prompt_texts(job.prompt_logprobs))


def completion(rid: str, jobs: list[Job], texts: dict[int, str], finish: dict[int, str], infos: dict[int, dict],
               *, chat: bool, model: str, echo: list[str] | None, steps: dict[int, list] | None = None,
               asked: Asked = Asked()) -> dict:
    """A ``text_completion`` or ``chat.completion`` of finished jobs (text, finish reason, info and,
    for traced jobs, steps per index)."""
    steps = steps or {}
    choices = []
    for j in jobs:
        head = echo_text(j, echo, jobs)
        text = head + texts[j.index]
        logprobs = None
        if asked.logprobs is not None:
            logprobs = (lp.chat(steps[j.index], asked.logprobs) if chat else
                        lp.legacy(steps[j.index], asked.logprobs, prompt=j.prompt_logprobs))
        if chat:
            choices.append({"index": j.index, "message": {"role": "assistant", "content": text},
                            "logprobs": logprobs, "finish_reason": finish[j.index]})
        else:
            choices.append({"index": j.index, "text": text, "logprobs": logprobs, "finish_reason": finish[j.index]})
    tf = summary(infos)
    if asked.trace_k is not None:
        tf["trace"] = [asked.trace(j.index, steps[j.index]) for j in jobs]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(jobs, infos), "tokenfuse": tf}


class Chunks:
    """The stream chunks of one request (``text_completion`` or ``chat.completion.chunk``), as JSON text.

    With ``include_usage`` every chunk carries ``"usage": null`` and the last one (``final``) the counts.
    """

    def __init__(self, rid: str, *, chat: bool, model: str, created: int, include_usage: bool,
                 asked: Asked = Asked()) -> None:
        self.rid, self.chat, self.model, self.created = rid, chat, model, created
        self.include_usage = include_usage
        self.asked = asked
        self.offsets: dict[int, int] = {}  # per choice: characters sent so far (legacy ``text_offset``)

    def echo(self, job: Job, prompt: str) -> str:
        """A completion choice's echoed prompt (with its pieces' log-probabilities when scored)."""
        text = scored_prompt(job) if job.prompt_logprobs is not None else prompt
        logprobs = None
        if job.prompt_logprobs is not None:
            logprobs = lp.legacy([], self.asked.logprobs or 0, prompt=job.prompt_logprobs)
        self.offsets[job.index] = len(text)
        return self._chunk([{"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": None}])

    def choice(self, index: int, text: str | None = None, finish_reason: str | None = None, *,
               role: bool = False, steps: list | None = None) -> str:
        """A chunk with one choice: new text (and its ``steps``, for a traced job), a finish reason,
        or (chat, ``role``) the assistant's role."""
        logprobs = None
        if steps is not None and self.asked.logprobs is not None:
            n = self.asked.logprobs
            logprobs = lp.chat(steps, n) if self.chat else lp.legacy(steps, n, offset=self.offsets.get(index, 0))
        if text:  # a traced job's text is its steps' texts
            self.offsets[index] = self.offsets.get(index, 0) + len(text)
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            c = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        extra = {}
        if steps is not None and self.asked.trace_k is not None:
            extra["tokenfuse"] = {"trace": [self.asked.trace(index, steps)]}
        return self._chunk([c], **extra)

    def final(self, jobs: list[Job], infos: dict[int, dict]) -> str:
        """The chunk without choices that carries ``usage`` and the ``"tokenfuse"`` summary."""
        return self._chunk([], usage=usage(jobs, infos), tokenfuse=summary(infos))

    def _chunk(self, choices: list[dict], **extra) -> str:
        body = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        body.update(extra)
        return json.dumps(body, ensure_ascii=False)


def usage(jobs: list[Job], infos: dict[int, dict]) -> dict:
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


def summary(infos: dict[int, dict]) -> dict:
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
