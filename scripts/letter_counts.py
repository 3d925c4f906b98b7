"""Which letters the gold answers are and which letters each row answered, in the letter form.

Reads the records `tokenfuse eval --mc generate --out OUT` wrote (or a published
`items-<task>.tar.gz`, unpacked: the `extracted` letter stays in the records) and the task's data.
Prints how often each letter is the gold answer on the items `--limit N` evaluates, what always
answering that letter would score, and for every row (`items/<task>-generate/*.jsonl`) how often it
answered each letter ("none": no letter could be read off its output) and its accuracy. The counts
in docs/results.md's letter-form finding (and its longer letter-form section at commit 5503b78)
come from this command.

Usage: TOKENFUSE_DATA=../shared/benchmarks .venv/bin/python scripts/letter_counts.py arc_challenge \
    --out eval-large [--limit 500]   (auto's dev items: --dev --limit 50)
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from tokenfuse.eval.records import read_records, task_dir
from tokenfuse.tasks import load_task
from tokenfuse.tasks.base import letters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task")
    ap.add_argument("--out", type=Path, required=True, help="the eval's --out directory")
    ap.add_argument("--limit", type=int, default=500)
    ap.add_argument("--dev", action="store_true", help="auto's dev items instead of the test items")
    args = ap.parse_args()
    task = load_task(args.task)
    items = task.dev_subset(args.limit) if args.dev else task.subset(args.limit)
    gold = {str(it["id"]): it["answer"] for it in items}
    keys = letters(max(len(it["choices"]) for it in items))
    folder = task_dir(args.out, args.task, "generate-dev" if args.dev else "generate")
    if not folder.is_dir():
        raise SystemExit(f"no letter-form records in {folder}: run `tokenfuse eval --tasks {args.task} "
                         f"--mc generate --out {args.out}` first (or unpack its items-{args.task}.tar.gz there)")
    width = max([len(p.stem) for p in folder.glob("*.jsonl")] + [12])
    head = " ".join(f"{k:>4s}" for k in keys)
    print(f"{'':{width}s} {'items':>5s} {head} {'none':>4s}   acc")
    counts = Counter(gold.values())
    print(f"{'gold':{width}s} {len(gold):5d} " + " ".join(f"{counts[k]:4d}" for k in keys))
    for k in (k for k in keys if counts[k]):
        print(f"{'always ' + k:{width}s} {len(gold):5d} {'':{5 * len(keys) + 4}s} {100 * counts[k] / len(gold):5.1f}")
    for path in sorted(folder.glob("*.jsonl")):
        recs = [r for i, r in read_records(path).items() if i in gold]
        answered = Counter(r.get("extracted") or "none" for r in recs)
        right = sum(bool(r.get("correct")) for r in recs)
        acc = f"{100 * right / len(recs):5.1f}" if recs else "    –"
        print(f"{path.stem:{width}s} {len(recs):5d} " + " ".join(f"{answered[k]:4d}" for k in keys)
              + f" {answered['none']:4d} {acc}")


if __name__ == "__main__":
    main()
