"""``tokenfuse analyze tokenizers|calibration``: argument parsing only."""

from __future__ import annotations

import argparse

from tokenfuse.config import EnsembleConfig
from tokenfuse.errors import TokenfuseError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("analyze", help="tokenizer agreement (GaC Fig. 2) and calibration (GaC Tab. 1)")
    sub = p.add_subparsers(dest="analysis")
    t = sub.add_parser("tokenizers", help="pairwise share of common English words tokenised identically")
    t.add_argument("--models", help="comma-separated members (default: the three bundled models)")
    t.add_argument("--config", help="ensemble config YAML (its members)")
    t.add_argument("--words", type=int, default=5000, help="most common English words (wordfreq; default 5000)")
    t.add_argument("--out", default="analyze-out", help="directory for tokenizers.md/.json/.png")
    c = sub.add_parser("calibration", help="expected calibration error and reliability diagrams on an MC task")
    c.add_argument("--models", help="comma-separated members (default: the three bundled models)")
    c.add_argument("--config", help="ensemble config YAML")
    c.add_argument("--task", default="arc_easy", help="multiple-choice task (default arc_easy)")
    c.add_argument("--limit", type=int, default=100, help="items (a fixed seeded subset; default 100)")
    c.add_argument("--data", help="benchmark JSONL directory (default: $TOKENFUSE_DATA)")
    c.add_argument("--methods", default="gac", help="ensembles to include besides each member (default gac)")
    c.add_argument("--bins", type=int, default=10, help="confidence bins (default 10)")
    c.add_argument("--eval-out", help="reuse the likelihood records of a `tokenfuse eval --out DIR` run")
    c.add_argument("--out", default="analyze-out", help="directory for calibration.md/.json/.png")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def run(args: argparse.Namespace) -> int:
    if args.analysis is None:
        raise TokenfuseError("analyze: choose tokenizers or calibration (tokenfuse analyze --help)")
    cfg = EnsembleConfig.from_args(args)
    if args.analysis == "tokenizers":
        from tokenfuse.analyze.tokenizers import run_tokenizers

        print(run_tokenizers(cfg, n_words=args.words, out=args.out))
        return 0
    from tokenfuse.analyze.calibration import run_calibration

    print(run_calibration(cfg, task=args.task, limit=args.limit, data=args.data, methods=args.methods,
                          bins=args.bins, eval_out=args.eval_out, out=args.out, progress=not args.quiet))
    return 0
