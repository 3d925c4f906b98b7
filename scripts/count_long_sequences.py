"""How many evaluated sequences pass a length in a member's ids.

llama.cpp gives another set of numbers to a copied cache longer than a sliding window (Gemma-3:
512; docs/methods.md, "Prefix cache"), so only sequences past it could be touched by that fix. Per task, on
the items `tokenfuse eval --limit N` evaluates and on `auto`'s dev items, prints the longest
sequence and how many pass `--over`: for a multiple-choice task its likelihood form (the context
with its longest option), for the others the raw few-shot prompt (what a member without a chat
template, Gemma-3, is given), with the member's BOS. Only the bundled tokenizer is loaded.

Usage: TOKENFUSE_DATA=../shared/benchmarks .venv/bin/python scripts/count_long_sequences.py \
    arc_challenge arc_easy piqa boolq mmlu triviaqa nq_open [--member gemma3-270m] [--limit 500] [--dev-limit 200] [--over 512]
"""

from __future__ import annotations

import argparse

from tokenfuse.members.fasttok import FastTokenizer
from tokenfuse.members.gguf_tokenizer import ensure_tokenizer
from tokenfuse.tasks import load_task


def _sequences(task, item) -> list[str]:
    """The texts a member is fed for ``item``: each option after the context, or the prompt."""
    if not task.multiple_choice:
        return [task.raw_prompt(item)]
    cloze = task.cloze(item)
    return [cloze.context + c for c in cloze.continuations]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tasks", nargs="+")
    ap.add_argument("--member", default="gemma3-270m")
    ap.add_argument("--limit", type=int, default=500)
    ap.add_argument("--dev-limit", type=int, default=200)
    ap.add_argument("--over", type=int, default=512)
    args = ap.parse_args()
    tok = FastTokenizer(ensure_tokenizer(args.member, progress=False))
    for name in args.tasks:
        task = load_task(name)
        for split, items in (("test", task.subset(args.limit)), ("dev", task.dev_subset(args.dev_limit))):
            lengths = [max(len(tok(text)["input_ids"]) for text in _sequences(task, item)) for item in items]
            print(f"{name:14s} {split:4s} {len(items):4d} items: longest {max(lengths, default=0):5d} ids, "
                  f"{sum(n > args.over for n in lengths)} past {args.over}", flush=True)


if __name__ == "__main__":
    main()
