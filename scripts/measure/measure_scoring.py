"""One-forward likelihood scoring against the stepwise reference path on the bundled members.

Scores the options of N items of each task with the default three-member ensemble (llama.cpp,
prefix cache off so both paths start from a fresh prefill), once per path and method, and prints
per method: the largest |Δ log-likelihood| of a continuation, how many items' predictions (by
log-prob per byte) differ, and the seconds / items per minute of each path.

Usage: TOKENFUSE_DATA=../shared/benchmarks .venv/bin/python scripts/measure/measure_scoring.py [--items 10]
       [--tasks piqa,arc_easy] [--methods gac,unite,deepen,gac-threshold] [--flash-attn 1]
"""

from __future__ import annotations

import argparse
import time

from tokenfuse import Ensemble
from tokenfuse.bundled import DEFAULT_ENSEMBLE
from tokenfuse.config import MemberConfig
from tokenfuse.load import load_member
from tokenfuse.tasks import load_task


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=10)
    ap.add_argument("--tasks", default="piqa,arc_easy")
    ap.add_argument("--methods", default="gac,unite,deepen,gac-threshold")
    a = ap.parse_args()
    members = [load_member(MemberConfig(name=n, prefix_cache=False), progress=False) for n in DEFAULT_ENSEMBLE]
    for task_name in a.tasks.split(","):
        task = load_task(task_name)
        items = task.subset(a.items, 1234)
        clozes = [task.cloze(it) for it in items]
        reqs = [(c.context, o) for c in clozes for o in c.continuations]
        for method in a.methods.split(","):
            kw = {"gate": members[0].name, "threshold": 0.5} if method == "gac-threshold" else {}
            ens = Ensemble(members, method="gac" if method == "gac-threshold" else method,
                           params={"k": 10} if method == "unite" else None, primary=members[0].name, **kw)
            res, secs = {}, {}
            for stepwise in (False, True):
                t = time.perf_counter()
                res[stepwise] = ens.loglikelihood(reqs, stepwise=stepwise)
                secs[stepwise] = time.perf_counter() - t
            diff = max(abs(x.logprob - y.logprob) for x, y in zip(res[False], res[True]))
            flips, k = 0, 0
            for c in clozes:
                n = len(c.continuations)
                pick = [max(range(n), key=lambda j, r=r: r[k + j].per_byte) for r in (res[False], res[True])]
                flips += pick[0] != pick[1]
                k += n
            print(f"{task_name:9s} {method:14s} max|Δ loglik| {diff:.2e}  predictions differing {flips}/{len(items)}  "
                  f"one-forward {secs[False]:6.1f} s ({60 * len(items) / secs[False]:5.1f} items/min)  "
                  f"stepwise {secs[True]:6.1f} s ({60 * len(items) / secs[True]:5.1f} items/min)  "
                  f"speed-up {secs[True] / secs[False]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
