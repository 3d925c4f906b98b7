"""The rows of a task run on a list of items, batch by batch and resumable (``tokenfuse.eval.runner``
is the whole run): what a run is asked for (``EvalSettings``), each engine row built on the loaded
members (``build_variant``), the rows of one form batch by batch across the rows
(``run_rows_batch_by_batch``: the likelihood rows sharing the members' forwards through a
``RowMemo``, the generate rows the members' prefix caches; dev records through the dev cache), the
answer rows from the members' samples and the output-level rows from the members' records
(``run_rows``). The module docstring of ``tokenfuse.eval.runner`` says how a row's time is counted.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenfuse.errors import TokenfuseError
from tokenfuse.eval import answers
from tokenfuse.eval.answers import DEFAULT_SAMPLES, DEFAULT_TEMPERATURE
from tokenfuse.eval.methods import MethodSpec
from tokenfuse.eval.records import append_records, item_file, keep_if_made_by, read_records
from tokenfuse.eval.rows import generate_records, likelihood_records, output_record
from tokenfuse.paths import cache_dir
from tokenfuse.progress import on_terminal, progress_bar
from tokenfuse.tasks import prompt_form

FORMS = ("likelihood", "generate")
PROGRESS_EVERY = 60.0  # off a terminal: at most one line per this many seconds while the items of a task run
DEFAULT_TASKS = ("gsm8k", "mmlu", "arc_challenge", "arc_easy", "piqa", "boolq", "triviaqa", "nq_open", "bbh")


@dataclass
class EvalSettings:
    """What to run.

    Attributes:
        tasks: task names (``tokenfuse.tasks.TASKS``).
        methods: method names (``tokenfuse.eval.methods``).
        limit: items per task (a fixed seeded subset; ``None`` = all); ``limits`` per task override it.
        mc: form of the multiple-choice tasks: ``likelihood`` (default) or ``generate``.
        max_new_tokens: per-task generation limits overriding the task's own (``{"gsm8k": 192}``).
        dev_limit: dev items per task for the ``auto`` row's choice (every row and candidate; default
            500 in the likelihood form, 200 in the generate form, ``eval.auto.dev_counts``).
        member_dev_limit: dev items the members alone are ranked on, for ``auto`` (the same defaults;
            never fewer than ``dev_limit``) and for the task's primary member (default without
            ``auto``: as many as the task's test items, at most those defaults,
            ``eval.auto.primary_dev_count``).
        dev_cache: reuse dev records across runs (``tokenfuse.eval.devcache``): on in ``tokenfuse eval``
            (``--no-dev-cache`` turns it off), off by default here.
        samples, sample_temperature: ``mux``/``sc``'s ``k`` and temperature (``tokenfuse.eval.answers``;
            the samples are seeded from ``seed``).
    """

    tasks: Sequence[str] = DEFAULT_TASKS
    methods: Sequence[str] = ("single", "gac", "gac-threshold", "unite", "deepen", "vote", "mbr")
    limit: int | None = None
    limits: dict[str, int] = field(default_factory=dict)
    seed: int = 1234
    data: str | None = None
    out: str = "eval-out"
    mc: str = "likelihood"
    batch_size: int = 8
    max_new_tokens: dict[str, int] = field(default_factory=dict)
    num_fewshot: int | None = None
    progress: bool = True
    samples: int = DEFAULT_SAMPLES  # mux / sc: answers each member samples per item for mux (k; sc takes k × M)
    sample_temperature: float = DEFAULT_TEMPERATURE  # mux / sc: the samples' temperature
    dev_limit: int | None = None  # auto's dev items per task (default ``eval.auto.DEV_LIMITS`` by form: 500 / 200)
    member_dev_limit: int | None = None  # the members alone (default ``eval.auto.primary_dev_count``)
    dev_cache: bool = False  # dev records shared across runs (``eval.devcache``); ``tokenfuse eval`` turns it on
    auto_choices: dict[str, dict] = field(default_factory=dict)  # filled by the run: auto's choice per task
    threshold: float | None = None  # gac-threshold's threshold where the config has no gate (``--threshold``)
    primaries: dict[str, dict] = field(default_factory=dict)  # filled by the run: each task's primary member


def task_form(task, mc: str) -> str:
    if mc not in FORMS:
        raise TokenfuseError(f"--mc: expected one of {', '.join(FORMS)}, got {mc!r}")
    return mc if task.multiple_choice else "generate"


def build_variant(cfg, base, spec: MethodSpec, *, progress: bool = False):
    """The ``Ensemble`` of one engine row on ``base``'s loaded members (a ``single:`` row is the
    member alone; any other row ``base.variant`` with the config's options and weights after the
    row's overrides)."""
    from tokenfuse.engine import Ensemble

    if spec.name.startswith("single:"):
        member = next(m for m in base.members if m.name == spec.members[0])
        return Ensemble.single(member, window=cfg.window, align_cache=base.align_cache, scoring=cfg.scoring)
    variant = cfg.with_overrides(**spec.overrides, origin=f"method {spec.name}")
    return base.variant(variant.options, weights=[mc.weight for mc in variant.members], progress=progress)


