"""The cost of a k-position forward against a one-position one, per bundled llama.cpp member.

What speculative decoding would pay for verifying k drafted positions in one call: after a prompt is
prefilled, each member feeds k more ids in one call keeping the logits of all k positions
(``Member.logprobs_at``), rolled back and repeated; the median ms per call and its ratio to k = 1 are
printed, with the member on one thread (members side by side) and on every core (a member alone).
``--exact`` loads the members with ``exact_calls`` (weights as stored, flash attention, BF16 KV cache:
what a shared context's calls of at most 7 rows cost there).

Usage: .venv/bin/python scripts/measure/measure_chunk_cost.py [--ks 1,2,4,8,16] [--repeats 15] [--exact]
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenfuse.bundled import DEFAULT_ENSEMBLE
from tokenfuse.config import MemberConfig
from tokenfuse.load import load_member
from tokenfuse.members.base import cpu_cores

PROMPT = ("Question: A student measures the mass of a rock, then breaks it into three pieces and measures "
          "each piece. What will the total mass of the pieces be?\nAnswer: the same as the mass of the rock, "
          "because mass is conserved when")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--exact", action="store_true", help="members with exact_calls: true")
    a = ap.parse_args()
    ks = [int(k) for k in a.ks.split(",")]
    for name in DEFAULT_ENSEMBLE:
        m = load_member(MemberConfig(name=name, prefix_cache=False, exact_calls=a.exact), progress=False)
        ids = m.encode_prompt(PROMPT)
        cut = len(ids) - max(ks)
        for threads in sorted({1, cpu_cores()}):
            m.share_cores(threads)
            st = m.new_state(ids[:cut])
            m.next_logprobs([st])
            ms = {}
            for k in ks:
                runs = []
                for _ in range(a.repeats):
                    st.ids, st.n_valid = list(ids[cut:cut + k]), cut
                    t = time.perf_counter()
                    m.logprobs_at(st, list(range(cut + 1, cut + k + 1)))
                    runs.append(1000 * (time.perf_counter() - t))
                ms[k] = statistics.median(runs)
            m.release(st)
            print(f"{name:30s} {threads} thread(s): " + "  ".join(
                f"k={k} {ms[k]:6.1f} ms ({ms[k] / ms[ks[0]]:.2f}x)" for k in ks), flush=True)


if __name__ == "__main__":
    main()
