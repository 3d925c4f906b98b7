"""Proper scores of the likelihood form, beside accuracy: the gold option's NLL and the Brier score.

Accuracy asks only whether the gold option has the highest score; a proper score looks at the whole
distribution a row puts on the options, so a row is rewarded for being sure where it is right and
unsure where it is wrong (and cannot gain by reporting anything but what it believes).

**The distribution.** Per item, ``p = softmax(logprobs)`` over the item's options, where
``logprobs[k]`` is the row's *summed* log-likelihood of option ``k``'s continuation (the record's
``logprobs``, not divided by the option's bytes). For one model that is ``p(option_k | context) /
Σ_j p(option_j | context)``: the model's own probability of option ``k`` given that the answer is
one of the options. The per-byte scores that ``acc`` ranks by are a log-probability divided by each
option's length — a different temperature for every option, which no model assigned —, so a softmax
over them is no distribution the row holds (and a nearly flat one: dividing by the bytes shrinks
the options' differences by their lengths). So ``p``'s argmax is ``acc_raw``'s prediction, not
``acc``'s, and short options get more of the mass (what the model gives them).

Per item, with ``g`` the gold option:

* ``nll = -log p[g] = logsumexp(logprobs) - logprobs[g]`` (nats; computed in log space, so no
  underflow; ``inf`` where the row gives the gold option probability 0 — ``logprobs[g] = -inf``
  with another option finite, as ``contrast``'s exclusion rule does);
* ``brier = Σ_k (p[k] - 1[k = g])²`` (0 best, 2 worst).

Both are means over the task's items (``tasks.<task>.<row>.proper`` in ``results.json``: ``nll``,
``brier``, ``n``). An item whose options are all ``-inf`` gives no distribution: the row's scores on
that task are ``None`` and ``undefined`` counts such items. Rows without option scores (``vote``,
``mbr``: they choose an option, not a distribution) have no ``proper``.

**Against the best member**, as the accuracy gain does (``report``): per task and score, the member
with the lowest mean on the task's items (ties: the first in member order; chosen on the test items,
which favours the member), and every other row's paired difference ``diff = row - member`` (lower is
better: a negative ``diff`` is a gain) with its paired bootstrap 95 % interval over the items
(``stats.paired_bootstrap``, 1,000 resamples, seed 0), ``vs_best.nll`` and ``vs_best.brier``. No
p-value: the exact sign-flip test (``stats.sign_flip_p``) is for 0/1 values. Where a row's ``nll`` is
``inf`` its difference is ``inf`` and has no interval. For reference ``results.json``'s ``proper``
also gives each task's uniform distribution's scores (``log k`` and ``1 - 1/k``, averaged over the
items), which any row that knows nothing reaches.
"""

from __future__ import annotations

import math
from statistics import fmean
from collections.abc import Sequence

from tokenfuse.eval.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, paired_bootstrap

SCORE = "sum"  # the options' summed log-likelihoods, softmax over options (the module docstring)
SCORES = ("nll", "brier")


def option_distribution(logprobs: Sequence[float]) -> list[float] | None:
    """``softmax(logprobs)``; ``None`` when every option is ``-inf`` (no distribution)."""
    top = max(logprobs)
    if top == -math.inf:
        return None
    e = [math.exp(x - top) for x in logprobs]
    total = sum(e)
    return [x / total for x in e]


def item_scores(logprobs: Sequence[float], gold: int) -> tuple[float, float] | None:
    """``(nll, brier)`` of one item (the module docstring); ``None`` when it has no distribution."""
    p = option_distribution(logprobs)
    if p is None:
        return None
    top = max(logprobs)
    if logprobs[gold] == -math.inf:
        nll = math.inf
    else:
        nll = top + math.log(sum(math.exp(x - top) for x in logprobs)) - logprobs[gold]
    brier = sum((q - (1.0 if k == gold else 0.0)) ** 2 for k, q in enumerate(p))
    return nll, brier


def row_scores(records: Sequence[dict]) -> dict | None:
    """Per-item scores of one row on one task: ``{"n", "undefined", "items": {id: (nll, brier)}}``;
    ``None`` when its records hold no option scores."""
    if not records or any("logprobs" not in r for r in records):
        return None
    items, undefined = {}, 0
    for r in records:
        s = item_scores(r["logprobs"], int(r["gold"]))
        if s is None:
            undefined += 1
        else:
            items[str(r["id"])] = s
    return {"n": len(records), "undefined": undefined, "items": items, "order": [str(r["id"]) for r in records]}


def _summary(s: dict) -> dict:
    if s["undefined"]:
        return {"nll": None, "brier": None, "n": s["n"], "undefined": s["undefined"]}
    vals = list(s["items"].values())
    return {"nll": fmean([v[0] for v in vals]), "brier": fmean([v[1] for v in vals]), "n": s["n"]}


def _versus(row: dict, member: dict, k: int) -> dict:
    """``row - member`` on score ``k`` over the items both hold (in the row's order), paired."""
    ids = [i for i in row["order"] if i in member["items"]]
    a = [row["items"][i][k] for i in ids]
    b = [member["items"][i][k] for i in ids]
    if not all(math.isfinite(x) for x in a + b):
        return {"diff": math.inf if any(x == math.inf for x in a) else -math.inf, "ci": None}
    d, lo, hi = paired_bootstrap(a, b)
    return {"diff": d, "ci": [lo, hi]}


def proper_scores(tasks: dict, all_records: dict[str, dict[str, list[dict]]], forms: dict[str, str]) -> dict | None:
    """Add ``proper`` to every likelihood-form row of ``tasks`` (``results.json``'s per-task summaries)
    whose records hold option scores; returns the run's ``proper`` entry (which score, each task's
    best members and the uniform reference), ``None`` when no row has them."""
    best: dict[str, dict[str, str | None]] = {}
    uniform: dict[str, dict[str, float]] = {}
    for t, per in all_records.items():
        if forms.get(t) != "likelihood":
            continue
        scored = {m: s for m, recs in per.items() if (s := row_scores(recs)) is not None}
        if not scored:
            continue
        for m, s in scored.items():
            tasks[t][m]["proper"] = _summary(s)
        ks = [len(r["logprobs"]) for r in next(iter(per[m] for m in scored))]
        uniform[t] = {"nll": fmean([math.log(k) for k in ks]), "brier": fmean([1 - 1 / k for k in ks])}
        members = [m for m in scored if m.startswith("single:") and not scored[m]["undefined"]]
        best[t] = {}
        for k, name in enumerate(SCORES):
            b = min(members, key=lambda m: tasks[t][m]["proper"][name], default=None)  # min keeps the first
            best[t][name] = b
            if b is None:
                continue
            for m, s in scored.items():
                if m.startswith("single:") or s["undefined"]:
                    continue
                tasks[t][m]["proper"].setdefault("vs_best", {})[name] = {"member": b, **_versus(s, scored[b], k)}
    if not best:
        return None
    return {"score": SCORE, "best": best, "uniform": uniform, "resamples": DEFAULT_RESAMPLES, "seed": DEFAULT_SEED}
