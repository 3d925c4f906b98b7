"""Two sets of `tokenfuse eval` likelihood-form records of the same task, item by item.

For each method file in both `items/<task>-<form>/` directories: the items in both, how many of them
changed their log-probabilities (and the largest change), how many changed their choice, and the
correct count in each. E.g. the MMLU records before and after the sliding-window fix
(docs/evaluation.md): unpack `git show eb73293^:docs/results/large/items-mmlu.tar.gz` into one
directory and the current `docs/results/large/items-mmlu.tar.gz` into another.

Usage: .venv/bin/python scripts/compare_records.py OLD/items/mmlu-likelihood NEW/items/mmlu-likelihood
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
        changed = [i for i in ids if old[i].get("logprobs") != new[i].get("logprobs")]
        delta = max((abs(a - b) for i in changed for a, b in zip(old[i]["logprobs"], new[i]["logprobs"])), default=0.0)
        flips = sum(old[i]["pred"] != new[i]["pred"] for i in ids)
        print(f"{path.stem:40s} {len(ids):4d} items: log-probs changed on {len(changed):4d} (max |d| {delta:.3f}), "
              f"choice on {flips:3d}; correct {sum(bool(old[i]['correct']) for i in ids)} -> "
              f"{sum(bool(new[i]['correct']) for i in ids)}")


if __name__ == "__main__":
    main()
