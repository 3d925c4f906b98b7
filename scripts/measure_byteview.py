#!/usr/bin/env python
"""What a member's byte-level view (alignment/byteview.py) costs and leaves out on real text, per bundled
member on llama.cpp: DEV documents only (the first ``--docs`` of each domain, their first ``--bytes``
bytes), for each pruning setting and rule for the pruned mass (top, reserve): bits per byte of the view against the member's own tokens, rows read
per byte, the largest share of a boundary's mass pruning left out, and seconds against the member's own
scoring of its tokens (one run, every position's row: ``single_logprobs``), read two ways: through the
member's tree reader with reading ahead (the default) and through sequence states without it (every row
a fresh prefill's; ``--states``).

    TOKENFUSE_DATA=../shared/benchmarks .venv/bin/python scripts/measure_byteview.py [--docs 1] [--bytes 300] [--states]

Wall-clock times of one run each (after one warm-up of the member's own scoring), members one after
another; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from tokenfuse.alignment.byteview import SPECULATE, TokenBytes, score_bytes
from tokenfuse.bundled import BUNDLED
from tokenfuse.config import MemberConfig
from tokenfuse.engine.text_features import Rows, primary_tokens
from tokenfuse.eval.text import per_domain, single_logprobs
from tokenfuse.load import load_member
from tokenfuse.tasks.text import load_documents

SETTINGS = ((1e-2, 1, False), (1e-2, 1, True))  # keep, width, reserve


def cut(text: str, n: int) -> str:
    """The first ``n`` bytes of ``text``, backed off to a whole UTF-8 character."""
    return text.encode("utf-8")[:n].decode("utf-8", "ignore")


class _NoTree:
    """The member without its tree reader (reads on sequence states)."""

    def __init__(self, member) -> None:
        self.member = member

    def __getattr__(self, name: str):
        return getattr(self.member, name)

    def tree_reader(self):
        return None


def measure(source: str, texts: list[str], states: bool) -> dict:
    m = load_member(MemberConfig(name=source, source=source, backend="llamacpp"), progress=False)
    try:
        rows = Rows.from_member(m)
        tokens = TokenBytes(m.codec.token_bytes)
        nbytes = sum(len(t.encode("utf-8")) for t in texts)
        for t in texts:  # warm-up
            single_logprobs(rows, t)
        t0 = time.perf_counter()
        own = sum(float(np.sum(single_logprobs(rows, t))) for t in texts)
        own_s = time.perf_counter() - t0
        out = {"member": source, "bytes": nbytes, "own_bpb": -own / math.log(2) / nbytes, "own_s": own_s,
               "settings": []}
        readers = [("tree", rows, True)] + ([("states", Rows.from_member(_NoTree(m)), False)] if states else [])
        for (keep, width, reserve), (how, reader, ahead) in ((kw, r) for kw in SETTINGS for r in readers):
            t0 = time.perf_counter()
            lp, read, pruned = 0.0, 0, 0.0
            for t in texts:
                with reader.reader() as take:
                    s = score_bytes(t.encode("utf-8"), tokens, rows.start, take,
                                    chain=primary_tokens(m.codec, t), keep=keep, width=width, prefetch=ahead,
                                    speculate=SPECULATE if ahead else 0,
                                    reserve=reserve)
                lp += float(s.logprobs.sum())
                read += s.histories
                pruned = max(pruned, s.pruned)
            sec = time.perf_counter() - t0
            rule = "reserve" if reserve else "top"
            out["settings"].append({"keep": keep, "width": width, "rule": rule, "reader": how,
                                    "bpb": -lp / math.log(2) / nbytes,
                                    "rows_per_byte": read / nbytes, "pruned": pruned, "s": sec,
                                    "vs_own": sec / own_s})
            print(f"{source}: keep {keep:g} width {width} {rule}, {how}: {out['settings'][-1]['bpb']:.4f} bpb "
                  f"(own tokens {out['own_bpb']:.4f}), {read / nbytes:.2f} rows/byte, pruned <= {pruned:.2e}, "
                  f"{sec:.1f} s = {sec / own_s:.2f}x its own scoring ({own_s:.1f} s)", flush=True)
        return out
    finally:
        m.unload()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=1)
    ap.add_argument("--bytes", type=int, default=300)
    ap.add_argument("--states", action="store_true", help="also read through sequence states, without reading ahead")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    texts = [cut(d.text, args.bytes) for d in per_domain(load_documents("dev"), args.docs)]
    got = [measure(source, texts, args.states) for source in BUNDLED]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"docs_per_domain": args.docs, "bytes_per_doc": args.bytes, "members": got}, f, indent=1)


if __name__ == "__main__":
    main()
