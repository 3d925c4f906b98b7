#!/usr/bin/env python
"""Seconds per output byte of greedy ``byte`` generation against greedy GaC, on the bundled llama.cpp
members (the default ensemble), a few prompts: ``byte`` generates ``--bytes`` bytes, GaC ``--bytes // 3``
pieces; each time is the whole call over the bytes it produced, the second of two calls on the prompt
(so both find the prompt in the members' prefix caches alike). Prints each prompt's figures, the
median over the prompts of each method's seconds per byte and of their ratio, and the ``byte``
method's member rows read per byte (GaC reads one per member per piece). ``--width``, ``--keep``: the
byte views' pruning (default: the byte method's); ``--top``: the top rule instead of the reserve;
``--mix``: the byte method's mixers to time, comma-separated (each in the same run, against a GaC call
timed just before it on the same prompt; ``gate`` and ``online`` at the shipped fit of the bundled members).

    .venv/bin/python scripts/measure/measure_byte_generation.py [--bytes 200] [--mix mixture,gate] [--json out.json]

Wall-clock times of one run each; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tokenfuse.bundled import DEFAULT_ENSEMBLE
from tokenfuse.config import config_from_models
from tokenfuse.engine.bytegen import NOTE
from tokenfuse.load import load_ensemble

PROMPTS = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,")


def run_byte(ens, prompt: str, n: int) -> tuple[bytes, float, int]:
    """Greedy ``byte`` output for ``prompt`` (``n`` bytes at most), its seconds and the rows it read."""
    t0 = time.perf_counter()
    s = ens.open(prompt, max_new_tokens=n)
    try:
        while s.finished is None:
            ens.step([s])
        rows = sum(st.rows for st in s.notes[NOTE].states.values())
        return bytes(s.output), time.perf_counter() - t0, rows
    finally:
        ens.close(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=200)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--keep", type=float, default=None)
    ap.add_argument("--top", action="store_true", help="the top rule for the pruned mass (the text-bytes run's)")
    ap.add_argument("--mix", default="mixture", help="mixers to time, comma-separated (default: mixture)")
    args = ap.parse_args()
    mixes = [m.strip() for m in args.mix.split(",") if m.strip()]
    gac = load_ensemble(config_from_models(",".join(DEFAULT_ENSEMBLE)), progress=False)
    params = {k: v for k, v in (("width", args.width), ("keep", args.keep)) if v is not None}
    if args.top:
        params["rule"] = "top"
    variants = {mix: gac.variant(gac.options.replace(method="byte", params=params | {"mix": mix})) for mix in mixes}
    rows: dict[str, list[dict]] = {mix: [] for mix in mixes}
    for prompt in PROMPTS:
        for mix, byte in variants.items():
            for _ in range(2):  # the second call of each is timed
                t0 = time.perf_counter()
                g = gac.generate(prompt, max_new_tokens=max(1, args.bytes // 3))
                gac_s = time.perf_counter() - t0
                out, byte_s, read = run_byte(byte, prompt, args.bytes)
            r = {"prompt": prompt, "gac_bytes": len(g.output), "gac_s_per_byte": gac_s / max(1, len(g.output)),
                 "byte_bytes": len(out), "byte_s_per_byte": byte_s / max(1, len(out)),
                 "byte_rows_per_byte": read / max(1, len(out)), "byte_text": out.decode("utf-8"), "gac_text": g.text}
            r["ratio"] = r["byte_s_per_byte"] / r["gac_s_per_byte"]
            rows[mix].append(r)
            print(f"{prompt!r} [{mix}]: gac {r['gac_s_per_byte'] * 1e3:.1f} ms/byte ({r['gac_bytes']} bytes), byte "
                  f"{r['byte_s_per_byte'] * 1e3:.1f} ms/byte ({r['byte_bytes']} bytes, {r['byte_rows_per_byte']:.2f} "
                  f"rows/byte), ratio {r['ratio']:.2f}", flush=True)
    figures = {}
    for mix, byte in variants.items():
        summary = {k: statistics.median(r[k] for r in rows[mix])
                   for k in ("gac_s_per_byte", "byte_s_per_byte", "ratio", "byte_rows_per_byte")}
        print(f"median [{mix}]: gac {summary['gac_s_per_byte'] * 1e3:.1f} ms/byte, byte "
              f"{summary['byte_s_per_byte'] * 1e3:.1f} ms/byte, ratio {summary['ratio']:.2f}, "
              f"{summary['byte_rows_per_byte']:.2f} rows/byte")
        figures[mix] = {"params": byte.options.params, "prompts": rows[mix], "median": summary}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures[mixes[0]] if len(mixes) == 1 else figures, f, indent=1)
    gac.unload()


if __name__ == "__main__":
    main()
