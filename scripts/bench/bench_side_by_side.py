#!/usr/bin/env python
"""Seeded samples of GSM8K dev items (``tokenfuse eval``'s ``mux``/``sc`` draws) by each bundled
member alone: a batch's sequences one after another against side by side (``side_by_side``, the
cores split among them). Prints each member's best of two runs per mode and whether the samples are
the same. Usage: TOKENFUSE_DATA=../shared/benchmarks python scripts/bench/bench_side_by_side.py [SAMPLES] [TOKENS]
"""
import sys
import time

from tokenfuse.config import config_from_source
from tokenfuse.eval import answers
from tokenfuse.eval.methods import MethodSpec
from tokenfuse.eval.batches import build_variant
from tokenfuse.load import load_ensemble
from tokenfuse.tasks import load_task

n = int(sys.argv[1]) if len(sys.argv) > 1 else 15
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 64
cfg = config_from_source()
base = load_ensemble(cfg, progress=False)
task = load_task("gsm8k")
items = task.dev_subset(4, 1234)
for m in base.members:
    single = build_variant(cfg, base, MethodSpec(f"single:{m.name}", "engine", (m.name,)))

    def draw(its):
        return answers.draw(single, task, [(it, range(n)) for it in its], member=m.name, seed=1234,
                            temperature=0.7, max_new_tokens=tokens)

    draw(items[:1])  # the shots' prompt cache, warm for both modes
    runs = {}
    for side in (False, True, False, True):
        m.side_by_side = side
        t0 = time.perf_counter()
        out = draw(items[1:3])
        runs.setdefault(side, []).append((time.perf_counter() - t0, [o["outputs"] for o in out]))
    m.side_by_side = True
    seq, par = (min(t for t, _ in runs[s]) for s in (False, True))
    print(f"{m.name}: 2 items x {n} samples x {tokens} pieces: one after another {seq:.1f} s, side by side "
          f"{par:.1f} s ({seq / par:.2f}x); same samples: {runs[True][0][1] == runs[False][0][1]}", flush=True)
