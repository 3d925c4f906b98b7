"""``tokenfuse eval``: every method on the same seeded items of every task, members loaded once.

Flow: load the members once → for each task, pick its fixed seeded subset (``Task.subset``) and,
where the config names no primary member, rank the members alone on dev items to choose it
(``task_primary``; with ``auto``, its choice on dev items too, ``choose_on_dev``; dev records are
shared across runs through ``tokenfuse.eval.devcache``; each dev stage logs one line when it starts
and one when it is done) → for each engine method (each member alone, then the ensembles, built on
the same loaded members and the same union vocabulary) run the items batch by batch across the rows, appending one JSON line per
finished item (in the likelihood form the rows share the members' forwards through a ``RowMemo``:
the same member fed the same ids by two rows computes once; in the generate form each row takes
the batch's prompts from the members' prefix caches, which the previous row filled) →
compute the output-level baselines (vote, MBR, sequence-level average) from the members' lines →
with ``mux``/``sc`` (generate form), sample the members' answers and choose among them
(``tokenfuse.eval.answers``) → aggregate, with bootstrap 95 % intervals, into ``results.json``, ``results.md`` and ``results.png``.

Forms:

* ``generate`` — greedy generation, graded by the task (``Task.score``). Prompt form per member:
  the chat form (its own template) if its tokenizer has a chat template, the raw few-shot form
  otherwise — alone (as ``tokenfuse select``) and inside an ensemble alike. An ensemble whose
  members differ gets a ``TwoFormPrompt`` (``chat="mixed"``) and the stop strings of
  ``Task.stop(chat="mixed")``.
* ``likelihood`` (multiple-choice tasks; the default for them) — every option's continuation is
  scored under the method (``Ensemble.loglikelihood``: the token-level ensemble, teacher forced) on
  the raw cloze context (``Task.cloze``); the prediction is the option with the highest
  log-likelihood per UTF-8 byte (``acc``), and the raw sum gives ``acc_raw``.

Timing: ``seconds`` of an item is its batch's wall time divided by the batch size (in the
likelihood form a row's own time: forwards it took from the memo count for the row that computed
them; in the generate form a prompt prefix an earlier row left in a member's cache is not fed
again, so the first row to use a member pays for its prompts); ms/token is the generate-form time
divided by the generated pieces (prompt encoding included), items/min the items divided by their
time: a row's share, not its cost alone. The rows of a batch run one after another, so the sum of
a task's rows' ``seconds`` is the wall time of its batches (``summary.task_wall``): the table's cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tokenfuse.errors import TokenfuseError
from tokenfuse.eval.batches import (DEFAULT_TASKS, EvalSettings, run_rows, stderr_log, task_form,
                                    task_items)
from tokenfuse.eval.methods import MethodSpec, parse_methods, plan_methods
from tokenfuse.eval.records import append_records, item_file

__all__ = ["DEFAULT_TASKS", "EvalSettings", "choose_on_dev", "run_eval", "run_task", "task_primary"]


def run_eval(cfg, settings: EvalSettings, *, members=None, union=None,
             log: Callable[[str], None] | None = None) -> dict:
    """Run every task and method of ``settings`` on ``cfg``; write and return the results.

    ``members``/``union`` reuse already loaded members (tests); otherwise they are loaded once here.
    Every row is a variant (``Ensemble.variant``) of the config's ensemble on them.
    """
    from tokenfuse.combiners import REGISTRY
    from tokenfuse.eval.report import write_outputs
    from tokenfuse.eval.summary import summarise
    from tokenfuse.tasks import load_task

    log = log or stderr_log
    methods = parse_methods(settings.methods)
    tasks = [load_task(t, settings.data, num_fewshot=settings.num_fewshot) for t in settings.tasks]
    if members is None:
        from tokenfuse.load import load_ensemble

        t0 = time.perf_counter()
        base = load_ensemble(cfg, progress=settings.progress)
        log(f"members loaded in {time.perf_counter() - t0:.1f} s: {', '.join(m.name for m in base.members)}")
    else:
        from tokenfuse.load import ensemble_from_members

        base = ensemble_from_members(cfg, members, union=union)
    t_run = time.perf_counter()
    all_records: dict[str, dict[str, list[dict]]] = {}
    forms: dict[str, str] = {}
    for task in tasks:
        form = task_form(task, settings.mc)
        t0 = time.perf_counter()
        primary = task_primary(cfg, base, task, methods, settings, log=log)
        tcfg = cfg if primary == cfg.primary_name else cfg.with_overrides(primary=primary, origin=f"{task.name}'s primary")
        specs = plan_methods(tcfg, methods, form=form, registered=list(REGISTRY), log=log,
                             primary=primary if settings.primaries[task.name]["from"] == "dev" else None,
                             threshold=settings.threshold)
        specs = _byte_fits(specs, base, task, form, settings, log)
        all_records[task.name] = run_task(tcfg, base, task, specs, settings, log=log)
        forms[task.name] = form
        log(f"{task.name} ({form}): {len(next(iter(all_records[task.name].values()), []))} items, "
            f"{time.perf_counter() - t0:.0f} s")
    results = summarise(cfg, settings, all_records, forms, wall_seconds=time.perf_counter() - t_run)
    if settings.auto_choices:
        results["auto"] = dict(settings.auto_choices)
    results["primaries"] = dict(settings.primaries)
    write_outputs(results, Path(settings.out))
    return results


def run_task(cfg, base, task, specs: Sequence[MethodSpec], settings: EvalSettings, *,
             log: Callable[[str], None] | None = None) -> dict[str, list[dict]]:
    """Run (or resume) every row of one task; returns the records per method, in item order. With an
    ``auto`` row its choice is made on dev items first (``choose_on_dev``, recorded in
    ``settings.auto_choices``) and the chosen configuration runs with the table's rows."""
    items = task_items(task, settings)
    table = [s for s in specs if s.kind != "auto"]
    chosen = choose_on_dev(cfg, base, task, table, settings, log=log) if len(table) < len(specs) else None
    extra = [chosen] if chosen is not None and chosen.name not in {s.name for s in table} else []
    records = run_rows(cfg, base, task, table + extra, items, settings)
    if chosen is not None:
        form = task_form(task, settings.mc)
        rows = [{**r, "method": "auto", "chosen": chosen.name} for r in records[chosen.name]]
        path = item_file(Path(settings.out), task.name, form, "auto")
        path.unlink(missing_ok=True)  # derived from the chosen configuration's records: rewritten every run
        append_records(path, rows)
        records = {s.name: records[s.name] for s in table} | {"auto": rows}
    return records


