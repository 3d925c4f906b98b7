"""Add the proper scores (the gold option's NLL, the Brier score; `tokenfuse.eval.proper`) to a run's
committed `results.json` from its per-item records: no model is loaded or called.

`tokenfuse eval` computes them itself since they exist; this is for a run aggregated before, whose
records are committed (`docs/results/<run>/items-<task>.tar.gz`). Unpack the likelihood tasks'
archives into a folder, then:

    mkdir -p /tmp/lead && for t in arc_challenge arc_easy piqa boolq mmlu; do
      tar xzf docs/results/lead/items-$t.tar.gz -C /tmp/lead; done
    .venv/bin/python scripts/results/proper_scores.py docs/results/lead --records /tmp/lead
    .venv/bin/python -m tokenfuse.eval.pages      # results.md and the pages' tables from it

Every likelihood-form row of `results.json` is read from `RECORDS/items/<task>-likelihood/<row>.jsonl`
(test items; the dev records are not used); a row's records must be the ones its `results.json` was
aggregated from — the same items, count and accuracy — or the script stops. Only the `proper`
fields are added or replaced; everything else in `results.json` stays as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenfuse.eval.proper import proper_scores
from tokenfuse.eval.records import item_file, read_records
from tokenfuse.eval.summary import write_json


def records_of(results: dict, records: Path) -> dict[str, dict[str, list[dict]]]:
    """The test records of every likelihood-form row in ``results``, checked against its summary."""
    out: dict[str, dict[str, list[dict]]] = {}
    for task, form in results["forms"].items():
        if form != "likelihood":
            continue
        out[task] = {}
        for row, summary in results["tasks"][task].items():
            path = item_file(records, task, "likelihood", row)
            recs = list(read_records(path).values())
            acc = sum(bool(r["correct"]) for r in recs) / len(recs) if recs else None
            if len(recs) != summary["n"] or acc is None or abs(acc - summary["acc"]) > 1e-12:
                raise SystemExit(f"error: {path}: {len(recs)} records, accuracy {acc}; results.json has "
                                 f"{summary['n']} and {summary['acc']} — not the records it was aggregated from")
            out[task][row] = recs
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="the run's folder, holding results.json (docs/results/<run>)")
    p.add_argument("--records", type=Path, required=True, help="where the records are unpacked (holds items/)")
    args = p.parse_args(argv)
    path = args.run / "results.json"
    results = json.loads(path.read_text(encoding="utf-8"))
    for per in results["tasks"].values():
        for summary in per.values():
            summary.pop("proper", None)
    proper = proper_scores(results["tasks"], records_of(results, args.records), results["forms"])
    if proper is None:
        print(f"{path}: no likelihood-form row with option scores", file=sys.stderr)
        return 1
    results["proper"] = proper
    write_json(results, path)
    print(f"{path}: proper scores of {', '.join(proper['best'])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
