"""``tokenfuse analyze options``: where a row wins or loses on the likelihood tasks, option by option.

Accuracy only says whether the gold option scored highest. This reads a run's likelihood records
(``items/<task>-likelihood/*.jsonl``, each with the options' summed ``logprobs`` and their ``bytes``)
and gives, per task and row, over the test items (``--dev``: auto's dev items):

* ``gold nll/B``: the gold option's negative log-likelihood per byte of its continuation,
  ``-logprobs[g] / bytes[g]`` (nats; how well the row predicts the right answer's text);
* ``margin/B``: the gold option's per-byte log-likelihood minus the best wrong option's — what the
  per-byte ranking (``acc``) compares: positive where the row is right;
* ``acc``: the records' ``correct`` (eval's accuracy; the margin is positive exactly where the gold
  option ranks first, ties aside);

and for every row that is not a member, the paired difference to the task's best member (the member
with the highest ``acc`` on these items; ties: the lower gold NLL) with its paired bootstrap 95 %
interval (``stats.paired_bootstrap``, 1,000 resamples, seed 0): ``Δ nll/B`` below zero and
``Δ margin/B`` above zero are gains. An item where a value is not finite (a row that excluded an
option, ``-inf``) is left out of that row's means and counted.

Usage: tokenfuse analyze options docs/results/bytes-nine [--tasks arc_easy,piqa] [--dev]
"""

from __future__ import annotations

import math
from statistics import fmean
from dataclasses import dataclass
from pathlib import Path

from tokenfuse.errors import TokenfuseError
from tokenfuse.eval.records import read_records
from tokenfuse.eval.stats import paired_bootstrap


@dataclass
class RowNumbers:
    """One row's per-item numbers on one task, by item id."""

    nll: dict[str, float]
    margin: dict[str, float]
    correct: dict[str, bool]
    left_out: int


def item_numbers(rec: dict) -> tuple[float, float] | None:
    """``(gold nll per byte, margin per byte)`` of one record (the module docstring); ``None`` where
    a value is not finite or the record has no option scores."""
    lps, nb, g = rec.get("logprobs"), rec.get("bytes"), rec.get("gold")
    if lps is None or nb is None or g is None or len(lps) < 2:
        return None
    per = [lp / max(int(n), 1) for lp, n in zip(lps, nb)]
    wrong = max(p for k, p in enumerate(per) if k != g)
    nll, margin = -per[int(g)], per[int(g)] - wrong
    if not (math.isfinite(nll) and math.isfinite(margin)):
        return None
    return nll, margin


def row_numbers(records: dict[str, dict]) -> RowNumbers:
    nll, margin, correct, left = {}, {}, {}, 0
    for i, rec in records.items():
        got = item_numbers(rec)
        if got is None:
            left += 1
            continue
        nll[i], margin[i] = got
        correct[i] = bool(rec.get("correct"))
    return RowNumbers(nll, margin, correct, left)


def _mean(xs) -> float:
    xs = list(xs)
    return fmean(xs) if xs else math.nan


def best_member(rows: dict[str, RowNumbers]) -> str | None:
    """The member with the highest accuracy on its items (ties: the lower gold NLL per byte)."""
    members = [m for m in rows if m.startswith("single:") and rows[m].nll]
    return min(members, key=lambda m: (-_mean(rows[m].correct.values()), _mean(rows[m].nll.values())), default=None)


def _delta(row: RowNumbers, best: RowNumbers, what: str) -> str:
    a, b = getattr(row, what), getattr(best, what)
    ids = [i for i in a if i in b]
    if not ids:
        return "—"
    d, lo, hi = paired_bootstrap([a[i] for i in ids], [b[i] for i in ids])
    return f"{d:+.4f} [{lo:+.4f}, {hi:+.4f}]"


def task_table(folder: Path) -> list[str]:
    """The lines of one task's table (``folder``: its ``items/<task>-likelihood`` directory)."""
    rows = {}
    for path in sorted(folder.glob("*.jsonl")):
        recs = read_records(path)
        if recs and "logprobs" in next(iter(recs.values())):
            rows[path.stem.replace("__", ":", 1)] = row_numbers(recs)
    if not rows:
        return [f"{folder.name}: no records with option scores"]
    best = best_member(rows)
    out = [f"### {folder.name} (best member: {best or 'none'})", "",
           "| row | items | acc | gold nll/B | margin/B | Δ nll/B vs best [95 %] | Δ margin/B vs best [95 %] |",
           "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        n = f"{len(r.nll)}" + (f" ({r.left_out} left out)" if r.left_out else "")
        vs = ("—", "—") if best is None or name.startswith("single:") else (
            _delta(r, rows[best], "nll"), _delta(r, rows[best], "margin"))
        out.append(f"| {name} | {n} | {100 * _mean(r.correct.values()):.1f} | {_mean(r.nll.values()):.4f} | "
                   f"{_mean(r.margin.values()):+.4f} | {vs[0]} | {vs[1]} |")
    return out + [""]


def option_tables(run: Path, tasks: list[str] | None = None, dev: bool = False) -> str:
    """The tables of the module docstring for every likelihood task of ``run`` (or ``tasks``)."""
    items = Path(run) / "items"
    if not items.is_dir():
        raise TokenfuseError(f"analyze options: {run} has no items/ folder (give a `tokenfuse eval --out DIR` run)")
    suffix = "-likelihood-dev" if dev else "-likelihood"
    found = {p.name[: -len(suffix)]: p for p in sorted(items.iterdir()) if p.is_dir() and p.name.endswith(suffix)}
    if tasks:
        missing = [t for t in tasks if t not in found]
        if missing:
            raise TokenfuseError(f"analyze options: no likelihood records of {', '.join(missing)} in {items} "
                                 f"(there: {', '.join(found) or 'none'})")
        found = {t: found[t] for t in tasks}
    if not found:
        raise TokenfuseError(f"analyze options: no likelihood records in {items}")
    lines = []
    for folder in found.values():
        lines += task_table(folder)
    return "\n".join(lines)
