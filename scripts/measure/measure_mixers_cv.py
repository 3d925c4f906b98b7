#!/usr/bin/env python
"""The byte rows' mixers cross-validated on a ``text-bytes`` run's dev views alone (no test document read):
the dev documents in ``--folds`` folds by document (document ``i`` in fold ``i mod folds``), each fold's
rows fit on the others (``text_rows.fit_bytes``) and scored on it; prints and writes each row's bits per
byte over all dev bytes and its gain over the best member's own byte view, with each fold's fitted
``switch`` share and ``online`` rate.

    .venv/bin/python scripts/measure/measure_mixers_cv.py --run docs/results/text-bytes-defer \\
        --json docs/benchmarks/dev-mixers-cv.json

CPU only, a few minutes (the gate's fit per fold).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from tokenfuse.engine.text_rows import BYTE_ROWS, byte_logprobs, fit_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a text-bytes run's --out (its bytes/dev views)")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    paths = sorted((Path(args.run) / "bytes" / "dev").glob("*.npz"))
    views = [np.load(p) for p in paths]
    m = sum(1 for k in views[0].files if k.startswith("q"))
    docs = [np.exp(np.stack([v[f"q{i}"] for i in range(m)], axis=1)) for v in views]
    totals = {f"bytes:{i}": 0.0 for i in range(m)} | {row: 0.0 for row in BYTE_ROWS}
    folds = []
    for k in range(args.folds):
        held = set(range(k, len(docs), args.folds))
        fitted = fit_bytes([d for i, d in enumerate(docs) if i not in held])
        folds.append({"documents": len(held), "switch_alpha": fitted["byte-switch"].alpha,
                      "online_rate": fitted["byte-online"].rate})
        for i in held:
            for j in range(m):
                totals[f"bytes:{j}"] += float(np.log(docs[i][:, j]).sum())
            for row in BYTE_ROWS:
                totals[row] += float(byte_logprobs(row, docs[i], fitted[row]).sum())
        print(f"fold {k}: {folds[-1]}", flush=True)
    n = sum(len(d) for d in docs)
    best = max(totals[f"bytes:{j}"] for j in range(m))
    rows = {key: {"bits_per_byte": round(-v / n / math.log(2), 5), "gain_vs_best_member_pct": round(100 * (1 - v / best), 3)}
            for key, v in totals.items()}
    for key, r in rows.items():
        print(f"{key:12s} {r['bits_per_byte']:.4f} bits/byte  {r['gain_vs_best_member_pct']:+.3f} %")
    if args.json:
        Path(args.json).write_text(json.dumps({"run": args.run, "dev_documents": len(docs), "dev_bytes": n,
                                               "folds": folds, "rows": rows,
                                               "command": "scripts/measure/measure_mixers_cv.py --run " + args.run},
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
