#!/usr/bin/env python
"""The byte method's text fit for the bundled members: the byte rows' numbers (``byte-mix``'s weights,
``byte-switch``'s share, ``byte-gate``'s ``b`` and ``A``, ``byte-online``'s rate) and ``doc-mix``'s weights, fit on a
``text-bytes`` run's dev views alone (no test document read), written as the fit file the ``byte``
method reads by default for the bundled three (``params.fit``; src/tokenfuse/combiners/fits/).

    TOKENFUSE_DATA=../shared/benchmarks .venv/bin/python scripts/results/fit_bytes.py \
        --run docs/results/text-bytes-defer --out src/tokenfuse/combiners/fits/bundled-bytes.json

The run's dev views are made by ``tokenfuse eval --tasks text-bytes --out RUN`` (its first stage).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenfuse.bundled import DEFAULT_ENSEMBLE
from tokenfuse.eval.text_bytes import dev_fit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a text-bytes run's --out (its bytes/dev views)")
    ap.add_argument("--members", default=",".join(DEFAULT_ENSEMBLE), help="its members, in order (default: the bundled three)")
    ap.add_argument("--out", required=True, help="the fit file to write")
    args = ap.parse_args()
    fit = dev_fit(Path(args.run), args.members.split(",")) | {"made_by": f"scripts/results/fit_bytes.py --run {args.run}"}
    Path(args.out).write_text(json.dumps(fit, indent=1) + "\n")
    print(json.dumps({k: fit[k] for k in ("members", "rule", "keep", "dev_documents", "dev_bytes")}))


if __name__ == "__main__":
    main()
