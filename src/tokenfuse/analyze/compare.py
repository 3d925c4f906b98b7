"""``tokenfuse analyze compare``: two sets of `tokenfuse eval` records of the same task and form, item by item.

For each method file in both `items/<task>-<form>/` directories: the items in both, how many of them
changed their log-probabilities (likelihood form; and the largest change), how many changed their
choice (the option picked, or in the generate form the output text), and the correct count in each. E.g. the MMLU records before and after the sliding-window fix
(docs/results.md): unpack `git show eb73293^:docs/results/large/items-mmlu.tar.gz` into one
directory and the current `docs/results/large/items-mmlu.tar.gz` into another.

Usage: tokenfuse analyze compare OLD/items/mmlu-likelihood NEW/items/mmlu-likelihood
       (or two `--out` runs' items/gsm8k-generate, e.g. `--batch-size 8` against `--batch-size 1`)
"""

from __future__ import annotations

from pathlib import Path

from tokenfuse.errors import TokenfuseError
from tokenfuse.eval.records import read_records


def compare_records(old: Path, new: Path) -> str:
    """One line per method file in both folders (module docstring)."""
    old, new = Path(old), Path(new)
    for folder in (old, new):
        if not folder.is_dir():
            raise TokenfuseError(f"analyze compare: {folder} is not a folder of records (items/<task>-<form>/)")
    lines = []
    for path in sorted(old.glob("*.jsonl")):
        if not (new / path.name).is_file():
            continue
        before, after = read_records(path), read_records(new / path.name)
        ids = [i for i in before if i in after]
        first = before[ids[0]] if ids else {}
        key = "pred" if "pred" in first else "output"  # likelihood form: the option picked
        what = (f"{'choice' if key == 'pred' else 'output'} changed on "
                f"{sum(before[i].get(key) != after[i].get(key) for i in ids):3d}")
        if "logprobs" in first:
            changed = [i for i in ids if before[i]["logprobs"] != after[i]["logprobs"]]
            delta = max((abs(a - b) for i in changed for a, b in zip(before[i]["logprobs"], after[i]["logprobs"])),
                        default=0.0)
            what = f"log-probs changed on {len(changed):4d} (max |d| {delta:.3f}), " + what
        correct = [sum(bool(recs[i]["correct"]) for i in ids) for recs in (before, after)]
        lines.append(f"{path.stem:40s} {len(ids):4d} items: {what}; correct {correct[0]} -> {correct[1]}")
    return "\n".join(lines)
