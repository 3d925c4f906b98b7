"""Does a llama.cpp member's next-token distribution depend on what else is in its decode batch?

Step batching (one decode call per member per step for every running sequence) keeps the
"batch = one by one" guarantee only if it does not. For each bundled member this prefills four
prompts as four sequences of one context (``n_seq_max`` 8; unified and per-sequence KV cache),
then decodes their next token in calls of different composition, and prints the largest
|Δ logit| of a sequence's row between: alone in the multi-sequence context and alone in its own
context; in a 4-row batch and alone; a 4-row batch and the same rows reversed; an 8-row batch and
a 4-row one; an 8-row batch and the same reversed; an 8-row call shared with 7 rows of another
sequence's feed and the 8-row batch. 0 everywhere means batching cannot change an output.
Then, per-sequence KV cache: the largest |Δ logit| of a row decoded in a batch of n sequences
against the same row decoded alone, for n = 1..9, and of each position of one sequence fed in calls
of c ids against one id per call, for c = 2..9. Last, one sequence past 512 cached positions, on
one thread and on two: calls of c ids against one id per call, and one id per call on one thread
against two (with an F16 KV cache llama.cpp's attention splits a one-id call's positions among the
threads from 512 on; ``exact_calls`` keeps the cache in BF16, which never takes that path).

``--exact`` loads the members as ``exact_calls: true`` does (flash attention on, weights not
repacked, BF16 KV cache): measured on the bundled files, batches and calls of at most 7 ids then
give every row the one-id numbers (0 up to 7, non-zero from 8 for Gemma-3 and Qwen), past 512
positions and on either thread count too.

``--f16-kv`` (with ``--exact``) keeps the F16 KV cache ``exact_calls`` used before, to see the
thread-split path past 512 positions.

Usage: .venv/bin/python scripts/measure/measure_batch_invariance.py [--exact [--f16-kv]]
"""

from __future__ import annotations

import argparse

import numpy as np

from tokenfuse.bundled import DEFAULT_ENSEMBLE
from tokenfuse.config import MemberConfig
from tokenfuse.load import load_member

PROMPTS = ["Question: What is the capital of France?\nAnswer: The capital",
           "def fibonacci(n):\n    if n < 2:\n        return",
           "The quick brown fox jumps over the lazy dog and then",
           "Once upon a time there was a little girl who lived in a"]
NS = 16  # sequence ids of the multi-sequence context


class Probe:
    def __init__(self, member) -> None:
        from llama_cpp._internals import LlamaBatch

        self.m = member
        self.ids = [member.encode_prompt(p) for p in PROMPTS]
        self.batch = LlamaBatch(n_tokens=512, embd=0, n_seq_max=1, verbose=False)

    def context(self, n_seq: int, unified: bool, n_ctx: int = 512):
        from llama_cpp._internals import LlamaContext

        params = type(self.m.llm.context_params).from_buffer_copy(self.m.llm.context_params)
        params.n_seq_max, params.kv_unified, params.n_ctx = n_seq, unified, n_ctx * n_seq
        return LlamaContext(model=self.m.llm._model, params=params, verbose=False)

    def decode(self, ctx, rows) -> None:
        b = self.batch.batch
        for j, (tok, pos, seq, want) in enumerate(rows):
            b.token[j], b.pos[j], b.seq_id[j][0], b.n_seq_id[j], b.logits[j] = tok, pos, seq, 1, want
        b.n_tokens = len(rows)
        ctx.decode(self.batch)

    def last(self, seq: int):
        ids = self.ids[seq % len(PROMPTS)]
        return ids[-1], len(ids) - 1, seq, True

    def run(self, ctx, seqs, rows) -> dict[int, np.ndarray]:
        """Prefill ``seqs`` (all but their last id, each alone), then decode ``rows`` in one call."""
        for s in range(NS):
            ctx.kv_cache_seq_rm(s, 0, -1)
        for s in seqs:
            self.decode(ctx, [(t, p, s, False) for p, t in enumerate(self.ids[s % len(PROMPTS)][:-1])])
        self.decode(ctx, rows)
        return {r[2]: np.ctypeslib.as_array(ctx.get_logits_ith(j), shape=(self.m.n_vocab,)).copy()
                for j, r in enumerate(rows) if r[3]}


def diff(a: dict, b: dict) -> float:
    return max(float(np.abs(a[s] - b[s]).max()) for s in a if s in b)


