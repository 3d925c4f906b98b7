"""``tokenfuse score FILE...``: bits per byte of a user's own text under the ensemble's rows and each
member alone (the ``text`` task's rows, docs/methods.md "Proper scores of text").

Parameters: by default the members' weights (``--weights`` or the config's, normalised) are the
``doc-mix`` and ``gac`` weights, the ``switch`` prior and the ``poe`` exponents, and ``switch`` shares
``--alpha`` (default 0.01); ``--fitted RESULTS_JSON`` takes them from a ``text`` run instead (its
``fitted``, for the same members in the same order).

``--bytes``: the ``text-bytes`` task's rows instead (each member's byte view, ``doc-mix`` and the byte
rows, eval/text_bytes.py): the weights are those of ``byte-mix`` and ``doc-mix`` and ``byte-switch``'s
prior, ``--alpha`` its share; ``byte-gate`` needs a fit, so it is scored only with ``--fitted`` from a
``text-bytes`` run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tokenfuse.config import EnsembleConfig
from tokenfuse.errors import TokenfuseError

DEFAULT_ALPHA = 0.01


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "score", help="bits per byte of text files under each member alone and the ensemble's proper rows",
        description="Score each file's bytes (after each member's start token only) under every member alone, "
                    "the document-level mixture and the token-level rows gac, switch and poe.")
    p.add_argument("files", nargs="+", help="UTF-8 text files ('-' reads standard input)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="ensemble config YAML (members, weights)")
    src.add_argument("--models", help="comma-separated members (default: the three bundled models)")
    p.add_argument("--weights", help="comma-separated member weights (with --models)")
    p.add_argument("--primary", help="the member whose tokens the token-level rows predict "
                                     "(default: highest score in the config, else the first)")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help=f"switch: share per token (default {DEFAULT_ALPHA})")
    p.add_argument("--fitted", help="a text run's results.json: its fitted weights, share and exponents")
    p.add_argument("--json", action="store_true",
                   help='print JSON: {"bytes": n, "rows": {"<row>": {"bits_per_byte": x, "bits": b}}} per file')
    p.add_argument("--bytes", action="store_true",
                   help="the byte rows instead of the token-level ones: each member's exact byte-level view "
                        "(bytes:<member>), byte-mix, byte-switch and, with --fitted from a text-bytes run, "
                        "byte-gate (slower: about 40 ms per byte for the bundled three on a 2-core CPU)")
    p.add_argument("--pieces", action="store_true",
                   help="with --json: each token-level row's log-probability of each of the primary's tokens "
                        "(piece_logprobs, natural log) and their byte lengths (piece_bytes)")
    return p


def _read(path: str) -> str:
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as err:
        raise TokenfuseError(f"{path}: cannot read it ({err.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TokenfuseError(f"{path}: not UTF-8 text (byte {err.start} is not valid UTF-8)") from None


def _load_fit(path: str, names: list[str], task: str) -> dict:
    """The ``fitted`` entry of a ``task`` run's results.json, for these members in this order."""
    try:
        data = json.loads(Path(path).read_text())
        fit, members, kind = data["fitted"], data["members"], data.get("task", "text")
    except (OSError, ValueError, KeyError, TypeError):
        raise TokenfuseError(f"--fitted {path}: not a {task} run's results.json (it needs 'fitted' and "
                             "'members')") from None
    if kind != task:
        fix = {"text-bytes": "score its byte rows with --bytes", "text": "score its token-level rows without --bytes"}
        raise TokenfuseError(f"--fitted {path}: the fit of a {kind} run; "
                             + fix.get(kind, f"give a {task} run's results.json"))
    if members != names:
        raise TokenfuseError(f"--fitted {path}: fit for members {', '.join(members)}; this ensemble is "
                             f"{', '.join(names)} (the same members, in the same order)")
    return fit


def _fitted(path: str | None, names: list[str], weights: np.ndarray, alpha: float) -> dict:
    from tokenfuse.engine.text_rows import Fitted

    if path is None:
        return {"doc-mix": Fitted(weights=weights), "gac": Fitted(weights=weights),
                "switch": Fitted(weights=weights, alpha=alpha), "poe": Fitted(beta=weights)}
    return {row: Fitted.from_dict(p) for row, p in _load_fit(path, names, "text").items()}


def _byte_fitted(path: str | None, names: list[str], weights: np.ndarray, alpha: float) -> tuple[dict, np.ndarray]:
    """The byte rows' parameters and ``doc-mix``'s weights (``byte-gate`` only from a fit)."""
    from tokenfuse.engine.byte_rows import BYTE_ROWS, ByteFitted

    if path is None:
        w = weights.tolist()
        return {"byte-mix": ByteFitted(w), "byte-switch": ByteFitted(w, alpha)}, weights
    fit = _load_fit(path, names, "text-bytes")
    return {row: ByteFitted.from_dict(fit[row]) for row in BYTE_ROWS}, np.array(fit["doc-mix"]["weights"])


def run(args: argparse.Namespace) -> int:
    from tokenfuse.engine.text_features import Rows
    from tokenfuse.eval.text import score_texts
    from tokenfuse.load import load_ensemble

    if not 0 <= args.alpha <= 1:
        raise TokenfuseError(f"--alpha: expected a number in [0, 1], got {args.alpha}")
    if args.bytes and args.pieces:
        raise TokenfuseError("--pieces: the token-level rows' pieces; --bytes scores byte rows (leave one out)")
    texts = [_read(f) for f in args.files]
    cfg = EnsembleConfig.from_args(args)
    ens = load_ensemble(cfg, progress=not args.json)
    names = [m.name for m in ens.members]
    w = np.array([m.weight for m in ens.members], dtype=np.float64)
    members = [Rows.from_member(m) for m in ens.members]
    if args.bytes:
        from tokenfuse.eval import text_bytes

        fitted, doc_w = _byte_fitted(args.fitted, names, w / w.sum(), args.alpha)
        results = text_bytes.score_texts(members, texts, fitted, doc_w, progress=not args.json)
    else:
        fitted = _fitted(args.fitted, names, w / w.sum(), args.alpha)
        results = score_texts(members, texts, ens.primary, fitted, pieces=args.pieces)
    if args.json:
        out = results[0] if len(results) == 1 else {"files": dict(zip(args.files, results))}
        print(json.dumps(out))
        return 0
    rows = list(results[0]["rows"])
    print("| row | " + " | ".join(args.files) + " |")
    print("|---" * (len(args.files) + 1) + "|")
    for row in rows:
        print(f"| {row} | " + " | ".join(f"{r['rows'][row]['bits_per_byte']:.4f}" for r in results) + " |")
    what = "byte rows" if args.bytes else f"primary {names[ens.primary]}"
    sizes = ", ".join(f"{f}: {r['bytes']:,} bytes" for f, r in zip(args.files, results))
    print(f"bits per byte; {what}; {sizes}", file=sys.stderr)
    return 0
