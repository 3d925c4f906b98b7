"""``tokenfuse score FILE...``: bits per byte of a user's own text under the ensemble's rows and each
member alone (the ``text`` task's rows, docs/methods.md "Proper scores of text").

Parameters: by default the members' weights (``--weights`` or the config's, normalised) are the
``doc-mix`` and ``gac`` weights, the ``switch`` prior and the ``poe`` exponents, and ``switch`` shares
``--alpha`` (default 0.01); ``--fitted RESULTS_JSON`` takes them from a ``text`` run instead (its
``fitted``, for the same members in the same order).

``--bytes``: the ``text-bytes`` task's rows instead (each member's byte model, ``doc-mix`` and the byte
rows, eval/text_bytes.py): the weights are those of ``byte-mix`` and ``doc-mix`` and ``byte-switch``'s
prior, ``--alpha`` its share; ``byte-gate`` needs a fit, so it is scored only with ``--fitted`` from a
``text-bytes`` run. The byte models' pruning is the flags' (``--keep``, ``--width``, ``--rule``,
``--smooth``, ``--fallback``), each one left out the run's with ``--fitted``, else the default.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tokenfuse.errors import TokenfuseError
from tokenfuse.flags import config_from_args

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
                   help='print JSON: {"bytes": n, "rows": {"<row>": {"bits_per_byte": x, "bits": b}}} per file; '
                        'with --bytes also "members": {"<name>": {"rows": n, "view_seconds": s, "own_seconds": s}} '
                        '(the rows each byte model read, its seconds and those of the member\'s own scoring)')
    p.add_argument("--bytes", action="store_true",
                   help="the byte rows instead of the token-level ones: each member's exact byte-level view "
                        "(bytes:<member>), byte-mix, byte-switch and, with --fitted from a text-bytes run, "
                        "byte-gate (slower than the token-level rows: see docs/benchmarks.md, \"Byte models\")")
    add_pruning_arguments(p, "--bytes: ")
    p.add_argument("--pieces", action="store_true",
                   help="with --json: each token-level row's log-probability of each of the primary's tokens "
                        "(piece_logprobs, natural log) and their byte lengths (piece_bytes)")
    return p


def add_pruning_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The byte models' pruning (``alignment.bytemodel.Pruning``) as flags: one place for ``score --bytes``
    and ``eval --tasks text-bytes``. Each flag left out takes the default (``pruning_of``)."""
    from tokenfuse.alignment.bytemodel import FALLBACK, KEEP, RULE, RULES, SMOOTH, WIDTH

    p.add_argument("--keep", type=float,
                   help=f"{prefix}a history below this share of the prefix mass is pruned (default {KEEP}; 0: none)")
    p.add_argument("--width", help=f"{prefix}at most this many histories per boundary (default {WIDTH}; none: no limit)")
    p.add_argument("--rule", choices=RULES,
                   help=f"{prefix}where the pruned mass goes (default {RULE}; docs/methods.md, "
                        "\"A member as a byte-level model\")")
    p.add_argument("--smooth", type=float,
                   help=f"{prefix}share of each next-byte distribution spread evenly over the 257 outcomes "
                        f"(default {SMOOTH})")
    p.add_argument("--fallback", type=float,
                   help=f"{prefix}the defer rule: share of the next bytes no history read spells, where nothing "
                        f"stands at the boundary (default {FALLBACK})")


def pruning_of(args: argparse.Namespace, base=None):
    """The ``Pruning`` of ``add_pruning_arguments``' flags, each one left out taken from ``base`` (default:
    ``Pruning()``); a bad value named with its flag."""
    from dataclasses import replace

    from tokenfuse.alignment.bytemodel import Pruning

    base = base if base is not None else Pruning()
    given = {k: getattr(args, k) for k in ("keep", "width", "rule", "smooth", "fallback") if getattr(args, k) is not None}
    if "width" in given:
        w = str(given["width"]).lower()
        if w == "none":
            given["width"] = None
        elif w.isdigit():
            given["width"] = int(w)
        else:
            raise TokenfuseError(f"--width: expected a positive number or none, got {args.width!r}")
    try:
        return replace(base, **given)
    except ValueError as err:
        raise TokenfuseError(f"--{err}") from None


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
    from tokenfuse.combiners.mixers import Fitted

    if path is None:
        return {"doc-mix": Fitted(weights=weights), "gac": Fitted(weights=weights),
                "switch": Fitted(weights=weights, alpha=alpha), "poe": Fitted(beta=weights)}
    return {row: Fitted.from_dict(p) for row, p in _load_fit(path, names, "text").items()}


def _byte_fitted(path: str | None, names: list[str], weights: np.ndarray, alpha: float) -> tuple[dict, object]:
    """The byte rows' and ``doc-mix``'s parameters (``byte-gate`` and ``byte-online`` only from a fit) and the
    pruning the byte models default to: the run's where the fit comes from one."""
    from tokenfuse.combiners.mixers import Fitted
    from tokenfuse.engine.text_rows import BYTE_ROWS
    from tokenfuse.eval.text_bytes import run_pruning

    if path is None:
        return {"byte-mix": Fitted(weights=weights), "byte-switch": Fitted(weights=weights, alpha=alpha),
                "doc-mix": Fitted(weights=weights)}, None
    fit = _load_fit(path, names, "text-bytes")
    rows = {row: Fitted.from_dict(fit[row]) for row in (*BYTE_ROWS, "doc-mix") if row in fit}  # an older fit lacks the newer rows
    return rows, run_pruning(json.loads(Path(path).read_text()))


def run(args: argparse.Namespace) -> int:
    from tokenfuse.engine.text_features import Rows
    from tokenfuse.eval.text import score_texts
    from tokenfuse.load import load_ensemble

    if not 0 <= args.alpha <= 1:
        raise TokenfuseError(f"--alpha: expected a number in [0, 1], got {args.alpha}")
    if args.bytes and args.pieces:
        raise TokenfuseError("--pieces: the token-level rows' pieces; --bytes scores byte rows (leave one out)")
    texts = [_read(f) for f in args.files]
    cfg = config_from_args(args)
    ens = load_ensemble(cfg, progress=not args.json)
    names = [m.name for m in ens.members]
    w = np.array(ens.weights, dtype=np.float64)
    members = [Rows.from_member(m) for m in ens.members]
    if args.bytes:
        from tokenfuse.eval import text_bytes

        fitted, base = _byte_fitted(args.fitted, names, w / w.sum(), args.alpha)
        results = text_bytes.score_texts(members, texts, fitted, pruning_of(args, base), progress=not args.json)
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
