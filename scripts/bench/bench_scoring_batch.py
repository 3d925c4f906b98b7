#!/usr/bin/env python
"""One-forward scoring of a batch of requests together against one request at a time, on one config
(default ``examples/transformers.yaml``: a batched transformers member scores the requests of one
call in one forward, ``Member.scores_together``; a llama.cpp member scores them in turn either way).

For ``--rounds`` rounds, interleaved: ``Ensemble.loglikelihood`` of the 8 requests in one call, then
each alone; the median seconds of each, their ratio and the largest difference of a log-likelihood.

    .venv/bin/python scripts/bench/bench_scoring_batch.py --config examples/transformers.yaml --rounds 3

Run it alone on the machine: it reports wall-clock times.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenfuse.config import config_from_source
from tokenfuse.load import load_ensemble

CONTEXT = "Question: Which of these is a mammal that lives in the sea?\nAnswer:"
OPTIONS = [" the whale", " a trout", " the shark, which breathes through gills", " a jellyfish",
           " the dolphin", " a sea turtle", " the octopus, with eight arms", " a salmon swimming upstream"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="examples/transformers.yaml")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ens = load_ensemble(config_from_source(config=args.config), progress=False)
    requests = [(CONTEXT, o) for o in OPTIONS]
    ens.loglikelihood(requests[:2])  # warm-up
    together, alone, diff = [], [], 0.0
    for _ in range(args.rounds):
        t = time.perf_counter()
        batch = ens.loglikelihood(requests)
        together.append(time.perf_counter() - t)
        t = time.perf_counter()
        one = [ens.loglikelihood([r])[0] for r in requests]
        alone.append(time.perf_counter() - t)
        diff = max([diff] + [abs(a.logprob - b.logprob) for a, b in zip(batch, one)])
    a, b = statistics.median(together), statistics.median(alone)
    print(f"{args.config}: {len(requests)} requests together {a:.2f} s, one at a time {b:.2f} s "
          f"({b / a:.2f}x); largest |log-likelihood difference| {diff:.2e}")


if __name__ == "__main__":
    main()
