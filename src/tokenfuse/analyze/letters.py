"""``tokenfuse analyze letters``: which letters the gold answers are and which letters each row
answered, in the letter form.

Reads the records `tokenfuse eval --mc generate --out OUT` wrote (or a published
`items-<task>.tar.gz`, unpacked: the `extracted` letter stays in the records) and the task's data.
Prints how often each letter is the gold answer on the items `--limit N` evaluates, what always
answering that letter would score, and for every row (`items/<task>-generate/*.jsonl`) how often it
answered each letter ("none": no letter could be read off its output) and its accuracy. The counts
in docs/results.md's letter-form finding (and its longer letter-form section at commit 5503b78)
come from this command.

Usage: TOKENFUSE_DATA=../shared/benchmarks tokenfuse analyze letters arc_challenge \
    --eval-out eval-large [--limit 500]   (auto's dev items: --dev --limit 50)
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from tokenfuse.errors import TokenfuseError
from tokenfuse.eval.records import read_records, task_dir
from tokenfuse.tasks import load_task
from tokenfuse.tasks.base import letters


def letter_counts(task_name: str, eval_out: Path, *, limit: int = 500, dev: bool = False,
                  data: str | os.PathLike | None = None) -> str:
    """The table of the module docstring (``data``: the benchmark files, else ``$TOKENFUSE_DATA``)."""
    eval_out = Path(eval_out)
    task = load_task(task_name, data)
    if not task.multiple_choice:
        raise TokenfuseError(f"analyze letters: {task_name} is not a multiple-choice task")
    items = task.dev_subset(limit) if dev else task.subset(limit)
    gold = {str(it["id"]): it["answer"] for it in items}
    keys = letters(max(len(it["choices"]) for it in items))
    folder = task_dir(eval_out, task_name, "generate-dev" if dev else "generate")
    if not folder.is_dir():
        raise TokenfuseError(f"no letter-form records in {folder}: run `tokenfuse eval --tasks {task_name} "
                             f"--mc generate --out {eval_out}` first (or unpack its items-{task_name}.tar.gz there)")
    width = max([len(p.stem) for p in folder.glob("*.jsonl")] + [12])
    head = " ".join(f"{k:>4s}" for k in keys)
    lines = [f"{'':{width}s} {'items':>5s} {head} {'none':>4s}   acc"]
    counts = Counter(gold.values())
    lines.append(f"{'gold':{width}s} {len(gold):5d} " + " ".join(f"{counts[k]:4d}" for k in keys))
    for k in (k for k in keys if counts[k]):
        lines.append(f"{'always ' + k:{width}s} {len(gold):5d} {'':{5 * len(keys) + 4}s} "
                     f"{100 * counts[k] / len(gold):5.1f}")
    for path in sorted(folder.glob("*.jsonl")):
        recs = [r for i, r in read_records(path).items() if i in gold]
        answered = Counter(r.get("extracted") or "none" for r in recs)
        right = sum(bool(r.get("correct")) for r in recs)
        acc = f"{100 * right / len(recs):5.1f}" if recs else "    –"
        lines.append(f"{path.stem:{width}s} {len(recs):5d} " + " ".join(f"{answered[k]:4d}" for k in keys)
                     + f" {answered['none']:4d} {acc}")
    return "\n".join(lines)
