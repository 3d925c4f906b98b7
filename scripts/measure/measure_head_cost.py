#!/usr/bin/env python
"""What exact scoring costs over a prefill on llama.cpp, per bundled member: one decode call of the
same 512 ids (the start of the first dev text document) keeping the logits of the last position only
(a prefill) against keeping every position's (scoring: each position's log-probability needs the
whole row's log-sum-exp, so the output layer runs on every position), and the log-softmax of those
rows, each row's one entry taken (``LlamaCppMember._logprobs`` with ``ids``).

    TOKENFUSE_DATA=../shared/benchmarks .venv/bin/python scripts/measure/measure_head_cost.py [--rounds 3]

The last figure, (every position + log-softmax) / last only, bounds how close a member's scoring
can come to its prefill: its inverse is the best "speed vs prefill" exact scoring can reach.
Medians of ``--rounds`` rounds, interleaved; run it on an idle machine (wall-clock times).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenfuse.bundled import BUNDLED
from tokenfuse.config import MemberConfig
from tokenfuse.engine.text_features import primary_tokens
from tokenfuse.load import load_member
from tokenfuse.members.llamacpp_shared import put_token
from tokenfuse.tasks.text import load_documents


def measure(source: str, text: str, rounds: int) -> str:
    m = load_member(MemberConfig(name=source, source=source, backend="llamacpp"), progress=False)
    try:
        ids = (m.encode_prompt("") + primary_tokens(m.codec, text))[:512]
        m.release(m.new_state(ids[:1]))  # one pooled context
        slot = m._free[0]

        def decode(every: bool) -> tuple[float, float]:
            slot.crop(0)
            b = slot.batch.batch
            for j, t in enumerate(ids):
                put_token(b, j, t, j, 0)
                b.logits[j] = every or j == len(ids) - 1
            b.n_tokens = len(ids)
            t0 = time.perf_counter()
            slot.ctx.decode(slot.batch)
            t1 = time.perf_counter()
            if every:
                for i in range(len(ids) - 1):
                    m._logprobs(slot.ctx, i, torch.tensor([ids[i + 1]]))
            return t1 - t0, time.perf_counter() - t1

        got = {False: [], True: []}
        for _ in range(rounds):
            for every in (False, True):
                got[every].append(decode(every))
        last = statistics.median(d for d, _ in got[False])
        every = statistics.median(d for d, _ in got[True])
        soft = statistics.median(s for _, s in got[True])
        return (f"{source}: {len(ids)} ids, vocabulary {m.n_vocab:,}: decode keeping the last logits {last:.3f} s, "
                f"every position's {every:.3f} s ({every / last:.2f}x), their log-softmax {soft:.3f} s; "
                f"scoring / prefill >= {(every + soft) / last:.2f} (speed vs prefill <= {last / (every + soft):.2f})")
    finally:
        m.unload()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    text = load_documents("dev")[0].text
    for source in BUNDLED:
        print(measure(source, text, args.rounds), flush=True)


if __name__ == "__main__":
    main()
