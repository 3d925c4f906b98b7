#!/usr/bin/env python
"""Load test: N concurrent streaming clients against ``tokenfuse serve`` on this machine.

Starts the server (the bundled models by default) on a free local port, or uses ``--url``. Each
round sends the same requests (greedy, streaming, ``stream_options.include_usage``): first one
after another (sequential serving: the baseline), then with 1, 4, 8 ... concurrent clients. It
reports throughput (completion tokens per second over the round's wall time), p50/p95 request
latency and time to first token, and checks every response: complete (a finish reason, ``[DONE]``)
and, for greedy decoding, byte-identical to the sequential answer.

    .venv/bin/python scripts/load/loadtest.py                       # bundled models, 1/4/8 clients
    .venv/bin/python scripts/load/loadtest.py --clients 1,4,8 --requests 16 --max-tokens 32
    .venv/bin/python scripts/load/loadtest.py --url http://127.0.0.1:8000   # an already running server
    .venv/bin/python scripts/load/loadtest.py --overhead            # per-step cost: local vs remote vs Ray member

Traffic goes to 127.0.0.1 only; every loop is bounded (requests x rounds, with timeouts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "Question: What is the capital of France?\nAnswer:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "Question: How many legs does a spider have?\nAnswer:",
    "import numpy as np\n\n# compute the mean of a list\n",
    "The quick brown fox",
    "Water boils at",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become ready within {timeout:.0f} s")


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    """One streaming request: its text, timing and whether it completed."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    text, finish, done, tokens = [], None, False, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                if c["text"]:
                    first = first or time.perf_counter()
                    text.append(c["text"])
                finish = c["finish_reason"] or finish
    end = time.perf_counter()
    return {"text": "".join(text), "latency": end - t0, "ttft": (first or end) - t0, "tokens": tokens,
            "complete": done and finish is not None}


