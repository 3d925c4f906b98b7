#!/usr/bin/env python
"""What one row costs through a bundled member's tree reader (members/llamacpp_tree.py), by how many rows
share the decode call, against a prefill position: what bounds the cost of a byte view (a row at almost
every byte under the top rule, alignment/byteview.py) against the member's own scoring.

For each member: its own tokens of the first dev document of the second domain (the first ``--tokens``)
as the trunk, then calls of ``k`` branches one id off it at random points (``k`` = 1 … 62; the median of
``--repeats`` calls), then the whole trunk fed in one call with every position's row (a prefill with
all rows, as the member's own scoring reads them). Wall clock, one process, alone on the machine:

    TOKENFUSE_DATA=../shared/benchmarks .venv/bin/python scripts/measure/measure_tree_calls.py [--tokens 600] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from tokenfuse.bundled import BUNDLED
from tokenfuse.config import MemberConfig
from tokenfuse.engine.text_features import primary_tokens
from tokenfuse.eval.text import per_domain
from tokenfuse.load import load_member
from tokenfuse.members.llamacpp_tree import TreeReader
from tokenfuse.tasks.text import load_documents

SIZES = (1, 2, 4, 8, 16, 32, 62)


def measure(source: str, text: str, n_tokens: int, repeats: int) -> dict:
    m = load_member(MemberConfig(name=source, source=source, backend="llamacpp"), progress=False)
    try:
        start = m.encode_prompt("")
        trunk = start + primary_tokens(m.codec, text)[:n_tokens]
        rng = np.random.default_rng(0)
        reader = TreeReader(m)
        reader.take([trunk], [[0]])
        out = {"member": source, "trunk": len(trunk), "calls": []}
        for k in SIZES:
            times = []
            for _ in range(repeats):
                points = rng.integers(len(start), len(trunk), size=k)
                lists = [trunk[:p] + [int(rng.integers(100, 1000))] for p in points]
                t0 = time.perf_counter()
                reader.take(lists, [[1, 2, 3]] * k)
                times.append(time.perf_counter() - t0)
            ms = 1000 * statistics.median(times)
            out["calls"].append({"branches": k, "ms_per_call": ms, "ms_per_row": ms / k})
            print(f"{source}: trunk {len(trunk)}, {k} branches: {ms:.1f} ms a call, {ms / k:.2f} ms a row", flush=True)
        reader.close()
        fresh = TreeReader(m)
        t0 = time.perf_counter()
        fresh.take([trunk[:j] for j in range(len(start), len(trunk) + 1)], [[1]] * (len(trunk) - len(start) + 1))
        out["prefill_ms_per_token"] = 1000 * (time.perf_counter() - t0) / (len(trunk) - len(start))
        fresh.close()
        print(f"{source}: prefill with every row {out['prefill_ms_per_token']:.2f} ms a token", flush=True)
        return out
    finally:
        m.unload()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    text = per_domain(load_documents("dev"), 1)[1].text
    got = [measure(source, text, args.tokens, args.repeats) for source in BUNDLED]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "repeats": args.repeats, "members": got}, f, indent=1)


if __name__ == "__main__":
    main()
