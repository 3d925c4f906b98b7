"""Speed of the proper text scores on the bundled members (issue 68's two speed targets), in one run:

- each member alone scoring a document (``eval.text.single_logprobs``: its log-probability at every
  position) against its backend prefilling the same ids in large calls, keeping only the last
  position's logits (``logprobs_at`` at the end);
- the token-level rows (``engine.text_features.doc_features``: every member's pass, healing, the
  candidates) against the sum of the members' own scoring.

    TOKENFUSE_DATA=../shared/benchmarks python scripts/bench/bench_text.py [--docs 5] [--json out.json]

``--members-only`` leaves the token-level rows out (the first target alone, a few minutes).

Documents: the first of each domain of ``text/dev.jsonl`` (dev: nothing here is a test number).
Each figure is the median of ``--repeats`` rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tokenfuse.config import EnsembleConfig
from tokenfuse.engine.text_features import Rows, doc_features, primary_tokens
from tokenfuse.eval.text import per_domain, single_logprobs
from tokenfuse.load import load_ensemble
from tokenfuse.tasks.text import load_documents


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def prefill(member, text: str) -> None:
    ids = member.encode_prompt("") + primary_tokens(member.codec, text)
    st = member.new_state(ids)
    try:
        member.logprobs_at(st, [len(ids)])
    finally:
        member.release(st)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=5, help="documents (the first of each domain, default 5)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--primary", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--members-only", action="store_true", help="only each member alone against its prefill")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args()
    ens = load_ensemble(EnsembleConfig.from_args(argparse.Namespace()), progress=False)
    docs = per_domain(load_documents("dev"), 1)[: args.docs]
    rows = [Rows.from_member(m) for m in ens.members]
    names = [m.name for m in ens.members]
    primary = names.index(args.primary)
    for m, r in zip(ens.members, rows):  # warm up: weights paged in, first-call costs
        prefill(m, docs[0].text[:200])
        single_logprobs(r, docs[0].text[:200])
    pre = {n: [] for n in names}
    alone = {n: [] for n in names}
    feats = []
    for _ in range(args.repeats):
        p = {n: 0.0 for n in names}
        a = {n: 0.0 for n in names}
        f = 0.0
        for d in docs:
            for m, r in zip(ens.members, rows):
                p[m.name] += _time(lambda: prefill(m, d.text))
                a[m.name] += _time(lambda: single_logprobs(r, d.text))
            if not args.members_only:
                f += _time(lambda: doc_features(d.text, rows, primary))
        for n in names:
            pre[n].append(p[n])
            alone[n].append(a[n])
        feats.append(f)
    nbytes = sum(d.nbytes for d in docs)
    out = {"documents": len(docs), "bytes": nbytes, "primary": args.primary, "members": {}}
    for n in names:
        pm, am = statistics.median(pre[n]), statistics.median(alone[n])
        out["members"][n] = {"prefill_s": round(pm, 2), "alone_s": round(am, 2),
                             "alone_speed_vs_prefill": round(pm / am, 3)}
        print(f"{n}: prefill {pm:.2f} s, alone {am:.2f} s -> scoring runs at {pm / am:.2f}x the prefill's speed")
    total_alone = sum(statistics.median(alone[n]) for n in names)
    if not args.members_only:
        fm = statistics.median(feats)
        out |= {"rows_s": round(fm, 2), "members_alone_sum_s": round(total_alone, 2),
                "rows_vs_members_sum": round(fm / total_alone, 3)}
        print(f"token-level rows {fm:.2f} s against the members' own scoring summed {total_alone:.2f} s: "
              f"{fm / total_alone:.2f}x ({len(docs)} documents, {nbytes:,} bytes)")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