async def round_(url: str, prompts: list[str], max_tokens: int, clients: int, timeout: float) -> tuple[float, list]:
    """Send every prompt, ``clients`` at a time (each client takes the next prompt when it is done)."""
    queue = list(enumerate(prompts))
    results: list = [None] * len(prompts)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        async def worker():
            while queue:
                i, p = queue.pop(0)
                results[i] = await one(client, p, max_tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return time.perf_counter() - t0, results


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def loadtest(args) -> None:
    proc = None
    url = args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "tokenfuse.cli", "serve", "--port", str(port), "--quiet",
               "--max-batch", str(max(int(c) for c in args.clients.split(",")))]
        cmd += ["--config", args.config] if args.config else ["--models", args.models]
        if args.method:
            cmd += ["--method", args.method]
        log = open(Path(tempfile.gettempdir()) / "tokenfuse-loadtest-server.log", "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        print(f"server: {' '.join(cmd[1:])}  (log: {log.name})")
    try:
        wait_ready(url, proc)
        prompts = (PROMPTS * (args.requests // len(PROMPTS) + 1))[: args.requests]
        asyncio.run(round_(url, prompts[:2], 4, 2, args.timeout))  # warm-up
        seq_wall, seq = asyncio.run(round_(url, prompts, args.max_tokens, 1, args.timeout))
        rows = [("sequential", seq_wall, seq)]
        for c in (int(x) for x in args.clients.split(",")):
            wall, res = asyncio.run(round_(url, prompts, args.max_tokens, c, args.timeout))
            rows.append((f"{c} concurrent", wall, res))
        base_tps = sum(r["tokens"] for r in seq) / seq_wall
        print(f"\n{len(prompts)} requests x {args.max_tokens} max tokens, greedy, streaming\n")
        print("| clients | wall s | tokens | tokens/s | vs sequential | p50 latency s | p95 latency s | "
              "p50 TTFT s | complete | identical to sequential |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, wall, res in rows:
            tokens = sum(r["tokens"] for r in res)
            lat = [r["latency"] for r in res]
            same = sum(r["text"] == s["text"] for r, s in zip(res, seq))
            print(f"| {name} | {wall:.2f} | {tokens} | {tokens / wall:.1f} | {tokens / wall / base_tps:.2f}x | "
                  f"{pct(lat, 0.5):.2f} | {pct(lat, 0.95):.2f} | {pct([r['ttft'] for r in res], 0.5):.2f} | "
                  f"{sum(r['complete'] for r in res)}/{len(res)} | {same}/{len(res)} |")
        if args.json:
            Path(args.json).write_text(json.dumps([{"round": n, "wall": w, "results": r} for n, w, r in rows],
                                                  indent=1))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


# ---------------------------------------------------------------------------- per-step overhead

def overhead(args) -> None:
    """ms per generated piece of a one-member UniTE ensemble (SmolLM2) and of SmolLM2 + Gemma, with
    SmolLM2 in-process (llama.cpp), behind llama-cpp-python's server, and in a Ray actor."""
    import torch

    from tokenfuse.bundled import BUNDLED
    from tokenfuse.config import MemberConfig
    from tokenfuse.engine import Ensemble
    from tokenfuse.load import load_member
    from tokenfuse.paths import cache_dir

    torch.set_num_threads(1)
    smol = "smollm2-135m-instruct"
    local = load_member(MemberConfig(name="smol", source=smol, backend="llamacpp", n_threads=1), progress=False)
    gemma = load_member(MemberConfig(name="gemma", source="gemma3-270m", backend="llamacpp", n_threads=1),
                        progress=False)
    port = free_port()
    gguf = BUNDLED[smol].gguf_path(cache_dir())
    log = open(Path(tempfile.gettempdir()) / "tokenfuse-overhead-llama-server.log", "wb")
    srv = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                            "--port", str(port), "--n_ctx", str(args.remote_n_ctx), "--n_threads", "1",
                            "--model_alias", "smol"], stdout=log, stderr=subprocess.STDOUT)
    import ray

    from tokenfuse.load import load_member as _lm
    from tokenfuse.placement.ray import place_members

    try:
        base = f"http://127.0.0.1:{port}/v1"
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{base}/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise SystemExit("llama_cpp.server did not start")
            time.sleep(0.3)
        remote = load_member(MemberConfig(name="smol", backend="openai", base_url=base, model="smol", tokenizer=smol,
                                          n_ctx=args.remote_n_ctx), progress=False)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        import functools

        (placed,) = place_members([functools.partial(_lm, MemberConfig(name="smol", source=smol, backend="llamacpp",
                                                                       n_threads=1), progress=False)],
                                  num_cpus=[1], num_gpus=[0])
        # every configuration once per round, rounds interleaved (the machine is shared: medians)
        configs = {}
        for name, m in (("in-process (llama.cpp)", local), ("Ray actor (llama.cpp)", placed),
                        ("remote: llama_cpp.server", remote)):
            configs[(name, "alone")] = Ensemble([m], method="unite")
            configs[(name, "unite")] = Ensemble([m, gemma], method="unite")
            if m is not remote:
                configs[(name, "gac")] = Ensemble([m, gemma], method="gac")
        times: dict = {k: [] for k in configs}
        for ens in configs.values():
            ens.generate(PROMPTS[0], max_new_tokens=4)  # warm-up
        for _ in range(args.rounds):
            for key, ens in configs.items():
                for p in PROMPTS[:2]:
                    seq = ens.open(p, max_new_tokens=args.max_tokens)
                    ens.step([seq])  # the prompt's prefill: not a decode step
                    while seq.finished is None:
                        t = time.perf_counter()
                        ens.step([seq])
                        times[key].append(1000 * (time.perf_counter() - t))
                    ens.close(seq)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\nms per decode step (one piece), median over {args.rounds} rounds x 2 prompts x up to "
              f"{args.max_tokens} steps (load average {os.getloadavg()[0]:.1f})")
        print("\n| SmolLM2 placement | SmolLM2 alone (UniTE) | overhead | SmolLM2 + Gemma (UniTE) | overhead | "
              "SmolLM2 + Gemma (GaC) | overhead |")
        print("|---|---|---|---|---|---|---|")
        ref = "in-process (llama.cpp)"
        for name in dict.fromkeys(n for n, _ in configs):
            cells = []
            for kind in ("alone", "unite", "gac"):
                if (name, kind) in med:
                    d = med[(name, kind)] - med[(ref, kind)]
                    cells += [f"{med[(name, kind)]:.1f}", "–" if name == ref else f"{d:+.1f}"]
                else:
                    cells += ["n/a", "n/a"]
            print(f"| {name} | " + " | ".join(cells) + " |")
    finally:
        srv.terminate()
        srv.wait(20)
        if ray.is_initialized():
            ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an already running tokenfuse server (default: start one)")
    p.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m,qwen2.5-coder-0.5b-instruct")
    p.add_argument("--config", help="ensemble config for the started server")
    p.add_argument("--method", help="combiner for the started server")
    p.add_argument("--clients", default="1,4,8")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="write every response and timing to this file")
    p.add_argument("--overhead", action="store_true", help="measure per-step cost of remote and Ray members instead")
    p.add_argument("--remote-n-ctx", type=int, default=512, help="n_ctx of the llama_cpp.server in --overhead")
    p.add_argument("--rounds", type=int, default=3, help="--overhead: interleaved rounds (median reported)")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    overhead(args) if args.overhead else loadtest(args)


if __name__ == "__main__":
    main()
