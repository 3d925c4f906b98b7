"""The README's promise on the real bundled models: concurrent greedy requests get the answers they
would get alone (issue 18, item 1).

The default three-member ensemble (llama.cpp, GaC, prefix cache on) is served on a loopback port
by uvicorn in a thread (``test_playground.serving``), so disconnects are real TCP closes. Eight
requests run at once — completions and chat, short and long prompts (three sharing a long prefix,
which the prefix cache reuses), streamed and not, one with a stop string, two closed by the client
after a few chunks — then the same requests run one by one. Every answer is byte-identical to its
one-by-one answer; a closed stream's text is a prefix of it.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("fastapi", reason="the server extra is not installed (pip install -e '.[server]')")

import httpx  # noqa: E402

from test_playground import serving  # noqa: E402  (uvicorn on a loopback port, in a thread)
from tokenfuse import Ensemble  # noqa: E402
from tokenfuse.server import create_app  # noqa: E402

pytestmark = pytest.mark.real

COUNT = "Count from 1 to 40, separated by commas: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12"
LONG = ("The river rose slowly through the night, and by morning the low fields west of the village "
        "were under water. The miller, who had seen three floods in his life, moved the sacks of flour "
        "to the loft and waited. Summarise what the miller did:")
# (endpoint, body, close the stream after this many content chunks)
REQUESTS = [
    ("completions", {"prompt": COUNT + ",", "max_tokens": 16}, None),
    ("completions", {"prompt": COUNT + ", 13,", "max_tokens": 12, "stream": True}, None),
    ("completions", {"prompt": COUNT + ", 13, 14", "max_tokens": 24, "stream": True}, 3),
    ("completions", {"prompt": "Question: What is the capital of France?\nAnswer:", "max_tokens": 20,
                     "stop": ["\n"]}, None),
    ("completions", {"prompt": LONG, "max_tokens": 10}, None),
    ("chat/completions", {"messages": [{"role": "user", "content": "Say hello in Japanese."}], "max_tokens": 14,
                          "stream": True}, None),
    ("chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Name three colours."}], "max_tokens": 24,
                          "stream": True}, 2),
    ("chat/completions", {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 8}, None),
]


async def send(client: httpx.AsyncClient, endpoint: str, body: dict, close_after: int | None) -> str:
    """One request's text (a stream's concatenated deltas; a closed stream's text so far)."""
    chat = endpoint.startswith("chat")
    body = {**body, "temperature": 0}
    if not body.get("stream"):
        r = await client.post(f"/v1/{endpoint}", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    text, chunks = [], 0
    async with client.stream("POST", f"/v1/{endpoint}", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            piece = chunk["choices"][0]["delta"].get("content") if chat else chunk["choices"][0]["text"]
            if piece:
                text.append(piece)
                chunks += 1
                if chunks == close_after:
                    break  # leaving the block closes the connection mid-stream
    return "".join(text)


async def run(url: str, *, concurrent: bool, cancel: bool) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        calls = [send(client, e, b, c if cancel else None) for e, b, c in REQUESTS]
        if concurrent:
            return list(await asyncio.gather(*calls))
        return [await c for c in calls]


def test_concurrent_mixed_requests_equal_one_by_one(llamacpp_members):
    ens = Ensemble([llamacpp_members[k] for k in ("smollm2", "gemma3", "qwen")])
    app = create_app(ens)
    sched = app.state.scheduler
    with serving(app) as url:
        together = asyncio.run(run(url, concurrent=True, cancel=True))
        steps_together = sched.steps
        alone = asyncio.run(run(url, concurrent=False, cancel=False))
        deadline = time.time() + 10
        while sched.active and time.time() < deadline:
            time.sleep(0.05)
        assert sched.active == 0  # the cancelled sequences were closed too
    for (endpoint, body, close_after), got, want in zip(REQUESTS, together, alone):
        assert want, (endpoint, body)
        if close_after is None:
            assert got == want, (endpoint, body)
        else:
            assert got and want.startswith(got) and got != want, (endpoint, body, got, want)
    assert steps_together < sum(b["max_tokens"] for _, b, _ in REQUESTS) // 2  # the requests did share steps
