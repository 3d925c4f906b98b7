"""What ``results.json`` holds: per task and row the summary of its per-item records, the overview
over the tasks, each row's paired gain over the best member with Holm's correction, ``mux`` against
the best ``sc`` row, the proper scores and each task's wall time. ``tokenfuse.eval.report`` renders
it as tables and a figure; its docstring says what each number is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenfuse.eval.proper import proper_scores
from tokenfuse.eval.stats import bootstrap_ci, holm, paired_bootstrap, paired_bootstrap_mean, sign_flip_p

HOLM_ALPHA = 0.05


def mean(xs: Sequence[float]) -> float:
    """The mean; NaN for none."""
    return sum(xs) / len(xs) if xs else float("nan")


def method_summary(records: Sequence[dict], *, form: str) -> dict:
    """Accuracy, interval and cost of one method on one task."""
    correct = [float(bool(r["correct"])) for r in records]
    lo, hi = bootstrap_ci(correct)
    out = {"n": len(records), "acc": mean(correct), "ci": [lo, hi], "form": form}
    if form == "likelihood" and records and "correct_raw" in records[0]:
        out["acc_raw"] = mean([float(bool(r["correct_raw"])) for r in records])
    if records and "samples" in records[0]:  # an answer row (tokenfuse.eval.answers)
        out["samples_per_item"] = mean([r["samples"] for r in records])
        out["sampling_seconds"] = sum(r.get("sampling_seconds", 0.0) for r in records)
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
    from tokenfuse.eval.methods import ANSWER_METHODS, ENGINE_METHODS, OLD_ROWS, OUTPUT_METHODS

    order = ("single", *ENGINE_METHODS, *OLD_ROWS, *OUTPUT_METHODS, *ANSWER_METHODS)
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
            "avg": mean([c["acc"] for c in cells]) if len(cells) == len(tasks) else float("nan"),
            "items": sum(c["n"] for c in cells),
            "seconds": secs,
            "items_per_min": sum(c["n"] for c in cells) / secs * 60 if secs else None,
            "ms_per_token": 1000 * sum(c["seconds"] for c in gen) / gen_steps if gen_steps else None,
            "ensembled_share": (sum(c["ensembled_share"] * c["steps"] for c in ens) / ens_steps) if ens_steps else None,
        }
        if any("samples_per_item" in c for c in cells):
            overview[m]["samples_per_item"] = mean([c["samples_per_item"] for c in cells if "samples_per_item" in c])
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
                pair = paired_correct(recs, all_records[t][b])
                d, lo, hi = paired_bootstrap(*pair)
                tasks[t][m]["vs_best"] = {"member": b, "gain": d, "ci": [lo, hi]}
                if d == d:
                    tasks[t][m]["vs_best"]["p"] = sign_flip_p(*pair)
    family = holm_family(tasks)
    mux_family = mux_vs_sc(tasks, all_records)
    proper = proper_scores(tasks, all_records, forms)
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
                         "batch_size": settings.batch_size, "max_new_tokens": dict(settings.max_new_tokens),
                         "samples": settings.samples, "sample_temperature": settings.sample_temperature},
            "forms": forms, "tasks": tasks, "overview": overview, "best_member": best,
            "gain_per_task": per_task_gain, "wall_seconds": wall_seconds,
            "holm": {"family": family, "alpha": HOLM_ALPHA, "test": "exact paired sign-flip"},
            **({"mux_vs_sc": {"family": mux_family, "alpha": HOLM_ALPHA}} if mux_family else {}),
            **({"proper": proper} if proper else {}),
            "task_wall": task_wall(tasks, {t: {"chosen": per["auto"][0].get("chosen")}
                                           for t, per in all_records.items() if per.get("auto")})}


def holm_family(tasks: dict) -> int:
    """Holm's correction over every per-task comparison with the best member that has a ``p``
    (``tasks.<task>.<method>.vs_best``): adds ``p_holm`` and ``family`` (its size) to each; returns
    the size. The comparisons of the average are not in the family."""
    cells = [c["vs_best"] for per in tasks.values() for c in per.values() if "p" in c.get("vs_best", {})]
    for v, adjusted in zip(cells, holm([v["p"] for v in cells])):
        v["p_holm"], v["family"] = adjusted, len(cells)
    return len(cells)


def mux_vs_sc(tasks: dict, all_records: dict[str, dict[str, list[dict]]]) -> int:
    """Per task with a ``mux`` and ``sc:`` rows, ``mux``'s paired gain over the best ``sc`` row on the
    task's items (``tasks.<task>.mux.vs_best_sc``: ``row``, ``gain``, ``ci``, ``p``, and Holm's
    ``p_holm`` over these comparisons, one per task, a family of their own); returns its size."""
    cells = []
    for t, per in tasks.items():
        sc = [m for m in per if m.startswith("sc:")]
        if "mux" not in per or not sc:
            continue
        best = max(sc, key=lambda m: per[m]["acc"])  # the first of equal accuracies
        pair = paired_correct(all_records[t]["mux"], all_records[t][best])
        d, lo, hi = paired_bootstrap(*pair)
        per["mux"]["vs_best_sc"] = {"row": best, "gain": d, "ci": [lo, hi]}
        if d == d:
            per["mux"]["vs_best_sc"]["p"] = sign_flip_p(*pair)
            cells.append(per["mux"]["vs_best_sc"])
    for v, adjusted in zip(cells, holm([v["p"] for v in cells])):
        v["p_holm"], v["family"] = adjusted, len(cells)
    return len(cells)


def task_wall(tasks: dict, auto: dict | None) -> dict:
    """Per task the wall time of its test items: the sum of the rows' ``seconds`` (their batches run
    one after another; output-level rows take none), the ``auto`` row left out where it repeats the
    records of a row of the table (``auto``'s ``chosen``), and its items and ``items_per_min``. The
    answer rows' ``seconds`` are the cost of the samples each uses, shared between them: the
    members' sampling time (``sampling_seconds``) is counted once instead."""
    out = {}
    for t, per in tasks.items():
        chosen = ((auto or {}).get(t) or {}).get("chosen")
        rows = [m for m, c in per.items() if c.get("seconds") and not (m == "auto" and chosen in per)]
        shared = [m for m in rows if "sampling_seconds" in per[m]]
        secs = sum(per[m]["seconds"] for m in rows if m not in shared)
        secs += max((per[m]["sampling_seconds"] for m in shared), default=0.0)
        n = max((c["n"] for c in per.values()), default=0)
        out[t] = {"seconds": secs, "items": n, "rows": len(rows), "items_per_min": n / secs * 60 if secs else None}
    return out


def paired_correct(records: Sequence[dict], other: Sequence[dict]) -> tuple[list[float], list[float]]:
    """0/1 correctness of the items both lists hold, paired by item id (in ``records``' order)."""
    theirs = {str(r["id"]): float(bool(r["correct"])) for r in other}
    pairs = [(float(bool(r["correct"])), theirs[str(r["id"])]) for r in records if str(r["id"]) in theirs]
    return [a for a, _ in pairs], [b for _, b in pairs]


def write_json(results: dict, path: Path) -> None:
    """``results.json`` as ``tokenfuse eval`` writes it (one form, so a rewrite changes only what changed)."""
    path.write_text(json.dumps(results, indent=1, ensure_ascii=False, allow_nan=True) + "\n", encoding="utf-8")