def sweep(p: Probe) -> tuple[str, str]:
    """Batches of n sequences and calls of c ids of one sequence against one row / one id per call."""
    ctx = p.context(NS, False)
    alone = {s: p.run(ctx, [s], [p.last(s)])[s] for s in range(4)}
    batches = []
    for n in range(1, 10):
        r = p.run(ctx, range(n), [p.last(s) for s in range(n)])
        batches.append(f"{n}:{diff({s: r[s] for s in range(min(n, 4))}, alone):.3g}")
    ids = p.ids[1] + p.ids[2] + p.ids[3]
    ctx1 = p.context(1, False)

    def fed_in(c: int) -> list[np.ndarray]:
        ctx1.kv_cache_seq_rm(0, 0, -1)
        p.decode(ctx1, [(t, i, 0, False) for i, t in enumerate(ids[:8])])
        rows = []
        for j in range(8, len(ids), c):
            part = [(ids[k], k, 0, True) for k in range(j, min(j + c, len(ids)))]
            p.decode(ctx1, part)
            rows += [np.ctypeslib.as_array(ctx1.get_logits_ith(i), shape=(p.m.n_vocab,)).copy() for i in range(len(part))]
        return rows

    one = fed_in(1)
    calls = [f"{c}:{max(float(np.abs(a - b).max()) for a, b in zip(one, fed_in(c))):.3g}" for c in range(2, 10)]
    return " ".join(batches), " ".join(calls)


def long_calls(p: Probe) -> str:
    """One sequence past 512 cached positions: calls of c ids against one id per call on 1 and 2
    threads, and one id per call on 1 thread against 2."""
    import llama_cpp

    ids = (p.ids[0] + p.ids[1] + p.ids[2] + p.ids[3]) * 40
    head, tail = ids[:520], ids[520:534]
    ctx = p.context(1, False, n_ctx=1024)

    def fed_in(c: int, threads: int) -> list[np.ndarray]:
        llama_cpp.llama_set_n_threads(ctx.ctx, threads, threads)
        ctx.kv_cache_seq_rm(0, 0, -1)
        for j in range(0, len(head), 256):
            p.decode(ctx, [(t, j + i, 0, False) for i, t in enumerate(head[j:j + 256])])
        rows = []
        for j in range(0, len(tail), c):
            part = [(tail[k], len(head) + k, 0, True) for k in range(j, min(j + c, len(tail)))]
            p.decode(ctx, part)
            rows += [np.ctypeslib.as_array(ctx.get_logits_ith(i), shape=(p.m.n_vocab,)).copy() for i in range(len(part))]
        return rows

    def d(a: list, b: list) -> str:
        return f"{max(float(np.abs(x - y).max()) for x, y in zip(a, b)):.3g}"

    one = {t: fed_in(1, t) for t in (1, 2)}
    out = [f"{t} thread(s) " + " ".join(f"{c}:{d(one[t], fed_in(c, t))}" for c in (2, 4, 7)) for t in (1, 2)]
    return "; ".join(out) + f"; one id per call, 1 vs 2 threads {d(one[1], one[2])}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exact", action="store_true", help="load as exact_calls: true does")
    ap.add_argument("--f16-kv", action="store_true", help="with --exact: an F16 KV cache instead of BF16")
    args = ap.parse_args()
    exact = args.exact
    if args.f16_kv:
        import tokenfuse.members.llamacpp as backend

        backend.EXACT_KV_TYPE = 1  # GGML_TYPE_F16
    for name in DEFAULT_ENSEMBLE:
        m = load_member(MemberConfig(name=name, prefix_cache=False, n_threads=1, exact_calls=exact), progress=False)
        p = Probe(m)
        own = p.run(p.context(1, False), [0], [p.last(0)])
        extra = m.codec.encode_text(" and the rest of the story goes like this")[:6]
        feed = [(t, len(p.ids[1]) - 1 + j, 1, False) for j, t in enumerate([p.ids[1][-1]] + extra)]
        for unified in (False, True):
            ctx = p.context(NS, unified)
            alone = p.run(ctx, [0], [p.last(0)])
            four = p.run(ctx, range(4), [p.last(s) for s in range(4)])
            four_rev = p.run(ctx, range(4), [p.last(s) for s in reversed(range(4))])
            eight = p.run(ctx, range(8), [p.last(s) for s in range(8)])
            eight_rev = p.run(ctx, range(8), [p.last(s) for s in reversed(range(8))])
            shared = p.run(ctx, [0, 1], [p.last(0)] + feed)
            print(f"{name:30s} {'unified' if unified else 'per-seq'} KV: own context {diff(alone, own):.3g}  "
                  f"4-row vs alone {diff(four, alone):.3g}  4-row reversed {diff(four, four_rev):.3g}  "
                  f"8-row vs 4-row {diff(eight, four):.3g}  8-row reversed {diff(eight, eight_rev):.3g}  "
                  f"8-row with another's feed {diff(shared, eight):.3g}", flush=True)
        batches, calls = sweep(p)
        print(f"{name:30s} batch of n vs alone  {batches}", flush=True)
        print(f"{name:30s} calls of c vs one id {calls}", flush=True)
        print(f"{name:30s} past 512 positions, calls of c vs one id: {long_calls(p)}", flush=True)


if __name__ == "__main__":
    main()
