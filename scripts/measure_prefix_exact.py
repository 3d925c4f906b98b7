"""Is a reused llama.cpp prefix the very computation of a fresh prefill (the prefix cache's rule)?

Per bundled model (and flash attention off / on): a donor sequence (few-shot context + option A)
is prefilled in one call; for every other option (with and without a few more words) and every
reuse point b (a multiple of 8 with at least 8 ids left to feed), the donor's cache is cut at b and
the rest fed in one call. Prints how many of those reuses give next-token logits that differ at
all from a fresh one-call prefill (the rule in members/llamacpp.py, ``BLOCK``, needs 0).

Usage: .venv/bin/python scripts/measure_prefix_exact.py [model ...] [--fa 0,1]
"""

from __future__ import annotations

import argparse

import numpy as np

from tokenfuse.bundled import DEFAULT_ENSEMBLE
from tokenfuse.config import MemberConfig
from tokenfuse.load import load_member

SHOTS = ("Question: Which of these is a bird? Options: eagle, bat, bee, fly.\nAnswer: eagle\n\n"
         "Question: Which of these is a fish? Options: cod, seal, crab, frog.\nAnswer: cod\n\n")
CONTEXT = "Question: Which of these is a mammal? Options: whale, shark, trout, squid.\nAnswer:"
OPTIONS = [" whale", " shark", " trout", " squid"]


def check(name: str, fa: bool) -> tuple[int, int]:
    import llama_cpp
    from llama_cpp._internals import LlamaBatch, LlamaContext

    m = load_member(MemberConfig(name=name, backend="llamacpp"), progress=False)
    cp = type(m.llm.context_params).from_buffer_copy(m.llm.context_params)
    cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = LlamaContext(model=m.llm._model, params=cp, verbose=False)
    batch = LlamaBatch(n_tokens=512, embd=0, n_seq_max=1, verbose=False)

    def feed(ids: list[int], p0: int) -> np.ndarray:
        b = batch.batch
        for j, t in enumerate(ids):
            b.token[j], b.pos[j], b.seq_id[j][0], b.n_seq_id[j], b.logits[j] = t, p0 + j, 0, 1, j == len(ids) - 1
        b.n_tokens = len(ids)
        ctx.decode(batch)
        return np.ctypeslib.as_array(ctx.get_logits_ith(len(ids) - 1), shape=(m.n_vocab,)).copy()

    bad = total = 0
    for shots in (SHOTS, SHOTS * 3):
        donor = m.encode_prompt(shots + CONTEXT + OPTIONS[0])
        for option in OPTIONS[1:]:
            for extra in ("", " and a"):
                ids = m.encode_prompt(shots + CONTEXT + option + extra)
                ctx.kv_cache_seq_rm(0, 0, -1)
                fresh = feed(ids, 0)
                for b in range(8, len(ids) - 7, 8):
                    ctx.kv_cache_seq_rm(0, 0, -1)
                    feed(donor, 0)
                    ctx.kv_cache_seq_rm(0, b, -1)
                    total += 1
                    bad += bool(np.abs(feed(ids[b:], b) - fresh).max() > 0)
    return bad, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=list(DEFAULT_ENSEMBLE))
    ap.add_argument("--fa", default="0,1")
    a = ap.parse_args()
    for name in a.models:
        for fa in (bool(int(x)) for x in a.fa.split(",")):
            bad, total = check(name, fa)
            print(f"{name:28s} flash_attn={int(fa)}: {bad}/{total} reuses differ from a fresh prefill", flush=True)


if __name__ == "__main__":
    main()
