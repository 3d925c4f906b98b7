"""Aggregate per-item records into ``results.json``, a GaC-Tab.-3-shaped markdown table and a figure.

Table shape (GaC Tab. 3: one row per model or ensemble, one column per benchmark, then the
average and the latency): ``method | task … | Avg. | Δ best | ms/token | ens. % | items/min``.

* task cells: accuracy in percent on the task's items (likelihood form: per-byte normalised);
* ``Avg.``: the unweighted mean over the tasks;
* ``Δ best``: ``Avg.`` minus the best single member's ``Avg.`` (the member with the highest
  average; per task in the second table);
* ``ms/token``: generate-form wall time divided by generated pieces; ``ens. %``: share of
  generated and scored (likelihood form) pieces where more than one member was computed; ``items/min``: all items of the row
  divided by their wall time. Output-level rows (vote, MBR, seq-avg) cost no model time of their
  own: ``—``.

A second table gives each cell's bootstrap 95 % interval; the last the gain of every other row
over the best member with its **paired** bootstrap 95 % interval (``vs_best`` in ``results.json``):

* per task, against the single member with the highest accuracy *on that task's items* (ties: the
  first in member order). Choosing it on the test items themselves favours the member (the
  highest of several noisy accuracies is biased upwards), so this is the conservative comparison
  for an ensemble;
* on the average, against the member with the highest average (``best_member``, the one ``Δ best``
  uses: one member fixed for every task), and against the per-task best members (an oracle
  choosing the best member of each task, the hardest target).

Paired: a resample draws the same items for the row and the member (``stats.paired_bootstrap``;
the average draws each task's items separately, ``stats.paired_bootstrap_mean``), so what the two
get right or wrong together cancels. The interval does not include the uncertainty of *which*
member is best.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from tokenfuse.eval.stats import bootstrap_ci, paired_bootstrap, paired_bootstrap_mean


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def method_summary(records: Sequence[dict], *, form: str) -> dict:
    """Accuracy, interval and cost of one method on one task."""
    correct = [float(bool(r["correct"])) for r in records]
    lo, hi = bootstrap_ci(correct)
    out = {"n": len(records), "acc": _mean(correct), "ci": [lo, hi], "form": form}
    if form == "likelihood" and records and "correct_raw" in records[0]:
        out["acc_raw"] = _mean([float(bool(r["correct_raw"])) for r in records])
    secs = sum(r.get("seconds", 0.0) for r in records)
    steps = sum(r.get("steps", 0) for r in records)
    if secs > 0:
        out["seconds"] = secs
        out["items_per_min"] = len(records) / secs * 60
        out["steps"] = steps
        if steps and any("ensembled" in r for r in records):
            out["ensembled_share"] = sum(r.get("ensembled", 0) for r in records) / steps
        if form == "generate" and steps:
            out["ms_per_token"] = 1000 * secs / steps
            out["skip_share"] = sum(r.get("skipped", 0) for r in records) / max(
                sum(r.get("ensembled", 0) for r in records), 1)
    return out


def row_order(method: str) -> int:
    from tokenfuse.eval.methods import ENGINE_METHODS, OUTPUT_METHODS

    order = ("single", *ENGINE_METHODS, *OUTPUT_METHODS)
    return order.index(method.split(":")[0]) if method.split(":")[0] in order else len(order)


def summarise(cfg, settings, all_records: dict[str, dict[str, list[dict]]], forms: dict[str, str], *,
              wall_seconds: float = 0.0) -> dict:
    """``results.json`` content: per task and method the summary, plus the per-method overview."""
    from tokenfuse.eval.methods import parse_methods

    tasks = {t: {m: method_summary(recs, form=forms[t]) for m, recs in per.items()}
             for t, per in all_records.items()}
    methods = sorted(dict.fromkeys(m for per in all_records.values() for m in per), key=row_order)
    overview = {}
    for m in methods:
        cells = [tasks[t][m] for t in tasks if m in tasks[t]]
        secs = sum(c.get("seconds", 0.0) for c in cells)
        gen = [c for c in cells if "ms_per_token" in c]
        gen_steps = sum(c["steps"] for c in gen)
        ens = [c for c in cells if c.get("ensembled_share") is not None]
        ens_steps = sum(c["steps"] for c in ens)
        overview[m] = {
            "avg": _mean([c["acc"] for c in cells]) if len(cells) == len(tasks) else float("nan"),
            "items": sum(c["n"] for c in cells),
            "seconds": secs,
            "items_per_min": sum(c["n"] for c in cells) / secs * 60 if secs else None,
            "ms_per_token": 1000 * sum(c["seconds"] for c in gen) / gen_steps if gen_steps else None,
            "ensembled_share": (sum(c["ensembled_share"] * c["steps"] for c in ens) / ens_steps) if ens_steps else None,
        }
    singles = [m for m in methods if m.startswith("single:")]
    best = max(singles, key=lambda m: overview[m]["avg"]) if singles else None
    for m in methods:
        o = overview[m]
        o["gain_over_best"] = o["avg"] - overview[best]["avg"] if best else None
    per_task_gain = {}
    task_best: dict[str, str] = {}
    for t, per in tasks.items():
        s = [m for m in per if m.startswith("single:")]
        if s:
            task_best[t] = max(s, key=lambda m: per[m]["acc"])  # max keeps the first of equal accuracies
            per_task_gain[t] = {m: per[m]["acc"] - per[task_best[t]]["acc"] for m in per}
    for t, b in task_best.items():
        for m, recs in all_records[t].items():
            if not m.startswith("single:"):
                d, lo, hi = paired_bootstrap(*paired_correct(recs, all_records[t][b]))
                tasks[t][m]["vs_best"] = {"member": b, "gain": d, "ci": [lo, hi]}
    for m in methods:
        covered = [t for t in all_records if m in all_records[t]]
        if m.startswith("single:") or len(covered) != len(all_records) or len(task_best) != len(all_records):
            continue
        if best is not None:
            d, lo, hi = paired_bootstrap_mean([paired_correct(all_records[t][m], all_records[t][best])
                                               for t in covered])
            overview[m]["vs_best"] = {"member": best, "gain": d, "ci": [lo, hi]}
        d, lo, hi = paired_bootstrap_mean([paired_correct(all_records[t][m], all_records[t][task_best[t]])
                                           for t in covered])
        overview[m]["vs_task_best"] = {"members": dict(task_best), "gain": d, "ci": [lo, hi]}
    return {"members": [m.name for m in cfg.members], "primary": cfg.primary_name,
            "settings": {"tasks": list(settings.tasks), "methods": parse_methods(settings.methods), "limit": settings.limit,
                         "limits": dict(settings.limits), "seed": settings.seed, "mc": settings.mc,
                         "batch_size": settings.batch_size, "max_new_tokens": dict(settings.max_new_tokens)},
            "forms": forms, "tasks": tasks, "overview": overview, "best_member": best,
            "gain_per_task": per_task_gain, "wall_seconds": wall_seconds}


def paired_correct(records: Sequence[dict], other: Sequence[dict]) -> tuple[list[float], list[float]]:
    """0/1 correctness of the items both lists hold, paired by item id (in ``records``' order)."""
    theirs = {str(r["id"]): float(bool(r["correct"])) for r in other}
    pairs = [(float(bool(r["correct"])), theirs[str(r["id"])]) for r in records if str(r["id"]) in theirs]
    return [a for a, _ in pairs], [b for _, b in pairs]


def _pct(x: float | None, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}"


def _signed(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:+.1f}"


def _gain_cell(v: dict | None) -> str:
    """``+2.0 [-1.0, +5.0]``: a gain and its interval; a loss in bold, † when the interval excludes 0."""
    if v is None or v["gain"] != v["gain"]:
        return "—"
    g, (lo, hi) = v["gain"], v["ci"]
    head = f"**{_signed(g)}**" if g < -1e-12 else _signed(g)
    return f"{head} [{_signed(lo)}, {_signed(hi)}]" + ("†" if lo > 0 or hi < 0 else "")


def markdown_table(results: dict) -> str:
    """The three markdown tables (see the module docstring)."""
    tasks, ov = list(results["tasks"]), results["overview"]
    methods = list(ov)
    head = ["method"] + [f"{t} ({results['tasks'][t][methods[0]]['n'] if methods[0] in results['tasks'][t] else '?'})"
                         for t in tasks] + ["Avg.", "Δ best", "ms/token", "ens. %", "items/min"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        o = ov[m]
        cells = [_pct(results["tasks"][t][m]["acc"]) if m in results["tasks"][t] else "—" for t in tasks]
        ms = "—" if o["ms_per_token"] is None else f"{o['ms_per_token']:.0f}"
        ipm = "—" if o["items_per_min"] is None else f"{o['items_per_min']:.1f}"
        lines.append("| " + " | ".join([m] + cells + [_pct(o["avg"]), _signed(o["gain_over_best"]), ms,
                                                        _pct(o["ensembled_share"], 0), ipm]) + " |")
    if any(results["forms"][t] == "likelihood" for t in tasks):
        lines += ["", "`items/min`: a row's items over the time it computed itself. In the likelihood form the rows "
                      "share the members' forwards within a batch (docs/evaluation.md, `RowMemo`): a forward counts for the row "
                      "that computed it, not for the rows that took its result, so a row's figure is not its cost alone."]
    ci = ["", "Bootstrap 95 % intervals (1,000 resamples, seed 0):", "",
          "| method | " + " | ".join(tasks) + " |", "|" + "---|" * (len(tasks) + 1)]
    for m in methods:
        cells = []
        for t in tasks:
            c = results["tasks"][t].get(m)
            cells.append("—" if c is None else f"{_pct(c['ci'][0])}–{_pct(c['ci'][1])}")
        ci.append(f"| {m} | " + " | ".join(cells) + " |")
    raw = [t for t in tasks if results["forms"][t] == "likelihood"]
    extra = []
    if raw:
        extra = ["", "Likelihood form, unnormalised (sum of log-probabilities, `acc_raw`):", "",
                 "| method | " + " | ".join(raw) + " |", "|" + "---|" * (len(raw) + 1)]
        for m in methods:
            cells = [_pct(results["tasks"][t][m].get("acc_raw")) if m in results["tasks"][t] else "—" for t in raw]
            extra.append(f"| {m} | " + " | ".join(cells) + " |")
    best = results.get("best_member")
    gain = ["", "Gain over the best single member (points) with its paired bootstrap 95 % interval (1,000 "
            "resamples of the items, seed 0); per task the best member on that task's items; **bold** = the "
            "method loses, † = the interval excludes 0:", "",
            "| method | " + " | ".join(tasks) + f" | Avg. vs {best or 'best member'} | Avg. vs per-task best |",
            "|" + "---|" * (len(tasks) + 3)]
    for m in methods:
        if m.startswith("single:"):
            continue
        cells = [_gain_cell(results["tasks"][t].get(m, {}).get("vs_best")) for t in tasks]
        cells += [_gain_cell(ov[m].get("vs_best")), _gain_cell(ov[m].get("vs_task_best"))]
        gain.append(f"| {m} | " + " | ".join(cells) + " |")
    forms = ", ".join(f"{t}: {f}" for t, f in results["forms"].items())
    return "\n".join(lines + ci + extra + gain + auto_lines(results) + ["", f"Forms: {forms}."]) + "\n"


def auto_lines(results: dict) -> list[str]:
    """The ``auto`` row's choice per task, made on dev items (``tokenfuse.eval.auto``)."""
    choices = results.get("auto") or {}
    if not choices:
        return []
    out = ["", "`auto`'s choice per task, on dev items only (best member on dev; the best other candidate and "
           "its paired gain on dev with the interval it had to clear):", "",
           "| task | dev items | chosen | best member (dev) | best other (dev) | gain on dev |", "|---|---|---|---|---|---|"]
    for t, c in choices.items():
        acc = c["dev_acc"]
        other = "—" if c["challenger"] is None else f"{c['challenger']} {_pct(acc[c['challenger']])}"
        g = c.get("dev_gain")
        gain = "—" if g is None else f"{_signed(g['gain'])} [{_signed(g['ci'][0])}, {_signed(g['ci'][1])}] ({g['level']:.0%})"
        items = c["dev_items"] if c.get("member_dev_items", c["dev_items"]) == c["dev_items"] else \
            f"{c['dev_items']} (members {c['member_dev_items']})"
        out.append(f"| {t} | {items} | {c['chosen']} | {c['best_single']} {_pct(acc[c['best_single']])} | "
                   f"{other} | {gain} |")
    notes = [f"* {t}: {c['dev_note']}." for t, c in choices.items() if c.get("dev_note")]
    return out + (["", "Fewer dev items than asked (the default is 500 in the likelihood form, 200 in the generate "
                   "form), where the task's dev pool is smaller:", "", *notes] if notes else [])


def plot(results: dict, path: Path) -> Path | None:
    """Grouped bars: accuracy per task and method with the bootstrap intervals (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    tasks, methods = list(results["tasks"]), list(results["overview"])
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(tasks) * max(1, len(methods)) / 4), 4))
    width = 0.8 / max(len(methods), 1)
    for k, m in enumerate(methods):
        xs, ys, err = [], [], [[], []]
        for i, t in enumerate(tasks):
            c = results["tasks"][t].get(m)
            if c is None:
                continue
            xs.append(i + (k - (len(methods) - 1) / 2) * width)
            ys.append(100 * c["acc"])
            err[0].append(max(0.0, 100 * (c["acc"] - c["ci"][0])))
            err[1].append(max(0.0, 100 * (c["ci"][1] - c["acc"])))
        ax.bar(xs, ys, width, yerr=err, capsize=2, label=m)
    ax.set_xticks(range(len(tasks)))
    ax.set_xticklabels(tasks, rotation=20)
    ax.set_ylabel("accuracy (%)")
    ax.set_title("tokenfuse eval (bars: bootstrap 95 % intervals)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(results: dict, out: Path) -> None:
    """``results.json``, ``results.md`` and ``results.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False, allow_nan=True) + "\n",
                                      encoding="utf-8")
    (out / "results.md").write_text(markdown_table(results), encoding="utf-8")
    plot(results, out / "results.png")
