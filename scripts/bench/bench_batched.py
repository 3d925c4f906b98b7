#!/usr/bin/env python
"""The batched transformers forward against one sequence per forward, on the bundled members (CPU).

For each member alone and for GaC of the three: N prompts stepped together against the same
prompts one at a time (``tokenfuse.bench.streams.measure_streams``: tokens/s with the prefill,
decode only, outputs identical to the prompt generated alone), once with ``batched: true`` (the
default) and once with ``batched: false`` (one ``DynamicCache`` per sequence, the numbers before
the batched forward existed); then how far the two paths' log-probabilities are apart on the same
steps (every row of N prompts, ``--steps`` steps, teacher-forced on the batched path's greedy
choices) and whether their greedy outputs are equal.

    .venv/bin/python scripts/bench/bench_batched.py --streams 1,8 --max-new-tokens 24 --json bench-batched.json

Both paths run on the same loaded models (no second copy of the weights). Run it on an idle machine:
it reports wall-clock rates.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tokenfuse import Ensemble
from tokenfuse.bench import PROMPTS as BENCH_PROMPTS
from tokenfuse.bench.streams import measure_streams
from tokenfuse.bundled import DEFAULT_ENSEMBLE
from tokenfuse.config import MemberConfig
from tokenfuse.load import load_member
from tokenfuse.members.transformers import TransformersMember

PROMPTS = [*BENCH_PROMPTS, "def quicksort(xs):", "The main causes of the French Revolution were"]  # 8 distinct


def twin(m: TransformersMember, batched: bool) -> TransformersMember:
    return TransformersMember(m.name, m.model, m.tokenizer, weight=m.weight, batched=batched)


def logprob_gap(batched: TransformersMember, plain: TransformersMember, prompts, steps: int) -> dict:
    """Max |log p| difference of the two paths over ``steps`` steps of all ``prompts`` as one batch
    (the plain path fed the batched path's greedy choices), and how often the greedy choice differed."""
    a = [batched.new_state(batched.encode_prompt(p)) for p in prompts]
    b = [plain.new_state(plain.encode_prompt(p)) for p in prompts]
    worst, worst_rel, differ, n = 0.0, 0.0, 0, 0
    for _ in range(steps):
        la, lb = batched.next_logprobs(a), plain.next_logprobs(b)
        d = (la - lb).abs()
        worst = max(worst, d.max().item())
        worst_rel = max(worst_rel, (d / lb.abs().clamp_min(1.0)).max().item())
        ca, cb = la.argmax(-1), lb.argmax(-1)
        differ += int((ca != cb).sum())
        n += len(prompts)
        for x, y, c in zip(a, b, ca.tolist()):
            x.ids.append(c)
            y.ids.append(c)
    for x, y in zip(a, b):
        batched.release(x)
        plain.release(y)
    return {"max_abs": worst, "max_rel": worst_rel, "greedy_differ": differ, "rows_compared": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,8", help="stream counts (default 1,8)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16, help="steps of the log-probability comparison")
    ap.add_argument("--only", default="", help="comma-separated subset: member names and/or gac")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    counts = [int(x) for x in args.streams.split(",")]
    torch.manual_seed(0)
    loaded = [load_member(MemberConfig(name=n, backend="transformers"), progress=False) for n in DEFAULT_ENSEMBLE]
    targets = {m.name: [m] for m in loaded} | {"gac": loaded}
    if args.only:
        targets = {k: v for k, v in targets.items() if k in args.only.split(",")}
    out: dict = {"threads": torch.get_num_threads(), "prompts": len(PROMPTS), "max_new_tokens": args.max_new_tokens,
                 "rows": {}}
    for name, members in targets.items():
        row = {}
        for batched in (False, True):
            ens = Ensemble([twin(m, batched) for m in members])
            t0 = time.perf_counter()
            sec = measure_streams(ens, PROMPTS, counts, max_new_tokens=args.max_new_tokens, rounds=args.rounds,
                                  progress=False)
            key = "batched" if batched else "unbatched"
            row[key] = {"seconds": round(time.perf_counter() - t0, 1), "rows": sec["rows"],
                        "one_by_one": sec["one_by_one"]}
            print(f"{name} {key}: " + "; ".join(
                f"{r['streams']} streams {r['tokens_per_s']:.2f} tok/s ({r['decode_tokens_per_s']:.2f} decode), "
                f"{r['vs_1_stream']}x one at a time, identical {r['identical']}/{r['compared']}" for r in sec["rows"]),
                flush=True)
        n = max(counts)
        gens = {}
        for batched in (False, True):
            ens = Ensemble([twin(m, batched) for m in members])
            gens[batched] = [g.output for g in ens.generate(PROMPTS[:n], max_new_tokens=args.max_new_tokens)]
        row["batched_equals_unbatched"] = sum(x == y for x, y in zip(gens[True], gens[False]))
        row["compared"] = len(gens[True])
        if len(members) == 1:
            row["logprob_gap"] = logprob_gap(twin(members[0], True), twin(members[0], False), PROMPTS[:n], args.steps)
        print(f"{name}: {n} prompts together, batched outputs equal to unbatched {row['batched_equals_unbatched']}/"
              f"{row['compared']}" + (f"; log-prob gap {row['logprob_gap']}" if "logprob_gap" in row else ""), flush=True)
        out["rows"][name] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
