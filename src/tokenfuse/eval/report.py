"""``results.json`` as tables (GaC Tab. 3's shape) and a figure; ``tokenfuse.eval.summary`` computes it
from the per-item records, by the definitions below.

Table shape (GaC Tab. 3: one row per model or ensemble, one column per benchmark, then the
average and the cost): ``method | task … | Avg. | Δ best | ms/token (share) | ens. % | items/min (share)``.

* task cells: accuracy in percent on the task's items (likelihood form: per-byte normalised);
* ``Avg.``: the unweighted mean over the tasks;
* ``Δ best``: ``Avg.`` minus the best single member's ``Avg.`` (the member with the highest
  average; per task in the gain table);
* ``ens. %``: share of generated and scored (likelihood form) pieces where more than one member was
  computed;
* ``ms/token (share)``: the row's generate-form time divided by its generated pieces;
  ``items/min (share)``: the row's items divided by its time. A row's time is the wall time of the
  batches it computed itself, and the rows of a task share work (likelihood form: the members'
  forwards, counted for the row that computed them; generate form: the members' prompt caches,
  the first row to feed a prompt paying for it), so both are the row's *share* of the time, not
  its cost alone. Output-level rows (vote, MBR, seq-avg) take no model time of their own: ``—``.

The next table gives each task's wall time (``task_wall`` in ``results.json``): the sum of its
rows' times on the test items (the rows run one after another, batch by batch, so this is the
wall time of the task's batches; loading the members, building the rows and ``auto``'s dev items
are not counted; the ``auto`` row not again where it repeats a row of the table), and
``items/min (wall)`` = the task's items over it: what running the whole table on the task cost.

Then each cell's bootstrap 95 % interval, the unnormalised likelihood accuracies, and last the gain
of every other row over the best member with its **paired** bootstrap 95 % interval (``vs_best``
in ``results.json``):

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
member is best. Markers: ``†`` the interval excludes 0 (no correction for the table's many cells);
``‡`` significant after Holm's correction: every per-task comparison (each row that is not a
member × each task) has a two-sided ``p`` from the exact paired sign-flip test
(``stats.sign_flip_p``), and over that family (``holm.family`` comparisons) Holm's step-down
adjustment gives ``p_holm`` (``stats.holm``); ``‡`` where ``p_holm < HOLM_ALPHA`` (0.05). The two
average columns are outside the family and keep ``†`` alone. A ``results.json`` written before the
p-values has no ``p``: no ``‡``, and the legend says Holm was not computed for that run.

Proper scores (likelihood form, ``tokenfuse.eval.proper``, which defines them): per task and row that
has option scores, the gold option's mean NLL and Brier score of the row's softmax over the options'
summed log-likelihoods (``proper`` in ``results.json``), with a uniform row for reference; then each
row's paired difference from the member best by that score, with its paired bootstrap interval.

Answer-level rows (``mux``, ``sc:<member>``, ``tokenfuse.eval.answers``) add a table of their
samples per item and items/min — of the samples each row uses, its cost, as the rows share the
members' samples (the task's wall time counts the sampling once) — and, per task, ``mux``'s paired
gain over the best ``sc`` row on that task's items (``vs_best_sc`` in ``results.json``: the same
paired bootstrap and sign-flip ``p``, with Holm's correction over these comparisons alone) with a
verdict: ``mux`` beats the best ``sc`` where the interval lies above 0.
"""

from __future__ import annotations

import math
from pathlib import Path

from tokenfuse.eval.summary import HOLM_ALPHA, mean, task_wall, write_json


def _pct(x: float | None, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}"


def _signed(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:+.1f}"


def _gain_cell(v: dict | None) -> str:
    """``+2.0 [-1.0, +5.0]``: a gain and its interval; a loss in bold, † when the interval excludes 0,
    ‡ when its Holm-adjusted p-value is below ``HOLM_ALPHA`` (none stored: no ‡)."""
    if v is None or v["gain"] != v["gain"]:
        return "—"
    g, (lo, hi) = v["gain"], v["ci"]
    head = f"**{_signed(g)}**" if g < -1e-12 else _signed(g)
    holm_mark = "‡" if v.get("p_holm") is not None and v["p_holm"] < HOLM_ALPHA else ""
    return f"{head} [{_signed(lo)}, {_signed(hi)}]" + ("†" if lo > 0 or hi < 0 else "") + holm_mark


