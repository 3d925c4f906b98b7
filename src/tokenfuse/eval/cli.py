"""``tokenfuse eval``: argument parsing only; the work is ``tokenfuse.eval.runner.run_eval``."""

from __future__ import annotations

import argparse
import sys
import time

from tokenfuse.config import EnsembleConfig
from tokenfuse.errors import TokenfuseError
from tokenfuse.eval.answers import DEFAULT_SAMPLES, DEFAULT_TEMPERATURE
from tokenfuse.eval.batches import FORMS
from tokenfuse.eval.methods import ALL_METHODS, DEFAULT_THRESHOLD
from tokenfuse.eval.report import markdown_table
from tokenfuse.eval.runner import DEFAULT_TASKS, EvalSettings, run_eval
from tokenfuse.eval.score_cli import add_pruning_arguments
from tokenfuse.eval.text_runs import TEXT_RUNS
from tokenfuse.flags import add_option_flags, config_from_args, refuse_option_flags


def _int_map(text: str | None, flag: str) -> dict[str, int]:
    """``"gsm8k=20,bbh=10"`` -> ``{"gsm8k": 20, "bbh": 10}``."""
    out = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        try:
            out[key.strip()] = int(value)
        except ValueError:
            raise TokenfuseError(f"{flag}: expected TASK=N[,TASK=N], got {part!r}") from None
        if not sep:
            raise TokenfuseError(f"{flag}: expected TASK=N[,TASK=N], got {part!r}")
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval", help="benchmark accuracy of each member alone, the ensembles and output-level baselines",
        description="Run every method on the same fixed seeded items of each task and write per-item JSONL "
                    "(resumable), results.json, results.md (GaC Tab. 3 shape) and results.png to --out.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="ensemble config YAML (members, weights, gate/threshold, unite params)")
    src.add_argument("--models", help="comma-separated members (default: the three bundled models)")
    add_option_flags(p, "eval", own=("gate", "threshold"))  # the ensemble options; these two are gac-threshold's
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="comma-separated tasks (default: all)")
    p.add_argument("--methods", default="single,gac,gac-threshold,unite,deepen,vote,mbr",
                   help=f"comma-separated subset of {','.join(ALL_METHODS)} (seq-avg is added in likelihood form)")
    p.add_argument("--limit", type=int, help="items per task: a fixed seeded subset (default: all)")
    p.add_argument("--task-limits", help="per-task item counts overriding --limit, e.g. gsm8k=20,bbh=10")
    p.add_argument("--data", help="benchmark JSONL directory (default: $TOKENFUSE_DATA)")
    p.add_argument("--out", default="eval-out", help="output directory (default: eval-out); a rerun resumes")
    p.add_argument("--mc", choices=FORMS, default="likelihood",
                   help="multiple-choice tasks: likelihood (cloze, default) or generate (a letter / yes-no)")
    p.add_argument("--max-new-tokens", dest="task_max_new_tokens", help="per-task generation limits, e.g. gsm8k=192,bbh=160")
    p.add_argument("--batch-size", type=int, default=8, help="items per generate call (default 8)")
    p.add_argument("--num-fewshot", type=int, help="override every task's number of shots")
    p.add_argument("--seed", type=int, default=1234, help="seed of the item subsets (default 1234)")
    p.add_argument("--gate", dest="eval_gate", help="gate of gac-threshold (default: the config's gate, else the task's primary member)")
    p.add_argument("--threshold", dest="eval_threshold", type=float, help="threshold of gac-threshold (default: the config's, else 0.5)")
    p.add_argument("--dev-limit", type=int, help="auto: dev items per task it chooses on (default 500 in the "
                                                 "likelihood form, 200 in the generate form; all when the "
                                                 "task's dev pool is smaller)")
    p.add_argument("--member-dev-limit", type=int,
                   help="dev items the members alone are ranked on: for auto (default 500 likelihood / 200 "
                        "generate; never fewer than --dev-limit) and for a task's primary member where the "
                        "config names none (default without auto: as many as the task's test items, at most "
                        "500 / 200)")
    p.add_argument("--no-dev-cache", dest="dev_cache", action="store_false",
                   help="do not reuse dev records from other runs (nor add to them): the dev cache under the "
                        "tokenfuse cache, eval-dev/")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES,
                   help=f"mux/sc: answers each member samples per item for mux (k, default {DEFAULT_SAMPLES}); each "
                        "sc:<member> row takes k × members of its member's samples (the same budget)")
    p.add_argument("--sample-temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"mux/sc: temperature of the samples (default {DEFAULT_TEMPERATURE}; seeded from --seed)")
    add_pruning_arguments(p, "--tasks text-bytes: the byte models' pruning: ")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars (the one-line messages per task and per dev stage stay)")
    refuse_option_flags(p, "eval")
    return p


def run(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise TokenfuseError(f"--limit: expected 1 or more, got {args.limit}")
    for flag, value in (("--dev-limit", args.dev_limit), ("--member-dev-limit", args.member_dev_limit)):
        if value is not None and value < 1:
            raise TokenfuseError(f"{flag}: expected 1 or more, got {value}")
    if args.samples < 1:
        raise TokenfuseError(f"--samples: expected 1 or more, got {args.samples}")
    if not args.sample_temperature > 0:
        raise TokenfuseError(f"--sample-temperature: expected more than 0 (0 is greedy: every sample alike), "
                             f"got {args.sample_temperature}")
    if args.batch_size < 1:
        raise TokenfuseError(f"--batch-size: expected 1 or more, got {args.batch_size}")
    if args.eval_threshold is not None and not 0 <= args.eval_threshold <= 1:
        raise TokenfuseError(f"--threshold: expected a number in [0, 1], got {args.eval_threshold}")
    cfg = config_from_args(args)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    for own in TEXT_RUNS:
        if own in tasks:
            if tasks != [own]:
                raise TokenfuseError(f"--tasks: {own} (bits per byte of held-out documents) runs on its own: "
                                     f"`--tasks {own}`, and the other tasks in another run")
            return _run_text(cfg, args, own)
    if args.eval_gate or (args.eval_threshold is not None and cfg.threshold is not None):  # only gac-threshold uses them
        threshold = args.eval_threshold if args.eval_threshold is not None else (cfg.threshold or DEFAULT_THRESHOLD)
        cfg = cfg.with_overrides(gate=args.eval_gate or cfg.gate, threshold=threshold, origin="--gate/--threshold")
    settings = EvalSettings(
        tasks=tasks, methods=args.methods, limit=args.limit,
        limits=_int_map(args.task_limits, "--task-limits"), seed=args.seed, data=args.data, out=args.out,
        mc=args.mc, batch_size=args.batch_size, max_new_tokens=_int_map(args.task_max_new_tokens, "--max-new-tokens"),
        num_fewshot=args.num_fewshot, progress=not args.quiet, dev_limit=args.dev_limit,
        member_dev_limit=args.member_dev_limit, dev_cache=args.dev_cache, threshold=args.eval_threshold,
        samples=args.samples, sample_temperature=args.sample_temperature)
    t0 = time.perf_counter()
    results = run_eval(cfg, settings)
    print(markdown_table(results))
    print(f"wrote {args.out}/results.json, results.md, results.png and items/ ({time.perf_counter() - t0:.0f} s)",
          file=sys.stderr)
    return 0


def _run_text(cfg: EnsembleConfig, args: argparse.Namespace, task: str = "text") -> int:
    from tokenfuse.engine.text_features import Rows
    from tokenfuse.eval.score_cli import pruning_of
    from tokenfuse.eval.text import TextSettings, run_text
    from tokenfuse.load import load_ensemble

    t0 = time.perf_counter()
    ens = load_ensemble(cfg, progress=not args.quiet)
    settings = TextSettings(out=args.out, data=args.data, limit=args.limit, primary=args.primary,
                            progress=not args.quiet, pruning=pruning_of(args))
    kind = TEXT_RUNS[task]
    results = run_text(kind([Rows.from_member(m) for m in ens.members], settings))
    print(kind.render(results))
    print(f"wrote {args.out}/results.json, results.md and items-{task}.jsonl ({time.perf_counter() - t0:.0f} s)",
          file=sys.stderr)
    return 0
