#!/usr/bin/env python
"""Soak and fault run against tokenfuse's server, on this machine only (issue 18, items 2 and 4).

Load: starts ``tokenfuse serve`` (the bundled SmolLM2 + Gemma-3 on llama.cpp by default) as a
subprocess and sends a seeded mix of requests from ``--concurrency`` clients: completions and chat,
streamed and not, ``n: 2``, stop strings, streams the client closes after 1-3 chunks, seeded
sampling and bad inputs. Every greedy answer is checked against the same request answered alone
(non-streamed) before the load: a streamed answer must give the same text and the same number of
pieces (nothing lost or duplicated), a closed stream a prefix of it, a seeded sampled answer the
same text every time, a bad input its 4xx and error ``code``. It reports requests/s, p50/p99
latency and the server's RSS (after warm-up, peak, final; growth in %).

Faults (servers in this process, uvicorn in a thread, so the script holds the members). Every HTTP
request goes to 127.0.0.1; the Ray nodes bind this machine's own address (Ray refuses loopback).

* ``resync``: the client closes its stream while the scheduler thread is inside a member's re-sync
  (``tokenfuse.engine.sequence.resync`` held for that moment): the sequence is closed, every
  member's state released, and the next request gets the exact answer.
* ``remote``: a member behind llama-cpp-python's server (``backend: openai``) whose server is killed,
  restarted and stalled (SIGSTOP) mid-stream: the stream ends with a ``member_unavailable`` error
  event, a request meanwhile gets a 503 naming the member, the server stays up, and once the
  member's server is back the next request works; with ``on_member_failure: skip`` the request is
  answered without the member and says so.
* ``ray``: a two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``), one member on
  each node (``STRICT_SPREAD``), placed three times: (1) a member's actor killed (``ray.kill``)
  mid-stream; (2) placed with ``max_restarts: 1``, an actor's process killed (SIGKILL) mid-stream:
  Ray restarts it, the driver sends it its sequences again, the stream goes on to the exact text
  and the next request is answered; (3) the second node removed mid-stream. After (1) and (3):
  a clear error event, the server stays up, the next request gets a 503 ``member_unavailable``
  naming the member (no restarts), and with ``on_member_failure: skip`` it is answered without it.

``--quick`` leaves out (1) (the node's removal kills its actor too) and the remote member's
skip-mode checks.

    .venv/bin/python scripts/load/soak.py --quick                          # about 2 minutes on a busy 2-core machine
    .venv/bin/python scripts/load/soak.py --requests 3000 --concurrency 8 --duration 600 --json soak.json
    .venv/bin/python scripts/load/soak.py --faults none --requests 500     # load only

Exits 1 if any check failed (each failure is printed): a 5xx under load, a lost or duplicated
piece, a concurrent greedy answer unlike the one-by-one answer, a bad input not refused as
expected, RSS growth after warm-up above ``--max-growth``, a fault the server did not survive.
Every loop is bounded by ``--requests`` and ``--duration``, every request by a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
SMOL, GEMMA = "smollm2-135m-instruct", "gemma3-270m"
KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}"}

# Greedy requests (name, endpoint, body): each is answered alone first; under load every answer to
# the same request must be that one.
GREEDY = [
    ("capital", "completions", {"prompt": "Question: What is the capital of France?\nAnswer:", "max_tokens": 12,
                                "stop": ["\n", "Question:"]}),
    ("count", "completions", {"prompt": "Count from 1 to 30: 1, 2, 3, 4,", "max_tokens": 16}),
    ("code", "completions", {"prompt": "def fibonacci(n):", "max_tokens": 16, "stop": ["\n\n"]}),
    ("story", "completions", {"prompt": "Once upon a time, in a small village by the sea,", "max_tokens": 12}),
    ("utf8", "completions", {"prompt": "English: good morning\nJapanese:", "max_tokens": 10}),
    ("hello", "chat/completions", {"messages": [{"role": "user", "content": "Say hello in Japanese."}],
                                   "max_tokens": 12}),
    ("colours", "chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Name three colours."}],
                                     "max_tokens": 16, "stop": ["."]}),
    ("math", "chat/completions", {"messages": [{"role": "user", "content": "What is 12 * 7?"}], "max_tokens": 8}),
]
# Bad inputs (endpoint, body: a dict, or bytes sent as they are, headers) and the answer they must get.
BAD = [
    ("completions", {"prompt": "Hi", "max_tokens": -1}, AUTH, 400, "invalid_value"),
    ("completions", {"prompt": "Hi", "max_tokens": "many"}, AUTH, 400, "invalid_type"),
    ("completions", {"prompt": 5}, AUTH, 400, "invalid_type"),
    ("completions", {"prompt": [1, 2, 3]}, AUTH, 400, "unsupported_parameter"),
    ("completions", {"prompt": "Hi", "temperature": 3}, AUTH, 400, "invalid_value"),
    ("completions", {"prompt": "Hi", "logit_bias": {"1": 5}}, AUTH, 400, "unsupported_parameter"),
    ("completions", {"prompt": "Hi", "max_tokens": 100_000}, AUTH, 400, "max_tokens_too_large"),
    ("completions", {"prompt": "word " * 5000, "max_tokens": 8, "stream": True}, AUTH, 400, "context_length_exceeded"),
    ("completions", {"prompt": "x" * 100_001}, AUTH, 400, "prompt_too_long"),
    ("completions", {"prompt": "Hi", "n": 100}, AUTH, 400, "invalid_value"),
    ("completions", {"prompt": "Hi", "model": "gpt-4"}, AUTH, 404, "model_not_found"),
    ("completions", {"prompt": "Hi", "tokenfuse": {"method": "nope"}}, AUTH, 400, "invalid_ensemble_options"),
    ("completions", {"prompt": "Hi", "tokenfuse": {"bogus": 1}}, AUTH, 400, "unknown_parameter"),
    ("completions", {"prompt": "Hi"}, {"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
    ("completions", b"{not json", AUTH, 400, "invalid_json"),
    ("completions", b"[1, 2]", AUTH, 400, "invalid_json"),
    ("completions", b"x" * ((1 << 20) + 1), AUTH, 413, "request_too_large"),
    ("chat/completions", {"messages": [{"role": "user", "content": None}]}, AUTH, 400, "missing"),
    ("chat/completions", {"messages": []}, AUTH, 400, "invalid_value"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, AUTH, 400, "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, AUTH, 400, None),
    ("nowhere", {"prompt": "Hi"}, AUTH, 404, "not_found"),
]
# relative frequency; "closed": a stream the client closes after 1-3 chunks, "gone": a non-streamed
# request the client gives up on after 0.2 s
KINDS = {"plain": 4, "stream": 4, "n2": 1, "closed": 2, "gone": 1, "sampled": 1, "bad": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """Terminate a process this script started; kill it if it has not exited after 20 s."""
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def wait_until(ready, what: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``ready()`` (a call that may raise ``httpx.HTTPError``) until true, at most ``timeout`` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what} exited with code {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if ready():
                return
        time.sleep(0.2)
    raise SystemExit(f"{what} was not ready within {timeout:.0f} s")


# ---------------------------------------------------------------------------- requests

async def post(client: httpx.AsyncClient, endpoint: str, body: dict | bytes, headers: dict = AUTH) -> tuple[int, dict]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = await client.post(f"/v1/{endpoint}", content=content, headers={"content-type": "application/json", **headers})
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {"raw": r.text[:300]}


def texts(endpoint: str, data: dict) -> list[str]:
    chat = endpoint.startswith("chat")
    return [c["message"]["content"] if chat else c["text"] for c in data.get("choices", [])]


async def stream(client: httpx.AsyncClient, endpoint: str, body: dict, *, close_after: int | None = None,
                 on_chunk=None) -> dict:
    """A streamed request: its status, text and finish reason per choice, usage, error event, whether
    ``[DONE]`` came; with ``close_after`` the client leaves after that many text chunks."""
    chat = endpoint.startswith("chat")
    out: dict = {"status": 0, "text": {}, "finish": {}, "usage": None, "error": None, "done": False, "chunks": 0}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"/v1/{endpoint}", json=body, headers=AUTH) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            await r.aread()
            out["error"] = r.json().get("error")
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]
                continue
            out["usage"] = chunk.get("usage") or out["usage"]
            for c in chunk["choices"]:
                piece = (c["delta"].get("content") if chat else c["text"]) or ""
                out["text"][c["index"]] = out["text"].get(c["index"], "") + piece
                out["chunks"] += bool(piece)
                if c["finish_reason"]:
                    out["finish"][c["index"]] = c["finish_reason"]
            if on_chunk is not None:
                await on_chunk(out)
            if close_after and out["chunks"] >= close_after:
                break  # leaving the block closes the connection: the client is gone mid-stream
    return out


# ---------------------------------------------------------------------------- load

class Load:
    """The load phase's traffic and checks against one server (``url``)."""

    def __init__(self, url: str, *, seed: int, timeout: float) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.timeout = timeout
        self.refs: dict[str, dict] = {}  # greedy request -> its answer alone
        self.sampled: dict[tuple, list[str]] = {}  # (request, seed) -> the first answer seen
        self.reset()

    def reset(self) -> None:
        self.latency: dict[str, list[float]] = {k: [] for k in KINDS}
        self.status: dict[int, int] = {}
        self.failures: list[str] = []
        self.pieces = 0  # pieces of streams checked against their reference
        self.done = 0

    def plan(self, n: int, kinds: dict[str, int] = KINDS) -> list[tuple[str, int]]:
        names, weights = list(kinds), list(kinds.values())
        return [(k, self.rng.randrange(len(BAD) if k == "bad" else len(GREEDY)))
                for k in self.rng.choices(names, weights, k=n)]

    async def references(self) -> None:
        """Every greedy request answered alone, one after another."""
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout) as c:
            for name, endpoint, body in GREEDY:
                status, data = await post(c, endpoint, {**body, "temperature": 0})
                if status != 200:
                    raise SystemExit(f"reference {name}: HTTP {status} {data}")
                self.refs[name] = {"text": texts(endpoint, data)[0], "finish": data["choices"][0]["finish_reason"],
                                   "tokens": data["usage"]["completion_tokens"]}

    async def run(self, plan: list[tuple[str, int]], concurrency: int, deadline: float) -> float:
        """Send ``plan`` from ``concurrency`` clients until done or ``deadline``; the wall time."""
        todo = list(reversed(plan))
        limits = httpx.Limits(max_connections=concurrency * 2)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout, limits=limits) as c:
            async def worker():
                while todo and time.time() < deadline:
                    await self.one(c, *todo.pop())

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return time.perf_counter() - t0

    async def one(self, c: httpx.AsyncClient, kind: str, i: int) -> None:
        t0 = time.perf_counter()
        try:
            status, problem = await getattr(self, "_" + kind)(c, i)
        except httpx.HTTPError as err:
            status, problem = 0, f"{type(err).__name__}: {err}"
        self.latency[kind].append(time.perf_counter() - t0)
        self.status[status] = self.status.get(status, 0) + 1
        self.done += 1
        if status >= 500:
            problem = problem or f"HTTP {status}"
        if problem:
            self.failures.append(f"{kind} {GREEDY[i][0] if kind != 'bad' else i}: {problem}")

    def _check(self, name: str, got: str, *, prefix: bool = False) -> str | None:
        want = self.refs[name]["text"]
        if got == want or (prefix and want.startswith(got)):
            return None
        return f"text {got!r} differs from the answer alone {want!r}"

    async def _plain(self, c, i):
        name, endpoint, body = GREEDY[i]
        status, data = await post(c, endpoint, {**body, "temperature": 0})
        if status != 200:
            return status, f"HTTP {status} {data}"
        problem = self._check(name, texts(endpoint, data)[0])
        if not problem and data["choices"][0]["finish_reason"] != self.refs[name]["finish"]:
            problem = f"finish_reason {data['choices'][0]['finish_reason']} != {self.refs[name]['finish']}"
        return status, problem

    async def _n2(self, c, i):
        name, endpoint, body = GREEDY[i]
        status, data = await post(c, endpoint, {**body, "temperature": 0, "n": 2})
        if status != 200:
            return status, f"HTTP {status} {data}"
        got = texts(endpoint, data)
        if [ch["index"] for ch in data["choices"]] != [0, 1]:
            return status, f"choice indices {[ch['index'] for ch in data['choices']]}"
        return status, self._check(name, got[0]) or self._check(name, got[1])

    async def _stream(self, c, i):
        name, endpoint, body = GREEDY[i]
        s = await stream(c, endpoint, {**body, "temperature": 0})
        if s["status"] != 200 or s["error"]:
            return s["status"], f"HTTP {s['status']} error {s['error']}"
        ref = self.refs[name]
        if not s["done"] or s["finish"].get(0) != ref["finish"]:
            return 200, f"incomplete stream: done={s['done']} finish={s['finish']}"
        tokens = (s["usage"] or {}).get("completion_tokens")
        if tokens != ref["tokens"]:
            return 200, f"{tokens} pieces streamed, {ref['tokens']} alone"
        self.pieces += tokens
        return 200, self._check(name, s["text"].get(0, ""))

    async def _closed(self, c, i):
        name, endpoint, body = GREEDY[i]
        s = await stream(c, endpoint, {**body, "temperature": 0}, close_after=self.rng.randint(1, 3))
        if s["status"] != 200 or s["error"]:
            return s["status"], f"HTTP {s['status']} error {s['error']}"
        return 200, self._check(name, s["text"].get(0, ""), prefix=True)

    async def _gone(self, c, i):
        name, endpoint, body = GREEDY[i]
        try:
            status, data = await asyncio.wait_for(post(c, endpoint, {**body, "temperature": 0}), 0.2)
        except asyncio.TimeoutError:
            return 499, None  # the client left (499, as nginx logs it); the server closes the sequence
        return status, None if status == 200 else f"HTTP {status} {data}"

    async def _sampled(self, c, i):
        name, endpoint, body = GREEDY[i]
        seed = self.rng.randrange(3)
        status, data = await post(c, endpoint, {**body, "temperature": 0.8, "top_p": 0.95, "seed": seed, "n": 2})
        if status != 200:
            return status, f"HTTP {status} {data}"
        got = texts(endpoint, data)
        first = self.sampled.setdefault((name, seed), got)
        return status, None if got == first else f"seeded answer {got!r} differs from an earlier {first!r}"

    async def _bad(self, c, i):
        endpoint, body, headers, want_status, want_code = BAD[i]
        status, data = await post(c, endpoint, body, headers)
        err = data.get("error") or {}
        if status != want_status or not err.get("message") or (want_code and err.get("code") != want_code):
            return status, f"expected {want_status} {want_code}, got {status} {json.dumps(data)[:300]}"
        return status, None