def task_items(task, settings: EvalSettings) -> list[dict]:
    """The task's test items of this run: its fixed seeded subset for ``--limit`` / ``--task-limits``."""
    return task.subset(settings.limits.get(task.name, settings.limit), settings.seed)


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_rows(cfg, base, task, specs: Sequence[MethodSpec], items: Sequence[dict],
             settings: EvalSettings, *, split: str = "test") -> dict[str, list[dict]]:
    """Run (or resume) ``specs`` on ``items`` (``split``: ``test``, or ``dev`` for ``auto``'s choice,
    kept apart under ``items/<task>-<form>-dev/``); the records per row, in item order."""
    form = task_form(task, settings.mc)
    where = form if split == "test" else f"{form}-dev"
    out = Path(settings.out)
    primary = [m.name for m in base.members].index(cfg.primary_name)
    engine = [s for s in specs if s.kind == "engine"]
    run_form_rows = run_likelihood_rows if form == "likelihood" else run_generate_rows
    run_form_rows(cfg, base, task, engine, items, settings, where=where)
    sampled = run_answer_rows(cfg, base, task, [s for s in specs if s.kind == "answers"], items, settings,
                              where=where)
    records: dict[str, list[dict]] = {}
    for spec in specs:
        if spec.kind == "answers":
            records[spec.name] = sampled[spec.name]
            continue
        path = item_file(out, task.name, where, spec.name)
        if spec.kind == "output":
            done = read_records(path)
            singles = [{r["id"]: r for r in records[f"single:{n}"]} for n in spec.members]
            append_records(path, [output_record(spec, task, it, [s[it["id"]] for s in singles], primary=primary,
                                                form=form) for it in items if str(it["id"]) not in done])
        done = read_records(path)
        records[spec.name] = [done[str(it["id"])] for it in items]
    return records


def run_answer_rows(cfg, base, task, specs: Sequence[MethodSpec], items: Sequence[dict], settings: EvalSettings, *,
                    where: str) -> dict[str, list[dict]]:
    """The answer rows (``mux``, ``sc:<member>``): the members' samples drawn or resumed
    (``answers.run_samples``), then every row's records from them (``answers.answer_rows``)."""
    if not specs:
        return {}
    k, width = settings.samples, len(cfg.members)
    need = answers.samples_needed(specs, k, width)
    singles = {m: build_variant(cfg, base, MethodSpec(f"single:{m}", "engine", (m,))) for m in need}
    out = Path(settings.out)
    drawn = answers.run_samples(singles, task, need, items, out=out, where=where, seed=settings.seed,
                                temperature=settings.sample_temperature, batch_size=settings.batch_size,
                                max_new_tokens=settings.max_new_tokens.get(task.name) or task.max_new_tokens,
                                progress=settings.progress)
    return answers.answer_rows(specs, drawn, items, out=out, task=task.name, where=where, k=k, width=width,
                               primary=cfg.primary_name)