def _byte_fits(specs: list[MethodSpec], base, task, form: str, settings: EvalSettings,
               log: Callable[[str], None]) -> list[MethodSpec]:
    """The byte rows of a likelihood-form task with their numbers fit on its dev items
    (``eval.bytefit``), unless the config names a fit file."""
    from dataclasses import replace

    from tokenfuse.eval.bytefit import task_fit
    from tokenfuse.eval.methods import BYTE_ROWS

    rows = {s.name for s in specs if s.name in BYTE_ROWS and "fit" not in s.overrides.get("params", {})}
    if not rows or form != "likelihood":
        return specs
    path = task_fit(base, task, Path(settings.out), settings.seed, log, progress=settings.progress)
    if path is None:
        return specs
    return [replace(s, overrides=s.overrides | {"params": s.overrides["params"] | {"fit": str(path)}})
            if s.name in rows else s for s in specs]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def task_primary(cfg, base, task, methods: Sequence[str], settings: EvalSettings, *,
                 log: Callable[[str], None] | None = None) -> str:
    """The task's primary member (it gates, drafts, leads ``contrast`` and breaks ties): the config's
    ``primary``, else its highest member ``score`` (``EnsembleConfig.primary_name``), else — with two
    members or more and a row besides the members alone — the member best on the task's dev items:
    the members alone on ``auto.primary_dev_count`` items (with ``auto`` in the run its member count,
    the records ``auto`` ranks them on too; without it no more than the run's test items of the task;
    ties: member order). Recorded in ``settings.primaries``; ``log`` (default: standard error) gets
    one line when the ranking starts and one when it is done."""
    from tokenfuse.eval import auto

    log = log or stderr_log
    names = [m.name for m in cfg.members]
    fixed = cfg.primary is not None or any(m.score is not None for m in cfg.members)
    if fixed or len(names) < 2 or set(methods) <= {"single"}:
        settings.primaries[task.name] = {"member": cfg.primary_name, "from": "config"}
        return cfg.primary_name
    with_auto = "auto" in methods
    count = auto.primary_dev_count(task_form(task, settings.mc), len(task_items(task, settings)),
                                   with_auto=with_auto, dev_limit=settings.dev_limit,
                                   member_dev_limit=settings.member_dev_limit)
    items = task.dev_subset(count, settings.seed)
    if not items:
        raise TokenfuseError(f"task {task.name!r} has no dev items to choose its primary member on: "
                             "set `primary` (or the members' `score`) in the config, or --primary")
    log(f"dev {task.name}: ranking {len(names)} members alone on {len(items)} dev items "
        f"(for the primary member{' and auto' if with_auto else ''})")
    t0 = time.perf_counter()
    ranked = run_rows(cfg, base, task, [MethodSpec(f"single:{n}", "engine", (n,)) for n in names], items,
                      settings, split="dev")
    best = auto.best_single(ranked).split(":", 1)[1]
    acc = {n: auto.accuracy(ranked[f"single:{n}"]) for n in names}
    settings.primaries[task.name] = {"member": best, "from": "dev", "dev_items": len(items), "dev_acc": acc}
    log(f"dev {task.name}: primary {best} (dev accuracy {', '.join(f'{n} {_pct(a)}' for n, a in acc.items())}), "
        f"{time.perf_counter() - t0:.1f} s")
    return best