class RSS:
    """Samples a process's resident memory every ``every`` seconds in a thread."""

    def __init__(self, pid: int, every: float = 0.25) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.every = every
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        rss = self.proc.memory_info().rss
        self.peak = max(self.peak, rss)
        return rss

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            with contextlib.suppress(Exception):
                self.now()

    def __enter__(self) -> RSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def load_phase(args, report: dict) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokenfuse.cli", "serve", "--models", args.models, "--port", str(port), "--quiet",
           "--api-key", KEY, "--max-batch", str(args.max_batch)]
    log_path = Path(tempfile.gettempdir()) / f"tokenfuse-soak-server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    print(f"load: {' '.join(cmd[3:])} (log {log_path})", flush=True)
    t0 = time.perf_counter()
    try:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, "tokenfuse serve", 600, proc)
        t_ready = time.perf_counter()
        load = Load(url, seed=args.seed, timeout=args.timeout)
        asyncio.run(load.references())
        t_refs = time.perf_counter()
        with RSS(proc.pid) as rss:
            # warm-up: first every client at once with n=2 (the members' context pools reach their
            # peak size), then the mix
            warm = load.plan(args.concurrency, {"n2": 1}) + load.plan(args.warmup)
            asyncio.run(load.run(warm, args.concurrency, time.time() + args.duration))
            warm_failures = load.failures
            time.sleep(1.0)
            rss_warm, rss.peak = rss.now(), 0
            load.reset()
            wall = asyncio.run(load.run(load.plan(args.requests), args.concurrency, time.time() + args.duration))
            time.sleep(1.0)
            rss_final = rss.now()
            health = httpx.get(f"{url}/health", timeout=10).json()
        gen = [x for k in ("plain", "stream", "n2", "sampled") for x in load.latency[k]]
        every = [x for xs in load.latency.values() for x in xs]
        fivexx = sum(n for s, n in load.status.items() if s >= 500)
        r = report["load"] = {
            "command": " ".join(cmd[3:]), "requests": load.done, "planned": args.requests,
            "concurrency": args.concurrency, "wall_s": round(wall, 2), "requests_per_s": round(load.done / wall, 2),
            "kinds": {k: len(v) for k, v in load.latency.items()},
            "p50_s": round(pct(every, 0.5), 3), "p99_s": round(pct(every, 0.99), 3),
            "generation_p50_s": round(pct(gen, 0.5), 3), "generation_p99_s": round(pct(gen, 0.99), 3),
            "status": {str(k): v for k, v in sorted(load.status.items())}, "5xx": fivexx,
            "stream_pieces_checked": load.pieces, "failures": load.failures[:20], "failure_count": len(load.failures),
            "warmup_failures": warm_failures[:20],
            "rss_mb": {"after_warmup": rss_warm >> 20, "peak": rss.peak >> 20, "final": rss_final >> 20},
            "rss_growth_pct": round(100 * (rss_final - rss_warm) / rss_warm, 2),
            "running_after": health["running"], "server_alive": proc.poll() is None,
            "phase_s": {"server_start": round(t_ready - t0, 1), "references": round(t_refs - t_ready, 1),
                        "warmup_and_load": round(time.perf_counter() - t_refs, 1)},
        }
        print(f"load: {r['requests']} requests in {r['wall_s']} s ({r['requests_per_s']}/s), p50 {r['p50_s']} s, "
              f"p99 {r['p99_s']} s (generation p50 {r['generation_p50_s']} s, p99 {r['generation_p99_s']} s), "
              f"status {r['status']}, RSS after warm-up {r['rss_mb']['after_warmup']} MB, peak "
              f"{r['rss_mb']['peak']} MB, final {r['rss_mb']['final']} MB ({r['rss_growth_pct']:+.2f} %), "
              f"{r['stream_pieces_checked']} streamed pieces checked, {r['failure_count']} failures", flush=True)
        fail = report["failures"]
        fail += [f"load: {f}" for f in load.failures + warm_failures]
        if fivexx:
            fail.append(f"load: {fivexx} answers with a 5xx status")
        if r["rss_growth_pct"] > args.max_growth:
            fail.append(f"load: RSS grew {r['rss_growth_pct']} % after warm-up (limit {args.max_growth} %)")
        if r["running_after"] or not r["server_alive"]:
            fail.append(f"load: after the load {r['running_after']} sequences still running, alive={r['server_alive']}")
        if load.done < min(args.requests, 1):
            fail.append("load: no request was sent")
    finally:
        stop(proc)


