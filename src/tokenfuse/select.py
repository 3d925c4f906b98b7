"""``tokenfuse select``: determine-then-ensemble (UniTE §4.1).

Run every candidate member alone on the same items of a task, then choose the ensemble:

1. rank the candidates by accuracy (ties keep the candidates' order);
2. take the best;
3. go down the ranking and take a candidate when its accuracy is within ``max_gap`` points
   (10) of the best, and its mean response length is within a factor ``max_ratio`` (2) of every
   member taken so far (longer / shorter <= 2); stop taking once ``max_members`` are taken.

Both bounds are inclusive. The paper measures the length of responses without fixing a unit; here
it is the mean number of **UTF-8 bytes** of the generated output (after a stop string was trimmed),
which does not depend on any member's tokenizer. Accuracy is the task's own grading
(``tokenfuse.tasks``, the same code ``tokenfuse eval`` uses), on greedy outputs.

Prompt form: with ``prompt_form="auto"`` a candidate whose tokenizer has a chat template gets the
task's chat form (messages rendered with its own template), any other candidate the raw form.

``select_members`` is the rule alone (numbers in, decisions out); ``evaluate_candidate`` runs one
member; ``run_selection`` does both; ``selected_config`` turns the decision into the config that
``tokenfuse generate --config`` runs: the chosen members in ranked order with their other fields
as given, ``score`` = accuracy (0..1; the highest score is the default primary member), ``primary``
cleared, ``gate``/``threshold`` dropped if the gate was not chosen; written (``config_yaml``) with only
the fields that differ from their defaults, under a comment header holding the selection table.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenfuse.config import parse_config
from tokenfuse.errors import TokenfuseError
from tokenfuse.flags import config_from_args
from tokenfuse.tasks import (
    DEFAULT_SEED,
    PROMPT_FORMS,
    TASKS,
    generate_graded,
    load_task,
    uses_chat,
)

MAX_GAP_POINTS = 10.0
MAX_LENGTH_RATIO = 2.0
DEFAULT_MAX_MEMBERS = 3
DEFAULT_LIMIT = 100


@dataclass(frozen=True)
class CandidateResult:
    """One candidate alone on the task's items.

    Attributes:
        name: the member's name in the config.
        accuracy: share of items graded correct, 0..1.
        mean_bytes: mean UTF-8 length of the generated outputs.
        n: number of items.
        prompt_form: ``"chat"`` or ``"raw"``.
        seconds: wall time of the generation (loading excluded).
        outputs: per item ``{"id", "output", "bytes", "extracted", "correct"}``.
    """

    name: str
    accuracy: float
    mean_bytes: float
    n: int
    prompt_form: str = "raw"
    seconds: float = 0.0
    outputs: tuple[dict, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class Verdict:
    """Whether a candidate joins the ensemble, and why; ``rank`` 1 is the most accurate."""

    name: str
    rank: int
    taken: bool
    reason: str


@dataclass(frozen=True)
class Selection:
    results: list[CandidateResult]
    decisions: list[Verdict]
    config: Any  # EnsembleConfig

    @property
    def chosen(self) -> list[str]:
        return [d.name for d in self.decisions if d.taken]


# ---------------------------------------------------------------------------------------- the rule
def length_ratio(a: float, b: float) -> float:
    """longer / shorter (1 when both are empty, infinite when only one is)."""
    lo, hi = sorted((a, b))
    if lo <= 0:
        return 1.0 if hi <= 0 else math.inf
    return hi / lo


def select_members(results: Sequence[CandidateResult], *, max_members: int = DEFAULT_MAX_MEMBERS,
                   max_gap: float = MAX_GAP_POINTS, max_ratio: float = MAX_LENGTH_RATIO) -> list[Verdict]:
    """The determine-then-ensemble rule over measured numbers; decisions in ranked order.

    ``max_gap`` is in accuracy points (percent); both bounds are inclusive.
    """
    if max_members < 1:
        raise TokenfuseError(f"--max-members: expected 1 or more, got {max_members}")
    ranked = sorted(results, key=lambda r: -r.accuracy)  # stable: ties keep the candidates' order
    if not ranked:
        return []
    best = ranked[0]
    chosen: list[CandidateResult] = [best]
    decisions = [Verdict(best.name, 1, True, "best accuracy")]
    for rank, r in enumerate(ranked[1:], start=2):
        gap = 100.0 * (best.accuracy - r.accuracy)
        # the chosen member whose response length is furthest from this candidate's
        worst, other = max(((length_ratio(r.mean_bytes, c.mean_bytes), c) for c in chosen), key=lambda t: t[0])
        if gap > max_gap + 1e-9:
            reason, taken = f"accuracy {gap:.1f} points below the best (limit {max_gap:g})", False
        elif worst > max_ratio + 1e-9:
            reason = (f"mean length {r.mean_bytes:.0f} B vs {other.name} {other.mean_bytes:.0f} B: "
                      f"{worst:.2f}x (limit {max_ratio:g}x)")
            taken = False
        elif len(chosen) >= max_members:
            reason, taken = f"compatible, but --max-members {max_members} already taken", False
        else:
            reason = f"{gap:.1f} points below the best, length within {worst:.2f}x of the chosen"
            taken = True
            chosen.append(r)
        decisions.append(Verdict(r.name, rank, taken, reason))
    return decisions


# ---------------------------------------------------------------------------------------- running
def evaluate_candidate(ensemble, task, items: Sequence[dict], *, chat: bool, batch_size: int = 8,
                       max_new_tokens: int | None = None, progress: bool = True,
                       name: str | None = None) -> CandidateResult:
    """Generate greedily for ``items`` in batches with ``ensemble`` (one member) and grade the outputs
    (``tokenfuse.tasks.generate_graded``)."""
    from tokenfuse.progress import progress_bar

    if batch_size < 1:
        raise TokenfuseError(f"--batch-size: expected 1 or more, got {batch_size}")
    name = name or "+".join(m.name for m in ensemble.members)
    outputs, correct, total_bytes = [], 0, 0
    t0 = time.perf_counter()
    with progress_bar(total=len(items), desc=f"select {name} ({task.name})", unit="item", enabled=progress) as bar:
        for start in range(0, len(items), batch_size):
            batch = items[start:start + batch_size]
            for r in generate_graded(ensemble, task, batch, chat=chat, max_new_tokens=max_new_tokens):
                nbytes = len(r.generation.output)
                correct += r.score.correct
                total_bytes += nbytes
                outputs.append({"id": r.item["id"], "output": r.text, "bytes": nbytes,
                                "extracted": r.score.extracted, "correct": r.score.correct})
            bar.update(len(batch))
            bar.set_postfix(acc=f"{correct / len(outputs):.3f}")
    n = len(items)
    return CandidateResult(name, correct / n if n else 0.0, total_bytes / n if n else 0.0, n,
                           "chat" if chat else "raw", time.perf_counter() - t0, tuple(outputs))


def run_candidates(cfg, task, items: Sequence[dict], *, batch_size: int = 8, prompt_form: str = "auto",
                   max_new_tokens: int | None = None, progress: bool = True,
                   log: Callable[[str], None] | None = None) -> list[CandidateResult]:
    """Each member of ``cfg`` alone on ``items``: loaded once (``tokenfuse.placement.local.load_member``),
    run, then released before the next one is loaded."""
    from tokenfuse.engine import Ensemble
    from tokenfuse.paths import cache_dir
    from tokenfuse.placement.local import check_source, load_member

    root = cache_dir(cfg.cache_dir)
    for i, m in enumerate(cfg.members):
        check_source(m, i)
    results = []
    for i, mc in enumerate(cfg.members):
        t0 = time.perf_counter()
        member = load_member(mc, root=root, progress=progress, index=i)
        ens = Ensemble.single(member, window=cfg.window, align_cache=root / "alignment")
        if log:
            log(f"{mc.name}: loaded in {time.perf_counter() - t0:.1f} s")
        chat = uses_chat(member, prompt_form)
        results.append(evaluate_candidate(ens, task, items, chat=chat, batch_size=batch_size,
                                          max_new_tokens=max_new_tokens, progress=progress, name=mc.name))
        del ens, member
        gc.collect()
    return results


def selected_config(cfg, results: Sequence[CandidateResult], decisions: Sequence[Verdict]):
    """The chosen ensemble as an ``EnsembleConfig`` (see the module docstring)."""
    acc = {r.name: r.accuracy for r in results}
    by_name = {m.name: m for m in cfg.members}
    chosen = [d.name for d in decisions if d.taken]
    data = cfg.model_dump()
    data["members"] = [{**by_name[n].model_dump(), "score": round(acc[n], 4)} for n in chosen]
    data["primary"] = None
    if data.get("gate") not in chosen:
        data["gate"], data["threshold"] = None, None
    return parse_config(data, origin="tokenfuse select")


def run_selection(cfg, task, items: Sequence[dict], *, max_members: int = DEFAULT_MAX_MEMBERS,
                  batch_size: int = 8, prompt_form: str = "auto", max_new_tokens: int | None = None,
                  progress: bool = True, log: Callable[[str], None] | None = None) -> Selection:
    """Run every candidate of ``cfg`` on ``items``, apply the rule, build the chosen config."""
    if max_members < 1:
        raise TokenfuseError(f"--max-members: expected 1 or more, got {max_members}")
    if not items:
        raise TokenfuseError(f"task {task.name!r}: no items to evaluate")
    results = run_candidates(cfg, task, items, batch_size=batch_size, prompt_form=prompt_form,
                             max_new_tokens=max_new_tokens, progress=progress, log=log)
    decisions = select_members(results, max_members=max_members)
    return Selection(results, decisions, selected_config(cfg, results, decisions))


# ---------------------------------------------------------------------------------------- output
def format_table(results: Sequence[CandidateResult], decisions: Sequence[Verdict]) -> str:
    """One row per candidate in ranked order: its numbers and the decision with its reason."""
    by_name = {r.name: r for r in results}
    width = max([len("candidate")] + [len(r.name) for r in results])
    lines = [f"{'rank':>4}  {'candidate':<{width}}  {'form':<4}  {'items':>5}  {'accuracy':>8}  "
             f"{'mean bytes':>10}  {'time':>7}  decision"]
    for d in decisions:
        r = by_name[d.name]
        lines.append(f"{d.rank:>4}  {r.name:<{width}}  {r.prompt_form:<4}  {r.n:>5}  {100 * r.accuracy:>7.1f}%  "
                     f"{r.mean_bytes:>10.1f}  {r.seconds:>6.0f}s  {'taken' if d.taken else 'left out'}: {d.reason}")
    return "\n".join(lines)


def config_yaml(config) -> str:
    """A config as YAML with only the fields that differ from their defaults (``method`` always)."""
    import yaml

    data = config.model_dump(exclude_defaults=True)
    data = {"members": data.pop("members"), "method": config.method, **data}
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def config_text(selection: Selection, *, task: str, n: int, seed: int) -> str:
    """The config YAML with the selection table as a comment header."""
    table = format_table(selection.results, selection.decisions)
    header = [f"# Chosen by `tokenfuse select` (determine-then-ensemble, UniTE §4.1) on {task}, "
              f"{n} items (seed {seed}).",
              "# score = the member's accuracy alone on those items (0..1); the highest is the primary member."]
    header += ["# " + line for line in table.splitlines()]
    return "\n".join(header) + "\n" + config_yaml(selection.config)


# ---------------------------------------------------------------------------------------- CLI
def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``tokenfuse select`` on the ``tokenfuse`` command's subparsers."""
    p = subparsers.add_parser(
        "select", help="determine-then-ensemble: run each candidate alone on a task, keep the compatible ones",
        description="Run each candidate alone on a fixed subset of a benchmark task's dev items (never its "
                    "evaluated items: tokenfuse.tasks, 'Dev items'), then take the best and "
                    "every next-best candidate within 10 accuracy points of it whose mean response length is "
                    "within 2x of the members already taken (UniTE §4.1).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="FILE",
                     help="candidates as an ensemble config YAML (its other fields are kept)")
    src.add_argument("--models", help="comma-separated candidates: bundled names, local dirs, .gguf files or hub ids "
                                      "(default: the three bundled models)")
    p.add_argument("--method", help="combiner of the chosen ensemble (default: the config's, else gac)")
    p.add_argument("--task", required=True, choices=list(TASKS), help="benchmark task")
    p.add_argument("--limit", type=int, metavar="N", default=DEFAULT_LIMIT,
                   help=f"dev items: a fixed seeded subset (default {DEFAULT_LIMIT}; 0 = all)")
    p.add_argument("--data", metavar="DIR", help="benchmark JSONL directory (default: $TOKENFUSE_DATA)")
    p.add_argument("--max-members", type=int, metavar="N", default=DEFAULT_MAX_MEMBERS,
                   help=f"largest ensemble (default {DEFAULT_MAX_MEMBERS})")
    p.add_argument("--out", metavar="FILE", help="write the chosen ensemble's config YAML here (default: print it)")
    p.add_argument("--seed", dest="subset_seed", type=int, metavar="N", default=DEFAULT_SEED,
                   help=f"seed of the item subset (default {DEFAULT_SEED})")
    p.add_argument("--num-fewshot", type=int, metavar="N", help="override the task's number of shots")
    p.add_argument("--max-new-tokens", dest="task_max_new_tokens", type=int, metavar="N",
                   help="override the task's generation limit")
    p.add_argument("--batch-size", type=int, metavar="N", default=8, help="items per generate call (default 8)")
    p.add_argument("--prompt-form", choices=PROMPT_FORMS, default="auto",
                   help="auto: chat form for members with a chat template, raw otherwise")
    p.add_argument("--predictions", metavar="FILE",
                   help="also write every candidate's outputs here (JSONL: candidate, id, output, bytes, extracted, "
                        "correct)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def run(args: argparse.Namespace) -> int:
    """``tokenfuse select``: returns the exit code (errors raise ``TokenfuseError``)."""
    if args.limit is not None and args.limit < 0:
        raise TokenfuseError(f"--limit: expected 0 (all) or more, got {args.limit}")
    cfg = config_from_args(args)
    task = load_task(args.task, args.data, num_fewshot=args.num_fewshot)
    items = task.dev_subset(args.limit or None, args.subset_seed)
    quiet = args.quiet or args.json
    log = None if quiet else (lambda msg: print(msg, file=sys.stderr))
    t0 = time.perf_counter()
    sel = run_selection(cfg, task, items, max_members=args.max_members, batch_size=args.batch_size,
                        prompt_form=args.prompt_form, max_new_tokens=args.task_max_new_tokens,
                        progress=not quiet, log=log)
    text = config_text(sel, task=task.name, n=len(items), seed=args.subset_seed)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    if args.predictions:
        with open(args.predictions, "w", encoding="utf-8") as f:
            for r in sel.results:
                for o in r.outputs:
                    f.write(json.dumps({"candidate": r.name, **o}, ensure_ascii=False) + "\n")
    if args.json:
        by_name = {d.name: d for d in sel.decisions}
        rows = [{**{k: v for k, v in asdict(r).items() if k != "outputs"},
                 "rank": by_name[r.name].rank, "taken": by_name[r.name].taken, "reason": by_name[r.name].reason}
                for r in sel.results]
        print(json.dumps({"task": task.name, "items": len(items), "seed": args.subset_seed,
                          "candidates": rows, "chosen": sel.chosen, "out": args.out,
                          "config": sel.config.model_dump(exclude_none=True),
                          "seconds": round(time.perf_counter() - t0, 1)}, ensure_ascii=False))
        return 0
    print(f"tokenfuse select: {task.name}, {len(items)} items (seed {args.subset_seed}), "
          f"{len(cfg.members)} candidates, {time.perf_counter() - t0:.0f} s")
    print(format_table(sel.results, sel.decisions))
    print(f"chosen: {', '.join(sel.chosen)}")
    if args.out:
        print(f"config written to {args.out} (run it: tokenfuse generate --config {args.out} ...)")
    else:
        print()
        print(config_yaml(sel.config), end="")
    return 0