def run_rows_batch_by_batch(cfg, base, task, specs: Sequence[MethodSpec], items: Sequence[dict],
                            settings: EvalSettings, *, where: str, batch_size: int,
                            score: Callable[[object, list[dict], object], list[dict]],
                            new_batch: Callable[[], object] = lambda: None,
                            postfix: Callable[[object], str] | None = None) -> None:
    """Every engine row of a task, batch by batch: each batch of items goes through every row that
    has not done it, one row after the other, before the next batch; a row's records are appended as
    soon as it finishes the batch (an interrupted run resumes from them).

    ``score(ensemble, items, state)`` gives a row's records for its items of the batch; ``state`` is
    what ``new_batch()`` made for the batch, shared by its rows; ``postfix(state)`` after each batch
    is shown on the progress bar. On dev items (``where`` ending in ``-dev``) the records of earlier
    runs come from the dev cache first, and the new ones go to it (``tokenfuse.eval.devcache``). Off
    a terminal (a log file, a pipe), with progress on, a plain line ``<desc>: n/N items, S s`` is
    written after a batch once ``PROGRESS_EVERY`` seconds have passed since the last one, besides
    the progress display's own line at the end."""
    out = Path(settings.out)
    paths = {s.name: item_file(out, task.name, where, s.name) for s in specs}
    for s in specs:
        moved = keep_if_made_by(paths[s.name], {"members": list(s.members), "overrides": s.overrides})
        if moved is not None:
            print(f"{task.name}-{where} {s.name}: configured otherwise than its records; they were moved to "
                  f"{moved} and the row runs again", file=sys.stderr)
    cache, keys = dev_cache(cfg, base, task, specs, items, settings, where=where)
    if cache is not None:
        taken = {s.name: cache.fill(keys[s.name], paths[s.name], s.name) for s in specs if s.name in keys}
        if sum(taken.values()):
            print(f"{task.name}-{where}: {sum(taken.values())} records of {sum(n > 0 for n in taken.values())} "
                  f"rows taken from the dev cache ({cache.root})", file=sys.stderr, flush=True)
    todo = {s.name: {str(it["id"]) for it in items} - set(read_records(paths[s.name])) for s in specs}
    rows = [s for s in specs if todo[s.name]]
    if not rows:
        return
    variants = {s.name: build_variant(cfg, base, s, progress=settings.progress) for s in rows}
    pending = [it for it in items if any(str(it["id"]) in todo[s.name] for s in rows)]
    desc = f"eval {task.name}-{where} ({len(rows)} rows)"
    done, shown = len(items) - len(pending), 0.0
    lines = settings.progress and not on_terminal()
    with progress_bar(total=len(items), desc=desc, unit="item", enabled=settings.progress, initial=done) as bar:
        for start in range(0, len(pending), batch_size):
            batch = pending[start:start + batch_size]
            state = new_batch()
            for spec in rows:
                mine = [it for it in batch if str(it["id"]) in todo[spec.name]]
                if mine:
                    new = score(variants[spec.name], mine, state)
                    for r in new:
                        r["method"] = spec.name
                    append_records(paths[spec.name], new)
                    if spec.name in keys:
                        cache.add(keys[spec.name], new)
            if postfix is not None:
                bar.set_postfix_str(postfix(state), refresh=False)
            bar.update(len(batch))
            done += len(batch)
            elapsed = bar.format_dict["elapsed"] if lines and done < len(items) else 0.0
            if elapsed - shown >= PROGRESS_EVERY:
                print(f"{desc}: {done}/{len(items)} items, {elapsed:.1f} s", file=sys.stderr, flush=True)
                shown = elapsed
    del variants
    gc.collect()


def dev_cache(cfg, base, task, specs: Sequence[MethodSpec], items: Sequence[dict], settings: EvalSettings, *,
              where: str):
    """The dev cache for the engine rows ``specs`` on dev items and each cacheable row's key
    (``tokenfuse.eval.devcache``); ``(None, {})`` on test items, with the cache off, or when no row
    is cacheable."""
    from tokenfuse.eval import devcache

    if not where.endswith("-dev") or not settings.dev_cache:
        return None, {}
    form = task_form(task, settings.mc)
    limit = settings.max_new_tokens.get(task.name) or task.max_new_tokens
    keys = {s.name: k for s in specs
            if (k := devcache.row_key(cfg, base, s, task=task.name, form=form, max_new_tokens=limit)) is not None}
    if not keys:
        return None, {}
    return devcache.DevCache(cache_dir(cfg.cache_dir), task, form, items), keys


def run_generate_rows(cfg, base, task, specs: Sequence[MethodSpec], items: Sequence[dict],
                      settings: EvalSettings, *, where: str = "generate") -> None:
    """The generate form's rows batch by batch: each row takes the batch's prompts from the members'
    pooled contexts the previous row left, so a member prefills a prompt about once for the whole
    table instead of once per row. Exact: a row's output for an item does not depend on its batch
    (the default guarantee) and the prefix cache reuses only what a fresh prefill computes alike."""
    limit = settings.max_new_tokens.get(task.name) or task.max_new_tokens

    def score(ens, mine, _state):
        return generate_records(ens, task, mine, chat=prompt_form(ens.members), max_new_tokens=limit)

    run_rows_batch_by_batch(cfg, base, task, specs, items, settings, where=where,
                            batch_size=settings.batch_size, score=score)


def run_likelihood_rows(cfg, base, task, specs: Sequence[MethodSpec], items: Sequence[dict],
                        settings: EvalSettings, *, where: str = "likelihood") -> None:
    """The likelihood form's rows batch by batch, the rows of a batch sharing one ``RowMemo`` (a
    member's forward over the same ids — the same primary member's cuts — is computed once per
    batch, not once per row); half the generate form's batch, as one item is 2-5 requests."""
    from tokenfuse.engine import RowMemo

    shared = [0, 0]  # memo hits, misses over the batches so far

    def postfix(memo) -> str:
        shared[0] += memo.hits
        shared[1] += memo.misses
        return f"shared={shared[0] / max(sum(shared), 1):.0%}"

    run_rows_batch_by_batch(cfg, base, task, specs, items, settings, where=where,
                            batch_size=max(1, settings.batch_size // 2), new_batch=RowMemo,
                            score=lambda ens, mine, memo: likelihood_records(ens, task, mine, memo=memo),
                            postfix=postfix)