# ---------------------------------------------------------------------------- faults

@contextlib.contextmanager
def served(app):
    """``app`` served by uvicorn in a thread on a free loopback port; yields its URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    runner = threading.Thread(target=server.run, name="soak-uvicorn", daemon=True)
    runner.start()
    wait_until(lambda: server.started, "uvicorn", 60)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        runner.join(30)


class Faults:
    """Records each fault's checks: ``check(name, ok, detail)``."""

    def __init__(self, report: dict) -> None:
        self.rows = report.setdefault("faults", [])
        self.failures = report["failures"]

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.rows.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            self.failures.append(f"fault {name}: {detail}")


PROMPT = {"prompt": "Question: What is 2+2?\nAnswer:", "max_tokens": 8, "temperature": 0}
LONG = {"prompt": "Count from 1 to 100: 1, 2, 3,", "max_tokens": 48, "temperature": 0}
# a story: pieces that are one member's token and not the other's, so members re-sync often
STORY = {"prompt": "Once upon a time, in a small village by the sea, there lived", "max_tokens": 48, "temperature": 0}


async def fault_stream(url: str, fault, *, after: int = 2, timeout: float = 60) -> tuple[dict, float]:
    """A long greedy stream; ``fault()`` runs (in a thread) after ``after`` text chunks. Returns the
    stream and the seconds from the fault to the stream's end."""
    t = {}

    async def on_chunk(out):
        if out["chunks"] >= after and "fault" not in t:
            t["fault"] = time.perf_counter()
            await asyncio.to_thread(fault)

    async with httpx.AsyncClient(base_url=url, timeout=timeout) as c:
        s = await stream(c, "completions", LONG, on_chunk=on_chunk)
    return s, time.perf_counter() - t.get("fault", time.perf_counter())


