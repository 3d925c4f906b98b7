"""Two sets of `tokenfuse eval` records of the same task and form, item by item.

For each method file in both `items/<task>-<form>/` directories: the items in both, how many of them
changed their log-probabilities (likelihood form; and the largest change), how many changed their
choice (the option picked, or in the generate form the output text), and the correct count in each. E.g. the MMLU records before and after the sliding-window fix
(docs/results.md): unpack `git show eb73293^:docs/results/large/items-mmlu.tar.gz` into one
directory and the current `docs/results/large/items-mmlu.tar.gz` into another.

Usage: .venv/bin/python scripts/compare_records.py OLD/items/mmlu-likelihood NEW/items/mmlu-likelihood
       (or two `--out` runs' items/gsm8k-generate, e.g. `--batch-size 8` against `--batch-size 1`)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenfuse.eval.records import read_records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    args = ap.parse_args()
    for path in sorted(args.old.glob("*.jsonl")):
        if not (args.new / path.name).is_file():
            continue
        old, new = read_records(path), read_records(args.new / path.name)
        ids = [i for i in old if i in new]
        first = old[ids[0]] if ids else {}
        key = "pred" if "pred" in first else "output"  # likelihood form: the option picked
        what = f"{'choice' if key == 'pred' else 'output'} changed on {sum(old[i].get(key) != new[i].get(key) for i in ids):3d}"
        if "logprobs" in first:
            changed = [i for i in ids if old[i]["logprobs"] != new[i]["logprobs"]]
            delta = max((abs(a - b) for i in changed for a, b in zip(old[i]["logprobs"], new[i]["logprobs"])), default=0.0)
            what = f"log-probs changed on {len(changed):4d} (max |d| {delta:.3f}), " + what
        correct = [sum(bool(recs[i]["correct"]) for i in ids) for recs in (old, new)]
        print(f"{path.stem:40s} {len(ids):4d} items: {what}; correct {correct[0]} -> {correct[1]}")

if __name__ == "__main__":
    main()
