"""Does llama.cpp give the same numbers however a sequence is split into decode calls?

For each bundled model and each set-up (weight repacking on/off, flash attention on/off), one
text of about 60 tokens is fed (a) as one chunk with logits at every position, (b) a 8-token
prompt then one token per call, (c) in chunks of 3, (d) in chunks of 16. Prints, per split, the
largest |Δ log-prob| and |Δ prob| over every position and vocabulary entry against (a), and the
ms per call of each split.

Usage: .venv/bin/python scripts/measure/measure_split.py [model ...] [--repack 0,1] [--fa 0,1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tokenfuse.bundled import BUNDLED, DEFAULT_ENSEMBLE
from tokenfuse.paths import cache_dir

TEXT = ("Question: Which of these is a mammal? A whale, a shark, a trout or a tuna.\n"
        "Answer: The whale is the mammal; it breathes air and feeds its young with milk. "
        "Sharks and tuna are fish.")


def run(path: str, repack: bool, fa: bool, splits: dict[str, list[int]], ids: list[int]):
    import llama_cpp
    from llama_cpp._internals import LlamaBatch, LlamaContext, LlamaModel

    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = repack
    model = LlamaModel(path_model=path, params=mp, verbose=False)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 512, 512, 512, 2, 2
    cp.swa_full = True
    cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = LlamaContext(model=model, params=cp, verbose=False)
    n_vocab = llama_cpp.llama_vocab_n_tokens(model.vocab)
    batch = LlamaBatch(n_tokens=512, embd=0, n_seq_max=1, verbose=False)
    out = {}
    for name, sizes in splits.items():
        ctx.kv_cache_clear() if hasattr(ctx, "kv_cache_clear") else ctx.kv_cache_seq_rm(0, 0, -1)
        ctx.kv_cache_seq_rm(0, 0, -1)
        rows, pos, times = [], 0, []
        for size in sizes:
            b = batch.batch
            for j in range(size):
                b.token[j], b.pos[j], b.seq_id[j][0], b.n_seq_id[j], b.logits[j] = ids[pos + j], pos + j, 0, 1, True
            b.n_tokens = size
            t = time.perf_counter()
            ctx.decode(batch)
            times.append(time.perf_counter() - t)
            for j in range(size):
                rows.append(np.ctypeslib.as_array(ctx.get_logits_ith(j), shape=(n_vocab,)).copy())
            pos += size
        lp = np.stack(rows).astype(np.float64)
        lp -= np.log(np.exp(lp - lp.max(-1, keepdims=True)).sum(-1, keepdims=True)) + lp.max(-1, keepdims=True)
        out[name] = (lp, times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=list(DEFAULT_ENSEMBLE))
    ap.add_argument("--repack", default="1,0")
    ap.add_argument("--fa", default="0,1")
    ap.add_argument("--sizes", default="", help="uniform chunk sizes to try instead of the default splits, e.g. 2,4,8")
    a = ap.parse_args()
    from tokenfuse.members.fasttok import FastTokenizer
    from tokenfuse.members.gguf_tokenizer import ensure_tokenizer

    for name in a.models:
        path = str(BUNDLED[name].gguf_path(cache_dir()))
        ids = FastTokenizer(ensure_tokenizer(name, progress=False))(TEXT)["input_ids"][:60]
        n = len(ids)
        splits = {"one chunk": [n], "8 + ones": [8] + [1] * (n - 8),
                  "chunks of 3": [3] * (n // 3) + ([n % 3] if n % 3 else []),
                  "chunks of 16": [16] * (n // 16) + ([n % 16] if n % 16 else [])}
        if a.sizes:
            splits = {"one chunk": [n]} | {f"chunks of {k}": [k] * (n // k) + ([n % k] if n % k else [])
                                           for k in map(int, a.sizes.split(","))}
        for repack in [bool(int(x)) for x in a.repack.split(",")]:
            for fa in [bool(int(x)) for x in a.fa.split(",")]:
                res = run(path, repack, fa, splits, ids)
                ref = res["one chunk"][0]
                for split, (lp, times) in res.items():
                    d_lp = np.abs(lp - ref).max()
                    d_p = np.abs(np.exp(lp) - np.exp(ref)).max()
                    print(f"{name:28s} repack={int(repack)} fa={int(fa)} {split:13s} max|Δlogp| {d_lp:.2e} "
                          f"max|Δp| {d_p:.2e}  {1000 * np.median(times):7.1f} ms/call (median), "
                          f"{1000 * sum(times):7.0f} ms total", flush=True)


if __name__ == "__main__":
    main()