def fault_stream_once_more(url: str, fault, cooldown: float) -> tuple[dict, float, str]:
    """``fault_stream``, sent again (once) if the stream failed before the fault was injected: on a
    busy machine a member's answer can be slower than its timeout (a clear error too, not the fault)."""
    s, secs = asyncio.run(fault_stream(url, fault))
    if s["chunks"] >= 2:
        return s, secs, ""
    first = f" (a first try failed before the fault: {(s['error'] or {}).get('message')})"
    time.sleep(cooldown)
    s, secs = asyncio.run(fault_stream(url, fault))
    return s, secs, first


def answer(url: str, body: dict = PROMPT) -> tuple[int, dict]:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    return r.status_code, r.json()


def ended_with(s: dict, code: str, after: int = 2) -> bool:
    """The stream ran (``after`` chunks), then ended with an error event of ``code`` and ``[DONE]``."""
    return (s["status"] == 200 and s["chunks"] >= after and (s["error"] or {}).get("code") == code and s["done"]
            and not s["finish"])


def local_member(name: str, source: str):
    from tokenfuse.config import MemberConfig
    from tokenfuse.load import load_member

    return load_member(MemberConfig(name=name, source=source, backend="llamacpp"), progress=False)


def fault_resync(f: Faults, members: list) -> None:
    """The client leaves while the scheduler thread is inside a member's re-sync."""
    import tokenfuse.engine.sequence as sequence
    from tokenfuse.engine import Ensemble
    from tokenfuse.server import create_app

    app = create_app(Ensemble(members))
    sched = app.state.scheduler
    real = sequence.resync
    armed, inside, go = threading.Event(), threading.Event(), threading.Event()

    def held(codec, st, output, **kw):
        if armed.is_set() and (st.covered != len(output) or st.provisional):  # not a no-op: a real re-sync
            armed.clear()
            inside.set()
            go.wait(20)
        return real(codec, st, output, **kw)

    released = []
    for m in members:
        m.release = functools.partial(lambda m, st: (released.append(m.name), type(m).release(m, st)), m)
    sequence.resync = held
    try:
        with served(app) as url:
            _, want = answer(url)

            def leave_in_resync():
                armed.set()
                inside.wait(20)

            async def run():
                async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                    async def on_chunk(out):
                        if out["chunks"] == 2:
                            await asyncio.to_thread(leave_in_resync)
                    s = await stream(c, "completions", STORY, on_chunk=on_chunk, close_after=2)
                await asyncio.sleep(0.5)  # the server notices the closed connection; its cancel waits in line
                go.set()
                return s

            closed_before, steps_before = sched.closed, sched.steps
            released.clear()
            s = asyncio.run(run())
            deadline = time.time() + 10
            while (sched.active or sched.closed == closed_before) and time.time() < deadline:
                time.sleep(0.05)
            f.check("resync: client gone inside a re-sync", inside.is_set() and sched.active == 0
                    and sched.closed == closed_before + 1 and sched.steps - steps_before < STORY["max_tokens"],
                    f"held inside a re-sync: {inside.is_set()}; closed after {sched.steps - steps_before} of "
                    f"{STORY['max_tokens']} steps; {s['chunks']} chunks received; running now {sched.active}")
            f.check("resync: every member's state released", sorted(released) == sorted(m.name for m in members),
                    f"released: {released}")
            status, again = answer(url)
            f.check("resync: next request exact", status == 200 and again["choices"] == want.get("choices"),
                    f"HTTP {status}, same answer as before: {again.get('choices') == want.get('choices')}")
    finally:
        sequence.resync = real
        for m in members:
            del m.release
        go.set()