def choose_on_dev(cfg, base, task, table: Sequence[MethodSpec], settings: EvalSettings, *,
                  log: Callable[[str], None] | None = None) -> MethodSpec:
    """``auto`` (``tokenfuse.eval.auto``): every table row and candidate on the dev items, then the
    choice; returns the chosen row or candidate. ``log`` (default: standard error) gets a line when
    each dev stage starts and when it is done."""
    from tokenfuse.eval import auto

    log = log or stderr_log
    form = task_form(task, settings.mc)
    limit, member_limit = auto.dev_counts(form, settings.dev_limit, settings.member_dev_limit)
    dev_items = task.dev_subset(limit, settings.seed)
    if not dev_items:
        raise TokenfuseError(f"auto: task {task.name!r} has no dev items to choose on")
    # The members alone rank on at least as many dev items (cheap rows; the seeded order makes
    # dev_items the first of them), every other row and candidate on dev_items.
    member_items = task.dev_subset(member_limit, settings.seed)
    singles = [s for s in table if s.name.startswith("single:")]
    primary = settings.primaries.get(task.name, {})
    again = primary.get("from") == "dev" and primary.get("dev_items") == len(member_items)  # task_primary's
    if not again:
        log(f"dev {task.name}: ranking {len(singles)} members alone on {len(member_items)} dev items (for auto)")
    t0 = time.perf_counter()
    ranked = run_rows(cfg, base, task, singles, member_items, settings, split="dev")
    if not again:
        log(f"dev {task.name}: members ranked for auto, {time.perf_counter() - t0:.1f} s")
    extra = auto.candidates(cfg, ranked)  # they follow the members' dev accuracies; then all rows share forwards
    log(f"dev {task.name}: auto runs {len(table) + len(extra)} rows and candidates on {len(dev_items)} dev items")
    t0 = time.perf_counter()
    dev = run_rows(cfg, base, task, [*table, *extra], dev_items, settings, split="dev")
    choice = auto.choose(dev, ranked)
    log(f"dev {task.name}: auto chose {choice.chosen} (dev accuracy {_pct(choice.dev_acc[choice.chosen])}; "
        f"best member {choice.best_single.split(':', 1)[1]} {_pct(choice.dev_acc[choice.best_single])}), "
        f"{time.perf_counter() - t0:.1f} s")
    spec = next(s for s in [*table, *extra] if s.name == choice.chosen)
    config = auto.chosen_config(cfg, spec)
    pool = {"source": task.dev_source, "size": len(task.dev_items()), "asked": limit, "member_asked": member_limit}
    note = auto.dev_note(limit, member_limit, used=len(dev_items), member_used=len(member_items),
                         pool=pool["size"], source=pool["source"])
    info = choice.as_dict() | {"dev_pool": pool, "dev_note": note, "config": None}
    if config is not None:
        path = Path(settings.out) / "auto" / f"{task.name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(auto.config_text(config, choice, task=task.name, note=note), encoding="utf-8")
        info["config"] = str(path)
    settings.auto_choices[task.name] = info
    return spec
