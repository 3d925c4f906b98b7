#!/usr/bin/env python
"""Batch of 4 prompts: one llama.cpp context per sequence vs one multi-sequence context."""
import statistics, time
from tokenfuse.bundled import BUNDLED
from tokenfuse.members.gguf_tokenizer import ensure_tokenizer
from tokenfuse.members.llamacpp import load_llamacpp_member
from tokenfuse import Ensemble
from tokenfuse.paths import cache_dir
root = cache_dir()
P = ["Question: What is the capital of France?\nAnswer:", "def fibonacci(n):", "The quick brown fox", "Once upon a time"]
for n in BUNDLED:
    ms = {mode: load_llamacpp_member(n, BUNDLED[n].gguf_path(root), tokenizer_dir=ensure_tokenizer(n),
                                     multi_seq=mode, align_cache=root / "alignment") for mode in (0, 4)}
    times = {0: [], 4: []}
    outs = {}
    for rep in range(3):
        for mode, m in ms.items():
            e = Ensemble([m])
            t = time.perf_counter(); g = e.generate(P, max_new_tokens=24); dt = time.perf_counter() - t
            times[mode].append(1000 * dt / sum(x.steps for x in g)); outs[mode] = [x.output for x in g]
    same = sum(a == b for a, b in zip(outs[0], outs[4]))
    print(f"{n}: contexts {statistics.median(times[0]):.2f} ms/token, multi_seq {statistics.median(times[4]):.2f} ms/token "
          f"(batch of 4, 24 pieces, incl. prefill); identical outputs {same}/4")