class LlamaServer:
    """llama-cpp-python's OpenAI-compatible server on SmolLM2's GGUF, on a fixed loopback port."""

    def __init__(self) -> None:
        from tokenfuse.bundled import BUNDLED
        from tokenfuse.paths import cache_dir

        self.gguf = BUNDLED[SMOL].gguf_path(cache_dir())
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}/v1"
        self.log = Path(tempfile.gettempdir()) / f"tokenfuse-soak-llama-server-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:  # (a fault that was never injected)
            self.kill()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llama_cpp.server", "--model", str(self.gguf), "--host", "127.0.0.1",
                 "--port", str(self.port), "--n_ctx", "512", "--n_threads", "1", "--model_alias", "smol"],
                stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: httpx.get(f"{self.base}/models", timeout=1).status_code == 200, "llama_cpp.server", 120,
                   self.proc)
        # its first answers are slow (seconds: it allocates its logits buffers)
        for prompt in ("Hi", PROMPT["prompt"]):
            httpx.post(f"{self.base}/completions", json={"prompt": prompt, "max_tokens": 1, "logprobs": 20}, timeout=60)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)  # a stalled server dies too
        self.proc.kill()
        self.proc.wait(10)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)


def fault_remote(f: Faults, gemma, *, quick: bool = False) -> None:
    """A remote member's server killed, restarted and stalled mid-generation."""
    from tokenfuse.config import MemberConfig
    from tokenfuse.engine import Ensemble
    from tokenfuse.load import load_member
    from tokenfuse.server import ServerSettings, create_app

    srv = LlamaServer()
    srv.start()
    remote = load_member(MemberConfig(name="smol-remote", backend="openai", base_url=srv.base, model="smol",
                                      tokenizer=SMOL, n_ctx=512, timeout=8, retries=0, prompt_format="text"),
                       progress=False)  # text: llama-cpp-python's server takes no token-id prompts
    remote.cooldown = 1.0  # fail fast for 1 s after a failure (default 5 s), to keep the run short
    ens = Ensemble([remote, gemma], method="unite")
    try:
        with served(create_app(ens)) as url:
            status, want = answer(url)
            f.check("remote: served", status == 200, f"HTTP {status} {want.get('choices', want)}")
            s, secs, note = fault_stream_once_more(url, srv.kill, remote.cooldown)
            f.check("remote killed mid-stream: error event", ended_with(s, "member_unavailable"),
                    f"{s['chunks']} chunks, then {s['error']} after {secs:.2f} s; [DONE] {s['done']}{note}")
            status, data = answer(url)
            f.check("remote down: clear 503", status == 503 and data["error"]["code"] == "member_unavailable"
                    and "'smol-remote'" in data["error"]["message"], f"HTTP {status} {data.get('error')}")
            srv.start()
            time.sleep(remote.cooldown)
            status, data = answer(url)
            f.check("remote restarted: next request works", status == 200,
                    f"HTTP {status}; same answer as before the fault: {data.get('choices') == want.get('choices')}")
            s, secs, note = fault_stream_once_more(url, lambda: srv.signal(signal.SIGSTOP), remote.cooldown)
            srv.signal(signal.SIGCONT)
            f.check("remote stalled mid-stream: error event", ended_with(s, "member_unavailable") and secs < 12,
                    f"{s['chunks']} chunks, then {s['error']} after {secs:.2f} s (the member's timeout: 8 s){note}")
            time.sleep(remote.cooldown)
            status, data = answer(url)
            f.check("remote resumed: next request works", status == 200,
                    f"HTTP {status}; same answer: {data.get('choices') == want.get('choices')}")
        if quick:
            return
        with served(create_app(ens, settings=ServerSettings(on_member_failure="skip"))) as url:
            srv.kill()
            status, data = answer(url)
            f.check("remote down, on_member_failure skip: answered without it", status == 200
                    and data["tokenfuse"]["unavailable_members"] == ["smol-remote"],
                    f"HTTP {status}, unavailable_members {data.get('tokenfuse', {}).get('unavailable_members')}")
            srv.start()
            time.sleep(remote.cooldown)
            status, data = answer(url)
            f.check("remote back, skip: answered with it", status == 200
                    and data["tokenfuse"]["unavailable_members"] == [] and data["choices"] == want.get("choices"),
                    f"HTTP {status}, unavailable {data.get('tokenfuse', {}).get('unavailable_members')}, "
                    f"same answer: {data.get('choices') == want.get('choices')}")
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.kill()


