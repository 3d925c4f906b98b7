"""OpenAI's response bodies: a whole (chat) completion, the chunks of a streamed one, and the
``usage`` and ``"tokenfuse"`` (what the ensemble did) fields both carry."""

from __future__ import annotations

import json
import time

from tokenfuse.server.scheduler import Job


def echoed(echo: list[str] | None, jobs: list[Job], index: int) -> str:
    """The prompt choice ``index`` repeats when the request asked for ``echo`` (else ``""``)."""
    if not echo:
        return ""
    return echo[index // (len(jobs) // len(echo))]


def completion(rid: str, jobs: list[Job], texts: dict[int, str], finish: dict[int, str], infos: dict[int, dict],
               *, chat: bool, model: str, echo: list[str] | None) -> dict:
    """A ``text_completion`` or ``chat.completion`` of finished jobs (text, finish reason, info per index)."""
    choices = []
    for j in jobs:
        text = echoed(echo, jobs, j.index) + texts[j.index]
        if chat:
            choices.append({"index": j.index, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": finish[j.index]})
        else:
            choices.append({"index": j.index, "text": text, "logprobs": None, "finish_reason": finish[j.index]})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(jobs, infos), "tokenfuse": summary(infos)}


class Chunks:
    """The stream chunks of one request (``text_completion`` or ``chat.completion.chunk``), as JSON text.

    With ``include_usage`` every chunk carries ``"usage": null`` and the last one (``final``) the counts.
    """

    def __init__(self, rid: str, *, chat: bool, model: str, created: int, include_usage: bool) -> None:
        self.rid, self.chat, self.model, self.created = rid, chat, model, created
        self.include_usage = include_usage

    def choice(self, index: int, text: str | None = None, finish_reason: str | None = None, *,
               role: bool = False) -> str:
        """A chunk with one choice: new text, a finish reason, or (chat, ``role``) the assistant's role."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            c = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            c = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._chunk([c])

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