def markdown_table(results: dict) -> str:
    """The markdown tables (see the module docstring)."""
    tasks = list(results["tasks"])
    forms = ", ".join(f"{t}: {f}" for t, f in results["forms"].items())
    return "\n".join(_main_lines(results, tasks) + _wall_lines(results) + _ci_lines(results, tasks)
                     + _raw_lines(results, tasks) + _gain_lines(results, tasks) + proper_lines(results)
                     + primary_lines(results)
                     + answer_lines(results)
                     + auto_lines(results)
                     + ["", f"Forms: {forms}."]) + "\n"


def _main_lines(results: dict, tasks: list[str]) -> list[str]:
    ov = results["overview"]
    methods = list(ov)
    head = ["method"] + [f"{t} ({results['tasks'][t][methods[0]]['n'] if methods[0] in results['tasks'][t] else '?'})"
                         for t in tasks] + ["Avg.", "Δ best", "ms/token (share)", "ens. %", "items/min (share)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        o = ov[m]
        cells = [_pct(results["tasks"][t][m]["acc"]) if m in results["tasks"][t] else "—" for t in tasks]
        ms = "—" if o["ms_per_token"] is None else f"{o['ms_per_token']:.0f}"
        ipm = "—" if o["items_per_min"] is None else f"{o['items_per_min']:.1f}"
        lines.append("| " + " | ".join([m] + cells + [_pct(o["avg"]), _signed(o["gain_over_best"]), ms,
                                                        _pct(o["ensembled_share"], 0), ipm]) + " |")
    if any(o["items_per_min"] is not None or o["ms_per_token"] is not None for o in ov.values()):
        lines += ["", "`ms/token (share)`, `items/min (share)`: from a row's share of the time, not its cost alone: "
                      "a row's time is that of the batches it computed itself, and the rows share work (the likelihood "
                      "form: the members' forwards within a batch, docs/evaluation.md `RowMemo`, a forward counting "
                      "for the row that computed it, not for the rows that took its result; the generate form: the "
                      "members' prompt caches, the first row to feed a member a prompt paying for it). What the "
                      "table cost is the tasks' wall time below."]
    return lines


def _wall_lines(results: dict) -> list[str]:
    wall = results.get("task_wall") or task_wall(results["tasks"], results.get("auto"))
    if not any(w["seconds"] for w in wall.values()):
        return []
    out = ["", "Wall time per task: every row's batches on the task's test items, run one after another (the sum "
           "of the rows' `seconds`; loading the members, building the rows and `auto`'s dev items not counted), "
           "and the task's items per minute of it:", "",
           "| task | items | rows timed | wall (s) | items/min (wall) |", "|---|---|---|---|---|"]
    for t, w in wall.items():
        ipm = "—" if not w["seconds"] else f"{w['items'] / w['seconds'] * 60:.1f}"
        out.append(f"| {t} | {w['items']} | {w['rows']} | {w['seconds']:.0f} | {ipm} |")
    if len(wall) > 1:
        items, secs = sum(w["items"] for w in wall.values()), sum(w["seconds"] for w in wall.values())
        out.append(f"| all tasks | {items} | — | {secs:.0f} | {items / secs * 60:.1f} |")
    return out


def _ci_lines(results: dict, tasks: list[str]) -> list[str]:
    ci = ["", "Bootstrap 95 % intervals (1,000 resamples, seed 0):", "",
          "| method | " + " | ".join(tasks) + " |", "|" + "---|" * (len(tasks) + 1)]
    for m in results["overview"]:
        cells = []
        for t in tasks:
            c = results["tasks"][t].get(m)
            cells.append("—" if c is None else f"{_pct(c['ci'][0])}–{_pct(c['ci'][1])}")
        ci.append(f"| {m} | " + " | ".join(cells) + " |")
    return ci


def _raw_lines(results: dict, tasks: list[str]) -> list[str]:
    raw = [t for t in tasks if results["forms"][t] == "likelihood"]
    if not raw:
        return []
    extra = ["", "Likelihood form, unnormalised (sum of log-probabilities, `acc_raw`):", "",
             "| method | " + " | ".join(raw) + " |", "|" + "---|" * (len(raw) + 1)]
    for m in results["overview"]:
        cells = [_pct(results["tasks"][t][m].get("acc_raw")) if m in results["tasks"][t] else "—" for t in raw]
        extra.append(f"| {m} | " + " | ".join(cells) + " |")
    return extra


def _gain_lines(results: dict, tasks: list[str]) -> list[str]:
    ov, best, h = results["overview"], results.get("best_member"), results.get("holm")
    gain = ["", "Gain over the best single member (points) with its paired bootstrap 95 % interval (1,000 "
            "resamples of the items, seed 0); per task the best member on that task's items; **bold** = the "
            "method loses, † = the interval excludes 0, ‡ = significant after Holm's correction (below):", "",
            "| method | " + " | ".join(tasks) + f" | Avg. vs {best or 'best member'} | Avg. vs per-task best |",
            "|" + "---|" * (len(tasks) + 3)]
    for m in ov:
        if m.startswith("single:"):
            continue
        cells = [_gain_cell(results["tasks"][t].get(m, {}).get("vs_best")) for t in tasks]
        cells += [_gain_cell(ov[m].get("vs_best")), _gain_cell(ov[m].get("vs_task_best"))]
        gain.append(f"| {m} | " + " | ".join(cells) + " |")
    if h is None:
        return gain + ["", "Holm: not computed for this run (its results.json has no p-values); † alone."]
    return gain + ["", f"‡: Holm-adjusted p < {h['alpha']:g} over the family of the table's {h['family']} per-task "
                       "comparisons (every row that is not a member × every task), p from the exact paired sign-flip "
                       "test (`p`, `p_holm` in results.json); the two average columns are outside the family and "
                       "keep † alone."]


def _num(x: float | None, signed: bool = False) -> str:
    if x is None or x != x:
        return "—"
    if math.isinf(x):
        return ("+" if signed and x > 0 else "") + ("∞" if x > 0 else "-∞")
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def _diff_cell(v: dict | None) -> str:
    """``+0.012 [-0.010, +0.034]``: a row's score minus the best member's (lower is better); bold where
    the row is worse, † where the interval excludes 0."""
    if v is None:
        return "—"
    d, ci = v["diff"], v.get("ci")
    head = f"**{_num(d, True)}**" if d > 1e-12 else _num(d, True)
    if ci is None:
        return head
    return f"{head} [{_num(ci[0], True)}, {_num(ci[1], True)}]" + ("†" if ci[0] > 0 or ci[1] < 0 else "")


def proper_lines(results: dict) -> list[str]:
    """The likelihood tasks' proper scores (``tokenfuse.eval.proper``): each row's mean NLL and Brier
    score per task, then its paired difference from the best member by that score."""
    proper = results.get("proper")
    if not proper:
        return []
    tasks = list(proper["best"])
    head = "| method | " + " | ".join(f"{t} {s}" for t in tasks for s in ("NLL", "Brier")) + " |"
    rule = "|" + "---|" * (2 * len(tasks) + 1)
    rows = [m for m in results["overview"] if any("proper" in results["tasks"][t].get(m, {}) for t in tasks)]

    def cells(m: str, key) -> list[str]:
        out = []
        for t in tasks:
            p = results["tasks"][t].get(m, {}).get("proper")
            out += ["—", "—"] if p is None else [key(p, s) for s in ("nll", "brier")]
        return out

    values = ["", "Proper scores (likelihood form; `tokenfuse.eval.proper`): the gold option's NLL (nats) and the "
              "Brier score, means over the items, of each row's distribution over the options — the softmax of "
              "the options' summed log-likelihoods (not the per-byte scores `acc` ranks by); lower is better; "
              "`—`: no distribution (a row that chooses an option, or one whose options are all −inf on an item); "
              "the last row knows nothing (every option alike):", "", head, rule]
    values += [f"| {m} | " + " | ".join(cells(m, lambda p, s: _num(p[s]))) + " |" for m in rows]
    values.append("| uniform | " + " | ".join(_num(proper["uniform"][t][s]) for t in tasks
                                              for s in ("nll", "brier")) + " |")
    gains = ["", "Proper scores against the best member by each score (per task, the member with the lowest mean on "
             "the task's items): the row's mean minus the member's with its paired bootstrap 95 % interval "
             f"({proper['resamples']:,} resamples of the items, seed {proper['seed']}); negative = the row is better; **bold** = worse, † = the interval "
             "excludes 0 (no Holm: the exact sign-flip test is for 0/1 values); the best members: "
             + "; ".join(f"{t} {b['nll']}" if b["nll"] == b["brier"] else f"{t} {b['nll']} (NLL), {b['brier']} (Brier)"
                         for t, b in proper["best"].items()) + ":",
             "", head, rule]
    gains += [f"| {m} | " + " | ".join(cells(m, lambda p, s: _diff_cell(p.get("vs_best", {}).get(s)))) + " |"
              for m in rows if not m.startswith("single:")]
    return values + gains


def primary_lines(results: dict) -> list[str]:
    """Each task's primary member (it gates, drafts, leads ``contrast`` and breaks ties) and whence."""
    chosen = {t: p for t, p in (results.get("primaries") or {}).items() if p.get("from") == "dev"}
    if not chosen:
        return []
    def why(p: dict) -> str:
        accs = ", ".join(f"{n} {_pct(a)}" for n, a in p["dev_acc"].items())
        return f"best of the members alone on {p['dev_items']} dev items ({accs})"
    return ["", "Primary member per task (the gate of `gac-threshold`/`gac-select`, the drafter, the expert of "
                "`contrast`, the tie-breaker; the config sets none, so the dev items choose it):", "",
            *[f"* {t}: {p['member']} — {why(p)}" for t, p in chosen.items()]]


def answer_lines(results: dict) -> list[str]:
    """The answer rows' samples and cost, and per task whether ``mux`` beats the best ``sc`` row."""
    ov = results["overview"]
    rows = [m for m in ov if "samples_per_item" in ov[m]]
    if not rows:
        return []
    cells = {m: {t: per[m] for t, per in results["tasks"].items() if m in per} for m in rows}
    sampled = {m: {t: c for t, c in cells[m].items() if "samples_per_item" in c} for m in rows}
    partial = [m for m in rows if len(sampled[m]) < len(cells[m])]  # `auto` where it chose an answer row
    out = ["", "Answer-level rows (`mux`, `sc:<member>`; docs/evaluation.md): samples per item and items/min of "
           "the samples each row uses (their cost; the rows share the members' samples, the wall time above "
           "counts them once" + ("; a row that samples on some tasks only is shown on those tasks" if partial else "")
           + "):", "", "| row | samples/item | items/min (cost) |", "|---|---|---|"]
    for m in rows:
        used = sampled[m].values()
        secs = sum(c.get("seconds", 0.0) for c in used)
        ipm = "—" if not secs else f"{sum(c['n'] for c in used) / secs * 60:.1f}"
        label = f"{m} ({', '.join(sampled[m])} only)" if m in partial else m
        out.append(f"| {label} | {mean([c['samples_per_item'] for c in used]):g} | {ipm} |")
    cmp = {t: per["mux"]["vs_best_sc"] for t, per in results["tasks"].items() if "vs_best_sc" in per.get("mux", {})}
    if not cmp:
        return out
    out += ["", "`mux` against the best `sc` row of each task (the same number of samples; the best on the task's "
            "own items, which favours `sc`): gain in points with its paired bootstrap 95 % interval, † = the "
            "interval excludes 0, ‡ = Holm-adjusted p < 0.05 over these comparisons:", "",
            "| task | best sc | mux − best sc | mux beats the best sc? |", "|---|---|---|---|"]
    for t, v in cmp.items():
        lo, hi = v["ci"]
        verdict = "yes" if lo > 0 else "no: sc is better" if hi < 0 else "not shown (the interval includes 0)"
        out.append(f"| {t} | {v['row']} | {_gain_cell(v)} | {verdict} |")
    return out


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
    write_json(results, out / "results.json")
    (out / "results.md").write_text(markdown_table(results), encoding="utf-8")
    plot(results, out / "results.png")