def fault_ray(f: Faults, root: Path, local: list, *, quick: bool = False) -> None:
    """Members on two nodes of a local Ray cluster: an actor killed, then a node removed, mid-stream;
    each time with ``on_member_failure: error`` (a clear error) and ``skip`` (answered without it)."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import remove_placement_group

    from tokenfuse.config import MemberConfig
    from tokenfuse.engine import Ensemble
    from tokenfuse.load import load_member
    from tokenfuse.placement.ray import place_members
    from tokenfuse.server import ServerSettings, create_app

    # Ray binds every node to this machine's own address (it refuses loopback); nothing leaves the machine
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    node = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    print(f"  two-node Ray cluster up in {time.perf_counter() - t0:.1f} s", flush=True)
    factories = [functools.partial(load_member, MemberConfig(name=n, backend="llamacpp", n_threads=1), root=root,
                                   progress=False, index=i) for i, n in enumerate((SMOL, GEMMA))]

    def place(restarts: int = 0) -> list:
        t0 = time.perf_counter()
        members = place_members(factories, num_cpus=[1, 1], num_gpus=[0, 0], strategy="STRICT_SPREAD", timeout=120,
                                max_restarts=restarts, call_timeout=60 if restarts else None)
        nodes = ray.get([m.actor.__ray_call__.remote(lambda a: ray.get_runtime_context().get_node_id())
                         for m in members])
        f.check("ray: one member per node", len(set(nodes)) == 2,
                f"nodes {[n[:8] for n in nodes]}, placed and loaded in {time.perf_counter() - t0:.1f} s")
        return members, nodes

    def unplace(members: list) -> None:
        for m in members:
            ray.kill(m.actor)
        remove_placement_group(members[0].placement_group)

    def survive(what: str, members: list, fault, lost: str) -> None:
        ens = Ensemble(members)
        with served(create_app(ens)) as url:
            status, data = answer(url)
            f.check(f"ray: served before the {what}", status == 200 and data["choices"] == want.get("choices"),
                    f"HTTP {status}, same answer as in-process: {data.get('choices') == want.get('choices')}")
            s, secs = asyncio.run(fault_stream(url, fault))
            f.check(f"ray {what} mid-stream: error event", ended_with(s, "member_unavailable"),
                    f"{s['chunks']} chunks, then {s['error']} after {secs:.2f} s")
            status, data = answer(url)
            f.check(f"ray after the {what}: server up, clear 503", status == 503
                    and data["error"]["code"] == "member_unavailable" and repr(lost) in data["error"]["message"],
                    f"HTTP {status} {data.get('error')}")
        with served(create_app(ens, settings=ServerSettings(on_member_failure="skip"))) as url:
            status, data = answer(url)
            f.check(f"ray after the {what}, on_member_failure skip: answered without it", status == 200
                    and data["tokenfuse"]["unavailable_members"] == [lost],
                    f"HTTP {status}, unavailable_members {data.get('tokenfuse', {}).get('unavailable_members')}")

    def restarted(members: list) -> None:
        """With ``max_restarts``: the actor's process killed mid-stream; Ray starts it again."""
        pid = ray.get(members[0].actor.__ray_call__.remote(lambda a: os.getpid()))
        with served(create_app(Ensemble(members))) as url:
            s, secs = asyncio.run(fault_stream(url, lambda: os.kill(pid, signal.SIGKILL)))
            f.check("ray actor process killed mid-stream (max_restarts 1): the stream goes on, exact",
                    s["done"] and not s["error"] and s["text"].get(0) == want_long,
                    f"{s['chunks']} chunks, error {s['error']}, the same text as in-process: "
                    f"{s['text'].get(0) == want_long}; ended {secs:.2f} s after the kill")
            t0 = time.perf_counter()
            status, data = answer(url)
            f.check("ray actor restarted: next request works", status == 200
                    and data["choices"] == want.get("choices"),
                    f"HTTP {status} in {time.perf_counter() - t0:.1f} s (the actor loaded its member again), "
                    f"same answer as in-process: {data.get('choices') == want.get('choices')}")

    try:
        with served(create_app(Ensemble(local))) as url:
            want = answer(url)[1]
            want_long = answer(url, LONG)[1]["choices"][0]["text"]
        if not quick:
            members, nodes = place()
            survive("actor killed", members, lambda: ray.kill(members[0].actor), SMOL)
            unplace(members)
        members, nodes = place(restarts=1)
        restarted(members)
        unplace(members)
        members, nodes = place()
        lost = members[nodes.index(node.node_id)].name
        survive("node removed", members, lambda: cluster.remove_node(node), lost)
    finally:
        ray.shutdown()
        cluster.shutdown()


