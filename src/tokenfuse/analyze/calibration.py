"""Calibration on a multiple-choice task (GaC Tab. 1): expected calibration error and reliability diagrams.

Per item, each method (each member alone, and each ensemble through ``Ensemble.loglikelihood``)
scores every option's continuation on the task's cloze context. The option probabilities are the
softmax of the options' log-likelihoods (the model's distribution restricted to the options); the
prediction is the most probable option and the confidence its probability.

ECE (Guo et al., 2017): split ``[0, 1]`` into ``bins`` equal-width bins by confidence (a confidence
of exactly 1 falls in the last bin, 0 in the first), then
``ECE = sum_b |B_b| / n * |accuracy(B_b) - mean confidence(B_b)|``. The reliability diagram plots
each bin's accuracy against its mean confidence.

The log-likelihoods can come from a ``tokenfuse eval --out DIR`` run of the same task in the
likelihood form (``--eval-out DIR``: no model runs again).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenfuse.errors import TokenfuseError


@dataclass(frozen=True)
class Reliability:
    """ECE and the per-bin numbers of one method (bins with no item have ``count`` 0)."""

    ece: float
    accuracy: float
    mean_confidence: float
    n: int
    bin_counts: tuple[int, ...]
    bin_accuracy: tuple[float, ...]
    bin_confidence: tuple[float, ...]


def option_confidence(logprobs: Sequence[float]) -> tuple[int, float]:
    """The most probable option under the softmax of ``logprobs`` and its probability."""
    top = max(logprobs)
    if top == -math.inf:
        return 0, 1.0 / len(logprobs)
    exps = [math.exp(x - top) for x in logprobs]
    k = max(range(len(exps)), key=lambda i: exps[i])
    return k, exps[k] / sum(exps)


def reliability(confidences: Sequence[float], correct: Sequence[bool], *, bins: int = 10) -> Reliability:
    """Equal-width binning of ``confidences`` (see the module docstring for the ECE definition)."""
    if len(confidences) != len(correct):
        raise TokenfuseError("reliability: confidences and correctness differ in length")
    if bins < 1:
        raise TokenfuseError(f"--bins: expected 1 or more, got {bins}")
    n = len(confidences)
    counts, hits, confs = [0] * bins, [0.0] * bins, [0.0] * bins
    for c, ok in zip(confidences, correct):
        b = min(int(c * bins), bins - 1)
        counts[b] += 1
        hits[b] += bool(ok)
        confs[b] += c
    ece = sum(abs(hits[b] - confs[b]) for b in range(bins)) / n if n else float("nan")
    acc = [hits[b] / counts[b] if counts[b] else float("nan") for b in range(bins)]
    conf = [confs[b] / counts[b] if counts[b] else float("nan") for b in range(bins)]
    return Reliability(ece, sum(map(bool, correct)) / n if n else float("nan"),
                       sum(confidences) / n if n else float("nan"), n, tuple(counts), tuple(acc), tuple(conf))


def from_records(records: Sequence[dict], *, bins: int = 10) -> Reliability:
    """Reliability of likelihood-form records (``logprobs`` and ``gold`` per item)."""
    confs, correct = [], []
    for r in records:
        k, c = option_confidence(r["logprobs"])
        confs.append(c)
        correct.append(k == r["gold"])
    return reliability(confs, correct, bins=bins)


def _records_from_eval(eval_out: Path, task: str, methods: Sequence[str]) -> dict[str, list[dict]]:
    from tokenfuse.eval.records import read_records, task_dir

    folder = task_dir(eval_out, task, "likelihood")
    if not folder.is_dir():
        raise TokenfuseError(f"{folder}: no likelihood records; run `tokenfuse eval --tasks {task} --mc likelihood "
                             f"--out {eval_out}` first")
    out = {}
    for path in sorted(folder.glob("*.jsonl")):
        name = path.stem.replace("__", ":")
        if name.startswith("single:") or name in methods:
            recs = [r for r in read_records(path).values() if "logprobs" in r and name != "seq-avg"]
            if recs:
                out[name] = recs
    # Only the items every method finished (a folder can hold more items of an earlier, larger --limit).
    common = set.intersection(*(set(str(r["id"]) for r in recs) for recs in out.values())) if out else set()
    from tokenfuse.eval.summary import row_order

    return {name: sorted((r for r in out[name] if str(r["id"]) in common), key=lambda r: str(r["id"]))
            for name in sorted(out, key=row_order)}


def run_calibration(cfg, *, task: str = "arc_easy", limit: int | None = 100, data=None, methods: str = "gac",
                    bins: int = 10, eval_out=None, out="analyze-out", progress: bool = True) -> str:
    """ECE per member and per ensemble; writes calibration.{md,json,png} to ``out``; returns the table."""
    wanted = [m.strip() for m in methods.split(",") if m.strip()]
    if eval_out:
        per_method = _records_from_eval(Path(eval_out), task, wanted)
    else:
        from tokenfuse.eval.runner import EvalSettings, run_task
        from tokenfuse.eval.methods import plan_methods
        from tokenfuse.combiners import REGISTRY
        from tokenfuse.load import load_ensemble
        from tokenfuse.tasks import load_task

        t = load_task(task, data)
        if not t.multiple_choice:
            raise TokenfuseError(f"analyze calibration: {task!r} is not a multiple-choice task")
        ens = load_ensemble(cfg, progress=progress)
        specs = [s for s in plan_methods(cfg, ["single", *wanted], form="likelihood", registered=list(REGISTRY))
                 if s.kind == "engine"]
        settings = EvalSettings(tasks=[task], methods=["single", *wanted], limit=limit, data=data,
                                out=str(Path(out) / "eval"), mc="likelihood", progress=progress)
        per_method = run_task(cfg, ens, t, specs, settings)
    if not per_method:
        raise TokenfuseError(f"analyze calibration: no records for task {task!r}")
    rel = {m: from_records(recs, bins=bins) for m, recs in per_method.items()}
    lines = [f"Calibration on {task} (likelihood form, {next(iter(rel.values())).n} items, {bins} bins; "
             "confidence = softmax over the options' log-likelihoods):", "",
             "| method | accuracy | mean confidence | ECE |", "|---|---|---|---|"]
    for m, r in rel.items():
        lines.append(f"| {m} | {100 * r.accuracy:.1f} | {100 * r.mean_confidence:.1f} | {100 * r.ece:.1f} |")
    text = "\n".join(lines) + "\n"
    outp = Path(out)
    outp.mkdir(parents=True, exist_ok=True)
    (outp / "calibration.md").write_text(text, encoding="utf-8")
    (outp / "calibration.json").write_text(json.dumps({m: r.__dict__ for m, r in rel.items()}, indent=1) + "\n",
                                           encoding="utf-8")
    diagram(rel, outp / "calibration.png", title=f"reliability on {task}")
    return text


def diagram(rel: dict[str, Reliability], path: Path, *, title: str = "") -> Path | None:
    """One reliability diagram per method: bin accuracy against bin confidence, with the diagonal."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    k = len(rel)
    fig, axes = plt.subplots(1, k, figsize=(2.8 * k, 3.0), squeeze=False)
    for ax, (m, r) in zip(axes[0], rel.items()):
        bins = len(r.bin_counts)
        centers = [(b + 0.5) / bins for b in range(bins)]
        acc = [0.0 if math.isnan(a) else a for a in r.bin_accuracy]
        ax.bar(centers, acc, width=1 / bins, edgecolor="k", alpha=0.7, label="accuracy")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"{m}\nECE {100 * r.ece:.1f}", fontsize=7)
        ax.set_xlabel("confidence", fontsize=7)
    axes[0][0].set_ylabel("accuracy", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
