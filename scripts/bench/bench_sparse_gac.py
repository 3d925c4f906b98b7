#!/usr/bin/env python
"""Greedy GaC with its argmax-only combination (``combiners.base.sparse_average``) against the dense
average over the whole union, in one process on the same loaded ensemble (the default config:
the bundled members on llama.cpp), rounds interleaved.

For each path: the bench's six prompts, ``--rounds`` rounds, ``--max-new-tokens`` pieces each;
per generation the decode-only stage times per piece (``Ensemble.timer``), then their medians, the
time outside the members' forwards (the non-forward stages' medians summed, as ``tokenfuse bench``
counts it) and its share of the forward time; and how many outputs the two paths share.

    .venv/bin/python scripts/bench/bench_sparse_gac.py --rounds 4

The dense path is ``sparse_average`` answering ``None`` (what it does on a near tie) on every step.
Run it on an idle machine: it reports wall-clock times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import tokenfuse.combiners.gac as gac_module
from tokenfuse.bench import PROMPTS
from tokenfuse.config import config_from_source
from tokenfuse.engine.sampling import Sampling
from tokenfuse.load import load_ensemble


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    ens = load_ensemble(config_from_source(), progress=False)
    if ens.combiner.name != "gac":
        raise SystemExit(f"the default config's method is {ens.combiner.name!r}, not gac")
    sparse = gac_module.sparse_average

    def generate(prompt: str, n: int) -> tuple[dict[str, float], bytes]:
        s = ens.open(prompt, sampling=Sampling(), max_new_tokens=n)
        ens.step([s])  # the prefill's step: not decode
        t0, before, pieces = time.perf_counter(), ens.timer.snapshot(), 0
        while s.finished is None:
            pieces += sum(1 for ev in ens.step([s]) if ev.piece)
        stages = ens.timer.since(before, time.perf_counter() - t0)
        ens.close(s)
        return {k: 1000 * v / max(pieces, 1) for k, v in stages.items()}, bytes(s.output)

    paths = {"dense": lambda view, live: None, "sparse": sparse}
    times: dict[str, list[dict[str, float]]] = {p: [] for p in paths}
    outputs: dict[str, list[bytes]] = {p: [] for p in paths}
    generate(PROMPTS[0], 4)  # warm-up
    for _ in range(args.rounds):
        for name, fn in paths.items():
            gac_module.sparse_average = fn
            for prompt in PROMPTS:
                st, out = generate(prompt, args.max_new_tokens)
                times[name].append(st)
                outputs[name].append(out)
    gac_module.sparse_average = sparse
    for name, rows in times.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "total"}
        outside = sum(v for k, v in med.items() if k != "forward")
        print(f"{name:7} forward {med['forward']:.2f} ms/piece, outside {outside:.3f} ms/piece "
              f"({100 * outside / med['forward']:.2f} %); " + ", ".join(f"{k} {v:.3f}" for k, v in med.items() if k != "forward"))
    same = sum(a == b for a, b in zip(outputs["dense"], outputs["sparse"]))
    print(f"outputs identical: {same}/{len(outputs['sparse'])}")


if __name__ == "__main__":
    main()