def fault_phase(args, report: dict) -> None:
    from tokenfuse.paths import cache_dir

    faults = set(args.faults.split(","))
    f = Faults(report)
    timings = report.setdefault("fault_s", {})
    local = {}
    if faults & {"resync", "remote", "ray"}:
        local = {n: local_member(n, n) for n in (SMOL, GEMMA)}
    for name, what, run in [
        ("resync", "client gone during a re-sync", lambda: fault_resync(f, list(local.values()))),
        ("remote", "remote member (llama-cpp-python's server) killed, restarted, stalled",
         lambda: fault_remote(f, local[GEMMA], quick=args.quick)),
        ("ray", "Ray members on a two-node local cluster: actor killed, node removed",
         lambda: fault_ray(f, cache_dir(), list(local.values()), quick=args.quick)),
    ]:
        if name in faults:
            print(f"faults: {what}", flush=True)
            t0 = time.perf_counter()
            try:
                run()
            except Exception as err:  # noqa: BLE001 - a fault run that breaks is a failed check, the others still run
                f.check(f"{name}: ran to the end", False, f"{type(err).__name__}: {err}")
            timings[name] = round(time.perf_counter() - t0, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="CI size: 24 requests of at most 6 pieces from 4 clients, each fault once")
    p.add_argument("--models", default=f"{SMOL},{GEMMA}", help="the load phase's ensemble (tokenfuse serve --models)")
    p.add_argument("--requests", type=int, default=2000, help="requests of the load phase (after warm-up)")
    p.add_argument("--warmup", type=int, default=100, help="warm-up requests before RSS is taken")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    p.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch")
    p.add_argument("--duration", type=float, default=600, help="the load phase stops after this many seconds")
    p.add_argument("--timeout", type=float, default=120, help="seconds per request")
    p.add_argument("--max-tokens", type=int, help="cap every load request's max_tokens (default: 8-16 each)")
    p.add_argument("--faults", default="resync,remote,ray", help="comma list of resync, remote, ray; or none")
    p.add_argument("--max-growth", type=float, default=5.0, help="largest RSS growth after warm-up, in %%")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.warmup, args.concurrency, args.duration = 24, 4, 4, min(args.duration, 120)
        args.max_tokens = min(args.max_tokens or 6, 6)
    for _, _, body in GREEDY if args.max_tokens else ():
        body["max_tokens"] = min(body["max_tokens"], args.max_tokens)
    report: dict = {"args": vars(args), "failures": []}
    t0 = time.perf_counter()
    if args.requests > 0:
        load_phase(args, report)
    if args.faults != "none":
        fault_phase(args, report)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    for line in report["failures"]:
        print("FAILED:", line)
    print(f"soak: {len(report['failures'])} failures in {report['seconds']} s", flush=True)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
