#!/usr/bin/env python
"""The bench's streams section alone, on one ensemble config: N prompts stepped together against the
same prompts one at a time (``tokenfuse.bench.streams.measure_streams``: tokens/s with the prefill and
decode-only, the ratio, how many outputs equal the prompt's output alone).

    .venv/bin/python scripts/bench/bench_streams.py --config examples/exact-calls.yaml --streams 1,8 \
        --speculative-k 4 --json streams.json

``--speculative-k K`` turns on greedy speculative decoding (the default drafter, up to K pieces a
round) over the config: the rounds of sequences stepped together then share their drafter forwards
and verifying calls (``Speculator.run``). The prompts are ``tokenfuse bench``'s six, cycled to N.
Run it alone on the machine: it reports wall-clock rates.
"""

from __future__ import annotations

import argparse
import json

from tokenfuse.bench import PROMPTS
from tokenfuse.bench.streams import measure_streams, print_streams, streams_figures
from tokenfuse.config import config_from_source
from tokenfuse.load import load_ensemble


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="ensemble config YAML (default: the bundled ensemble)")
    ap.add_argument("--streams", default="1,8", help="stream counts, comma-separated (default 1,8)")
    ap.add_argument("--speculative-k", type=int, help="speculative decoding, up to K drafted pieces a round")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", help="write the section and its figures here")
    args = ap.parse_args()
    cfg = config_from_source(config=args.config)
    if args.speculative_k is not None:
        cfg = cfg.with_overrides(speculative={"k": args.speculative_k}, names={"speculative": "--speculative-k"})
    ens = load_ensemble(cfg, progress=False)
    section = measure_streams(ens, PROMPTS, [int(n) for n in args.streams.split(",")],
                              max_new_tokens=args.max_new_tokens, rounds=args.rounds)
    name = f"{args.config or 'default'}" + (f", speculative k={args.speculative_k}" if args.speculative_k else "")
    print_streams(name, section)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "speculative_k": args.speculative_k, "section": section,
                       **streams_figures(section)}, f, indent=1)


if __name__ == "__main__":
    main()
