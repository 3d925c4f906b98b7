"""``tokenfuse bench``: every configuration in one process, interleaved, medians per token.

Rows: each member alone, GaC every step, and GaC thresholded at each ``t`` with the first member
as gate. The prompt set is fixed; one warm-up generation per row runs first. Each round runs
every row on every prompt before the next round, so machine drift hits all rows alike.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from pathlib import Path

from tokenfuse.config import EnsembleConfig
from tokenfuse.engine.generate import STAGES, Ensemble
from tokenfuse.engine.sampling import Sampling

PROMPTS = [
    "Question: What is the capital of France?\nAnswer:",
    "Write a Python function that returns the factorial of n.\n",
    "The three most important inventions of the 20th century are",
    "Q: Tom has 3 apples and buys 5 more. How many apples does he have?\nA:",
    "Translate to French: The weather is nice today.\nFrench:",
    "Once upon a time, in a small village by the sea,",
]


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


def run_bench(cfg: EnsembleConfig, *, max_new_tokens: int = 32, repeats: int = 3, thresholds=(0.3, 0.5, 0.7),
              quick: bool = False, json_path: str | None = None) -> list[dict]:
    from tqdm.auto import tqdm

    from tokenfuse.alignment.union import build_union
    from tokenfuse.bundled import BUNDLED, MARK_MODEL
    from tokenfuse.load import load_member
    from tokenfuse.paths import cache_dir

    root = cache_dir(cfg.cache_dir)
    prompts = PROMPTS[:2] if quick else PROMPTS
    members, loads = [], {}
    for i, mc in enumerate(cfg.members):
        t0 = time.perf_counter()
        m = load_member(mc, root=root, index=i)
        loads[mc.name] = {"warm_load_s": round(time.perf_counter() - t0, 3)}
        src = mc.resolved_source
        if src in BUNDLED and (mark := BUNDLED[src].model_dir(root) / MARK_MODEL).exists():
            loads[mc.name]["cold_convert_s"] = json.loads(mark.read_text())["seconds"]
        members.append(m)

    codecs = [m.codec for m in members]
    t0 = time.perf_counter()
    build_union(codecs, cache=None)
    union_cold = time.perf_counter() - t0
    union_cached = build_union(codecs, cache=root / "alignment").build_seconds

    rows: list[tuple[str, Ensemble]] = [(m.name, Ensemble([m], align_cache=root / "alignment")) for m in members]
    if len(members) > 1:
        rows.append(("gac", Ensemble(members, align_cache=root / "alignment")))
        gate = members[0].name
        rows += [(f"gac-t{t}", Ensemble(members, gate=gate, threshold=t, align_cache=root / "alignment"))
                 for t in thresholds]

    samples: dict[str, list[dict]] = {name: [] for name, _ in rows}
    for _, ens in rows:  # warm-up
        ens.generate(prompts[0], max_new_tokens=4)
    total = repeats * len(prompts) * len(rows)
    with tqdm(total=total, desc="bench", unit="gen") as bar:
        for _ in range(repeats):
            for p in prompts:
                for name, ens in rows:
                    g = ens.generate(p, max_new_tokens=max_new_tokens, sampling=Sampling())
                    n = max(g.steps, 1)
                    samples[name].append({"ms": 1000 * g.timings["total"] / n, "steps": g.steps,
                                          "ens": g.ensembled_steps,
                                          **{k: 1000 * g.timings[k] / n for k in (*STAGES, "other")}})
                    bar.update(1)

    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    table = []
    for name, ens in rows:
        s = samples[name]
        ms = [x["ms"] for x in s]
        steps = sum(x["steps"] for x in s)
        stage = {k: round(statistics.median(x[k] for x in s), 3) for k in (*STAGES, "other")}
        outside = stage["align"] + stage["combine"] + stage["resync"] + stage["choose"] + stage["other"]
        table.append({
            "name": name,
            "members": [m.name for m in ens.members],
            "backend": "transformers",
            "gate": ens.members[ens.gate].name if ens.gate is not None else None,
            "threshold": ens.threshold,
            "ms_per_token": round(statistics.median(ms), 2),
            "ms_per_token_p90": round(_p90(ms), 2),
            "tokens_per_s": round(1000 / statistics.median(ms), 2),
            "stage_ms": stage,
            "outside_forward_share": round(outside / max(stage["forward"], 1e-9), 4),
            "ensembled_share": round(sum(x["ens"] for x in s) / max(steps, 1), 4),
            "steps": steps,
        })
    result = {"rows": table, "loads": loads, "union_size": len(rows[-1][1].union),
              "union_build_cold_s": round(union_cold, 3), "union_build_cached_s": round(union_cached, 3),
              "peak_rss_mb": round(peak_mb, 1), "max_new_tokens": max_new_tokens, "repeats": repeats,
              "prompts": len(prompts)}
    _print(result)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    return table


def _print(result: dict) -> None:
    rows = result["rows"]
    singles = {r["name"]: r["ms_per_token"] for r in rows if len(r["members"]) == 1}
    print(f"\n{'config':24} {'ms/tok':>8} {'p90':>8} {'tok/s':>7} {'fwd':>8} {'outside':>8} {'ens%':>6}  vs")
    for r in rows:
        ref = ""
        if r["name"] == "gac":
            ref = f"{r['ms_per_token'] / sum(singles.values()):.3f}x sum of members"
        elif r["gate"]:
            ref = f"{r['ms_per_token'] / singles[r['gate']]:.3f}x gate alone"
        print(f"{r['name']:24} {r['ms_per_token']:8.2f} {r['ms_per_token_p90']:8.2f} {r['tokens_per_s']:7.2f} "
              f"{r['stage_ms']['forward']:8.2f} {100 * r['outside_forward_share']:7.2f}% "
              f"{100 * r['ensembled_share']:5.1f}%  {ref}")
    print("\nloads:", json.dumps(result["loads"]))
    print(f"union: {result['union_size']} entries; build cold {result['union_build_cold_s']} s, "
          f"cached {result['union_build_cached_s']} s; peak RSS {result['peak_rss_mb']} MB")
