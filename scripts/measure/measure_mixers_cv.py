#!/usr/bin/env python
"""The byte rows' mixers cross-validated on a ``text-bytes`` run's dev views alone (no test document read):
the dev documents in ``--folds`` folds by document (document ``i`` in fold ``i mod folds``), each fold's
rows fit on the others (``text_rows.fit_bytes``) and scored on it; prints and writes each row's bits per
byte over all dev bytes and its gain over the best member's own byte view, with each fold's fitted
``switch`` share and ``online`` rate.

With ``--prompt N`` it asks instead whether the gate should read a prompt before it mixes (the ``byte``
method's generation starts its features at zero after the prompt): each document's first ``N`` bytes
are the prompt and only the rest is scored, the gate and online rows fit and run with their features
starting at zero after the prompt (``-zero``) or having read it (``-read``: ``fit_gate``'s ``starts``),
against the mixture and the best member per document.

    .venv/bin/python scripts/measure/measure_mixers_cv.py --run docs/results/text-bytes-defer \\
        --json docs/benchmarks/dev-mixers-cv.json
    .venv/bin/python scripts/measure/measure_mixers_cv.py --run docs/results/text-bytes-defer --prompt 512 \\
        --json docs/benchmarks/dev-gate-prompt.json

CPU only, a few minutes (the gate's fit per fold).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from tokenfuse.combiners.mixers import Fitted, best_rate, em_weights, fit_gate, mixed_logprobs
from tokenfuse.engine.text_rows import BYTE_ROWS, byte_logprobs, fit_bytes


def prompt_rows(train: list[np.ndarray], held: list[np.ndarray], prompt: int) -> dict[str, float]:
    """``--prompt``: each row's log-probability of the held documents after their first ``prompt`` bytes."""
    rest = [d[prompt:] for d in train]
    with np.errstate(divide="ignore"):
        w = em_weights(np.log(np.concatenate(rest)))
    zero, read = fit_gate(rest, w), fit_gate(train, w, [prompt] * len(train))
    rates = best_rate(rest, zero), best_rate(train, read, [prompt] * len(train))
    out = {"best-member": 0.0, "byte-mix": 0.0, "gate-zero": 0.0, "gate-read": 0.0, "online-zero": 0.0,
           "online-read": 0.0}
    for d in held:
        out["best-member"] += max(float(np.log(d[prompt:, j]).sum()) for j in range(d.shape[1]))
        out["byte-mix"] += float(mixed_logprobs("mixture", d[prompt:], Fitted(weights=w)).sum())
        out["gate-zero"] += float(mixed_logprobs("gate", d[prompt:], Fitted(gate=zero)).sum())
        out["gate-read"] += float(mixed_logprobs("gate", d, Fitted(gate=read))[prompt:].sum())
        out["online-zero"] += float(mixed_logprobs("online", d[prompt:], Fitted(gate=zero, rate=rates[0])).sum())
        out["online-read"] += float(mixed_logprobs("online", d, Fitted(gate=read, rate=rates[1]))[prompt:].sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a text-bytes run's --out (its bytes/dev views)")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--prompt", type=int, help="score after each document's first PROMPT bytes, the gate reading them "
                                               "or not (documents shorter than PROMPT + 256 bytes left out)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    paths = sorted((Path(args.run) / "bytes" / "dev").glob("*.npz"))
    views = [np.load(p) for p in paths]
    m = sum(1 for k in views[0].files if k.startswith("q"))
    docs = [np.exp(np.stack([v[f"q{i}"] for i in range(m)], axis=1)) for v in views]
    if args.prompt:
        docs = [d for d in docs if len(d) > args.prompt + 256]
        totals: dict[str, float] = {}
        for k in range(args.folds):
            held = set(range(k, len(docs), args.folds))
            got = prompt_rows([d for i, d in enumerate(docs) if i not in held], [docs[i] for i in held], args.prompt)
            totals = {key: totals.get(key, 0.0) + v for key, v in got.items()}
            print(f"fold {k} done", flush=True)
        report(args, totals, sum(len(d) - args.prompt for d in docs), len(docs), "best-member", [])
        return
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
    report(args, totals, sum(len(d) for d in docs), len(docs), max(totals[f"bytes:{j}"] for j in range(m)), folds)


def report(args: argparse.Namespace, totals: dict[str, float], n: int, n_docs: int, best: str | float,
           folds: list) -> None:
    """Print and write each row's bits per byte and gain over ``best`` (a row's name or a total)."""
    best = totals[best] if isinstance(best, str) else best
    rows = {key: {"bits_per_byte": round(-v / n / math.log(2), 5), "gain_vs_best_member_pct": round(100 * (1 - v / best), 3)}
            for key, v in totals.items()}
    for key, r in rows.items():
        print(f"{key:12s} {r['bits_per_byte']:.4f} bits/byte  {r['gain_vs_best_member_pct']:+.3f} %")
    if args.json:
        cmd = f"scripts/measure/measure_mixers_cv.py --run {args.run}" + (f" --prompt {args.prompt}" if args.prompt else "")
        Path(args.json).write_text(json.dumps({"run": args.run, "dev_documents": n_docs, "bytes_scored": n,
                                               "prompt_bytes": args.prompt, "folds": folds, "rows": rows,
                                               "command": cmd}, indent=1) + "\n")


if __name__ == "__main__":
    main()
