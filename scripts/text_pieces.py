"""Where a token-level row gains and loses bytes against the primary member alone, piece by piece, from
a finished ``text`` run's kept numbers (``RUN/features/``) and its fitted parameters; no model call.

    TOKENFUSE_DATA=../shared/benchmarks python scripts/text_pieces.py RUN [--row gac] [--docs 2] [--top 8]

For each domain's first ``--docs`` test documents: the bits the row saves or loses against the
primary, in total and on the pieces where they differ most (the piece's bytes, both log-probabilities).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from tokenfuse.combiners.mixers import Fitted
from tokenfuse.engine import text_rows
from tokenfuse.engine.text_features import DocFeatures
from tokenfuse.eval.text import doc_key, per_domain
from tokenfuse.tasks.text import load_documents


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run")
    ap.add_argument("--row", default="gac", choices=text_rows.TOKEN_ROWS)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    run = Path(args.run)
    res = json.loads((run / "results.json").read_text())
    fitted = Fitted.from_dict(res["fitted"][args.row])
    folder = run / "features" / f"test-{res['primary']}"
    for d in per_domain(load_documents("test"), args.docs):
        f = DocFeatures.from_npz(np.load(folder / f"{doc_key(d)}.npz"))
        true, cand = text_rows.components(f, len(res["members"]))
        row = text_rows.token_logprobs(args.row, true, cand, f, fitted)
        alone = np.log(f.p_true)
        data = d.text.encode("utf-8")
        cuts = np.concatenate([[0], np.cumsum(f.piece_bytes)])
        diff = (row - alone) / math.log(2)  # bits saved by the row (positive: the row is better)
        print(f"\n{d.domain} {d.id}: {d.nbytes} bytes, {len(row)} pieces; {args.row} saves {diff.sum():+.1f} bits "
              f"({diff.sum() / d.nbytes:+.4f} per byte); pieces better {np.sum(diff > 0.01)}, "
              f"worse {np.sum(diff < -0.01)}; saved on better pieces {diff[diff > 0].sum():.1f}, "
              f"lost on worse {diff[diff < 0].sum():.1f}")
        for label, order in (("lost most", np.argsort(diff)[: args.top]), ("saved most", np.argsort(-diff)[: args.top])):
            print(f"  {label}:")
            for k in order:
                piece = data[cuts[k]:cuts[k + 1]].decode("utf-8", "backslashreplace")
                ctx = data[max(0, cuts[k] - 12):cuts[k]].decode("utf-8", "replace")
                print(f"    {ctx!r:>18} | {piece!r:<12} primary {alone[k] / math.log(2):7.2f} "
                      f"{args.row} {row[k] / math.log(2):7.2f} bits (others' exact-bytes e: "
                      + ", ".join(f"{f.e[j][k, f.true_at[k]]:.3f}" if f.true_at[k] >= 0 else "-" for j in sorted(f.e))
                      + ")")


if __name__ == "__main__":
    main()
