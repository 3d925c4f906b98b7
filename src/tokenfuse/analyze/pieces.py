"""``tokenfuse analyze pieces``: where a token-level row gains and loses bytes against the primary
member alone, piece by piece, from a finished ``text`` run's kept numbers (``RUN/features/``) and its
fitted parameters; no model call.

    TOKENFUSE_DATA=../shared/benchmarks tokenfuse analyze pieces RUN [--row gac] [--docs 2] [--top 8]

For each domain's first ``--docs`` test documents: the bits the row saves or loses against the
primary, in total and on the pieces where they differ most (the piece's bytes, both log-probabilities).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from tokenfuse.combiners.mixers import Fitted
from tokenfuse.engine import text_rows
from tokenfuse.engine.text_features import DocFeatures
from tokenfuse.errors import TokenfuseError
from tokenfuse.eval.text import doc_key, per_domain
from tokenfuse.tasks.text import load_documents


def text_pieces(run: Path, *, row: str = "gac", docs: int = 2, top: int = 8,
                data: str | os.PathLike | None = None) -> str:
    """The report of the module docstring (``data``: the benchmark files, else ``$TOKENFUSE_DATA``)."""
    run = Path(run)
    if row not in text_rows.TOKEN_ROWS:
        raise TokenfuseError(f"analyze pieces: --row is one of {', '.join(text_rows.TOKEN_ROWS)}, not {row!r}")
    if not (run / "results.json").is_file():
        raise TokenfuseError(f"analyze pieces: no results.json in {run} (a finished `tokenfuse eval --tasks text` run)")
    res = json.loads((run / "results.json").read_text(encoding="utf-8"))
    fitted = Fitted.from_dict(res["fitted"][row])
    folder = run / "features" / f"test-{res['primary']}"
    lines = []
    for d in per_domain(load_documents("test", data), docs):
        with np.load(folder / f"{doc_key(d)}.npz") as npz:
            f = DocFeatures.from_npz(npz)
        true, cand = text_rows.components(f, len(res["members"]))
        scores = text_rows.token_logprobs(row, true, cand, f, fitted)
        alone = np.log(f.p_true)
        data_bytes = d.text.encode("utf-8")
        cuts = np.concatenate([[0], np.cumsum(f.piece_bytes)]).astype(int)
        diff = (scores - alone) / math.log(2)  # bits saved by the row (positive: the row is better)
        lines.append(f"\n{d.domain} {d.id}: {d.nbytes} bytes, {len(scores)} pieces; {row} saves {diff.sum():+.1f} bits "
                     f"({diff.sum() / d.nbytes:+.4f} per byte); pieces better {np.sum(diff > 0.01)}, "
                     f"worse {np.sum(diff < -0.01)}; saved on better pieces {diff[diff > 0].sum():.1f}, "
                     f"lost on worse {diff[diff < 0].sum():.1f}")
        for label, order in (("lost most", np.argsort(diff)[:top]), ("saved most", np.argsort(-diff)[:top])):
            lines.append(f"  {label}:")
            for k in order:
                piece = data_bytes[cuts[k]:cuts[k + 1]].decode("utf-8", "backslashreplace")
                ctx = data_bytes[max(0, cuts[k] - 12):cuts[k]].decode("utf-8", "replace")
                lines.append(f"    {ctx!r:>18} | {piece!r:<12} primary {alone[k] / math.log(2):7.2f} "
                             f"{row} {scores[k] / math.log(2):7.2f} bits (others' exact-bytes e: "
                             + ", ".join(f"{f.e[j][k, f.true_at[k]]:.3f}" if f.true_at[k] >= 0 else "-"
                                         for j in sorted(f.e))
                             + ")")
    return "\n".join(lines)
