#!/usr/bin/env python
"""What a member's byte-level view (alignment/byteview.py) costs and leaves out on real text, per bundled
member on llama.cpp: DEV documents only (the first ``--docs`` of each domain, their first ``--bytes``
bytes), for each pruning setting: bits per byte of the view against the member's own tokens, rows read
per byte, the largest share of a boundary's mass pruning left out, and seconds against the member's own
scoring of its tokens (one run, every position's row: ``single_logprobs``).

    TOKENFUSE_DATA=../shared/benchmarks .venv/bin/python scripts/measure_byteview.py [--docs 1] [--bytes 400]

Wall-clock times of one run each, members one after another; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from tokenfuse.alignment.byteview import TokenBytes, score_bytes
from tokenfuse.bundled import BUNDLED
from tokenfuse.config import MemberConfig
from tokenfuse.engine.text_features import Rows, primary_tokens
from tokenfuse.eval.text import per_domain, single_logprobs
from tokenfuse.load import load_member
from tokenfuse.tasks.text import load_documents

SETTINGS = ((1e-2, 1), (1e-3, 2))


def cut(text: str, n: int) -> str:
    """The first ``n`` bytes of ``text``, backed off to a whole UTF-8 character."""
    return text.encode("utf-8")[:n].decode("utf-8", "ignore")


def measure(source: str, texts: list[str]) -> dict:
    m = load_member(MemberConfig(name=source, source=source, backend="llamacpp"), progress=False)
    try:
        rows = Rows.from_member(m)
        tokens = TokenBytes(m.codec.token_bytes)
        nbytes = sum(len(t.encode("utf-8")) for t in texts)
        t0 = time.perf_counter()
        own = sum(float(np.sum(single_logprobs(rows, t))) for t in texts)
        own_s = time.perf_counter() - t0
        out = {"member": source, "bytes": nbytes, "own_bpb": -own / math.log(2) / nbytes, "own_s": own_s,
               "settings": []}
        for keep, width in SETTINGS:
            t0 = time.perf_counter()
            lp, read, pruned = 0.0, 0, 0.0
            for t in texts:
                with rows.reader() as take:
                    s = score_bytes(t.encode("utf-8"), tokens, rows.start, take,
                                    chain=primary_tokens(m.codec, t), keep=keep, width=width)
                lp += float(s.logprobs.sum())
                read += s.histories
                pruned = max(pruned, s.pruned)
            sec = time.perf_counter() - t0
            out["settings"].append({"keep": keep, "width": width, "bpb": -lp / math.log(2) / nbytes,
                                    "rows_per_byte": read / nbytes, "pruned": pruned, "s": sec,
                                    "vs_own": sec / own_s})
            print(f"{source}: keep {keep:g} width {width}: {out['settings'][-1]['bpb']:.4f} bpb "
                  f"(own tokens {out['own_bpb']:.4f}), {read / nbytes:.2f} rows/byte, pruned <= {pruned:.2e}, "
                  f"{sec:.1f} s = {sec / own_s:.2f}x its own scoring ({own_s:.1f} s)", flush=True)
        return out
    finally:
        m.unload()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=1)
    ap.add_argument("--bytes", type=int, default=400)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    texts = [cut(d.text, args.bytes) for d in per_domain(load_documents("dev"), args.docs)]
    got = [measure(source, texts) for source in BUNDLED]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"docs_per_domain": args.docs, "bytes_per_doc": args.bytes, "members": got}, f, indent=1)


if __name__ == "__main__":
    main()
