"""``tokenfuse analyze tokenizers|calibration|compare|letters|pieces|options|answers``: argument parsing only."""

from __future__ import annotations

import argparse

from tokenfuse.errors import TokenfuseError
from tokenfuse.flags import config_from_args


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("analyze", help="tokenizer agreement (GaC Fig. 2), calibration (GaC Tab. 1) and "
                                              "readings of eval records")
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
    r = sub.add_parser("compare", help="two sets of eval records of one task and form, item by item")
    r.add_argument("old", help="a folder of records, e.g. OUT/items/mmlu-likelihood")
    r.add_argument("new", help="the folder of the same task and form to compare it with")
    g = sub.add_parser("letters", help="the letters of the gold answers and of each row's answers (letter form)")
    g.add_argument("task", help="multiple-choice task whose letter-form records are read")
    g.add_argument("--eval-out", required=True, help="the `tokenfuse eval --mc generate --out DIR` run")
    g.add_argument("--limit", type=int, default=500, help="the eval's --limit (default 500)")
    g.add_argument("--dev", action="store_true", help="auto's dev items instead of the test items")
    g.add_argument("--data", help="benchmark JSONL directory (default: $TOKENFUSE_DATA)")
    s = sub.add_parser("pieces", help="where a token-level row gains and loses bytes on a text run, piece by piece")
    s.add_argument("run", help="a finished `tokenfuse eval --tasks text --out DIR` run (its results.json, features/)")
    s.add_argument("--row", default="gac", help="token-level row (default gac)")
    s.add_argument("--docs", type=int, default=2, help="first test documents of each domain (default 2)")
    s.add_argument("--top", type=int, default=8, help="pieces shown where the row lost and saved most (default 8)")
    s.add_argument("--data", help="benchmark JSONL directory (default: $TOKENFUSE_DATA)")
    o = sub.add_parser("options", help="per likelihood task and row: the gold option's NLL per byte and its margin "
                                       "to the best wrong option, against the best member")
    o.add_argument("run", help="a `tokenfuse eval --out DIR` run with likelihood records")
    o.add_argument("--tasks", help="comma-separated tasks (default: every likelihood task of the run)")
    o.add_argument("--dev", action="store_true", help="auto's dev items instead of the test items")
    a = sub.add_parser("answers", help="per generative task: which bytes of the gold answers the byte rows give less "
                                       "probability than the best member")
    a.add_argument("--tasks", default="gsm8k,triviaqa,nq_open",
                   help="comma-separated generate-form tasks with gold answer texts (default gsm8k,triviaqa,nq_open)")
    a.add_argument("--models", help="comma-separated members (default: the three bundled models)")
    a.add_argument("--config", help="ensemble config YAML (its members; a byte method's params.fit and pruning)")
    a.add_argument("--limit", type=int, default=50, help="items per task: the eval's seeded subset (default 50)")
    a.add_argument("--seed", type=int, default=1234, help="seed of the item subsets, as tokenfuse eval's (default 1234)")
    a.add_argument("--dev", action="store_true", help="dev items instead of the test items")
    a.add_argument("--top", type=int, default=8, help="bytes shown where byte-gate loses most (default 8; 0: none)")
    a.add_argument("--data", help="benchmark JSONL directory (default: $TOKENFUSE_DATA)")
    a.add_argument("--out", help="directory for answers.md and answers.json (default: print only)")
    a.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def run(args: argparse.Namespace) -> int:
    if args.analysis is None:
        raise TokenfuseError("analyze: choose tokenizers, calibration, compare, letters, pieces, options or answers "
                             "(tokenfuse analyze --help)")
    if args.analysis == "compare":
        from tokenfuse.analyze.compare import compare_records

        print(compare_records(args.old, args.new))
        return 0
    if args.analysis == "letters":
        from tokenfuse.analyze.letters import letter_counts

        print(letter_counts(args.task, args.eval_out, limit=args.limit, dev=args.dev, data=args.data))
        return 0
    if args.analysis == "pieces":
        from tokenfuse.analyze.pieces import text_pieces

        print(text_pieces(args.run, row=args.row, docs=args.docs, top=args.top, data=args.data))
        return 0
    if args.analysis == "options":
        from tokenfuse.analyze.options import option_tables

        print(option_tables(args.run, args.tasks.split(",") if args.tasks else None, dev=args.dev))
        return 0
    cfg = config_from_args(args)
    if args.analysis == "answers":
        from tokenfuse.analyze.answers import answer_bytes

        print(answer_bytes(cfg, [t.strip() for t in args.tasks.split(",") if t.strip()], limit=args.limit,
                           seed=args.seed, dev=args.dev, data=args.data, top=args.top, out=args.out,
                           progress=not args.quiet))
        return 0
    if args.analysis == "tokenizers":
        from tokenfuse.analyze.tokenizers import run_tokenizers

        print(run_tokenizers(cfg, n_words=args.words, out=args.out))
        return 0
    from tokenfuse.analyze.calibration import run_calibration

    print(run_calibration(cfg, task=args.task, limit=args.limit, data=args.data, methods=args.methods,
                          bins=args.bins, eval_out=args.eval_out, out=args.out, progress=not args.quiet))
    return 0
