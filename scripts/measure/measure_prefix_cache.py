"""The llama.cpp prefix cache, on against off (the figures in docs/methods.md's "Prefix cache" bullet).

1. Per bundled member: a 360-token prompt ending in four different options, one after another;
   the first is prefilled, the next ones reuse its cache. Prints ms per option and the largest
   probability difference against a fresh prefill.
2. MMLU likelihood (5-shot, 4 options per item) with Gemma-3-270M alone, 8 items in batches of 4
   items as `tokenfuse eval` runs them, cache off / on twice each; prints seconds and the ratio.

Usage: TOKENFUSE_DATA=../shared/benchmarks .venv/bin/python scripts/measure/measure_prefix_cache.py
"""

from __future__ import annotations

import statistics
import time

from tokenfuse import Ensemble
from tokenfuse.bundled import DEFAULT_ENSEMBLE
from tokenfuse.config import MemberConfig
from tokenfuse.load import load_member
from tokenfuse.tasks import load_task


def one_prompt(name: str) -> None:
    m = load_member(MemberConfig(name=name, backend="llamacpp"), progress=False)
    context = "The following are multiple choice questions about history. " * 40 + "Answer:"
    options = [" A", " B", " C", " Paris"]
    runs: dict[bool, list] = {}
    for flag in (True, False):  # all options with the cache, then all without
        m.prefix_cache = flag
        for opt in options:
            st = m.new_state(m.encode_prompt(context + opt))
            t = time.perf_counter()
            runs.setdefault(flag, []).append((m.next_logprobs([st])[0], time.perf_counter() - t))
            m.release(st)
    for opt, (lp_on, t_on), (lp_off, t_off) in zip(options, runs[True], runs[False]):
        diff = (lp_on.exp() - lp_off.exp()).abs().max().item()
        print(f"{name:30s} {opt!r:9s} cache on {1000 * t_on:7.0f} ms, off {1000 * t_off:7.0f} ms, "
              f"max |dp| {diff:.4f}", flush=True)

def mmlu_ab() -> None:
    task = load_task("mmlu")
    items = task.subset(8, 1234)
    reqs = [(c.context, o) for c in map(task.cloze, items) for o in c.continuations]
    m = load_member(MemberConfig(name="gemma3-270m", n_threads=1), progress=False)
    ens, res = Ensemble([m]), {}
    for flag in (False, True, False, True):
        m.prefix_cache = flag
        t, out = time.perf_counter(), []
        for k in range(0, len(reqs), 16):  # 4 items (16 options) per batch
            out += ens.loglikelihood(reqs[k:k + 16])
        dt = time.perf_counter() - t
        res.setdefault(flag, []).append(dt)
        print(f"MMLU likelihood, prefix_cache={flag}: {dt:.1f} s for {len(items)} items ({len(reqs)} options); "
              f"first log-prob {out[0].logprob:.4f}", flush=True)
    print(f"speed-up (median off / median on): {statistics.median(res[False]) / statistics.median(res[True]):.2f}x")


if __name__ == "__main__":
    for name in DEFAULT_ENSEMBLE:
        one_prompt(name)
    mmlu_ab()
