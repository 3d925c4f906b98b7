"""Accuracy with a bootstrap 95 % confidence interval, and paired intervals of a difference.

Every interval is a percentile bootstrap with ``numpy.random.default_rng(seed)`` (deterministic for
a given seed): ``resamples`` draws of the items with replacement, the interval the
``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles (numpy's default linear interpolation) of
the resampled statistic.

Significance over many comparisons: ``sign_flip_p`` gives a paired comparison's two-sided p-value
(the exact paired sign-flip permutation test, no resampling), ``holm`` adjusts a family of them
(Holm's step-down correction).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

DEFAULT_RESAMPLES = 1000
DEFAULT_SEED = 0


def bootstrap_ci(values: Sequence[float], *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (e.g. 0/1 correctness).

    ``resamples`` resamples of ``len(values)`` items with replacement; an empty input gives
    ``(nan, nan)``.
    """
    return paired_bootstrap_mean([(values, [0.0] * len(values))], resamples=resamples, seed=seed, level=level)[1:]


def paired_bootstrap(a: Sequence[float], b: Sequence[float], *, resamples: int = DEFAULT_RESAMPLES,
                     seed: int = DEFAULT_SEED, level: float = 0.95) -> tuple[float, float, float]:
    """``mean(a) - mean(b)`` over paired items and its interval: each resample draws the same items
    for both (the per-item differences are resampled), so what the two share cancels.
    Returns ``(difference, low, high)``; NaNs for no items."""
    return paired_bootstrap_mean([(a, b)], resamples=resamples, seed=seed, level=level)


def paired_bootstrap_mean(tasks: Sequence[tuple[Sequence[float], Sequence[float]]], *,
                          resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                          level: float = 0.95) -> tuple[float, float, float]:
    """The unweighted mean over tasks of ``mean(a_t) - mean(b_t)`` (paired items ``a_t[j]``,
    ``b_t[j]`` within each task) and its interval.

    A resample draws each task's items with replacement, separately (stratified: each task keeps
    its own size, as the table's ``Avg.`` is a mean of per-task accuracies), from one generator,
    tasks in the given order; for one task this is ``paired_bootstrap``. Returns
    ``(difference, low, high)``; NaNs if any task has no items.
    """
    for a, b in tasks:
        if len(a) != len(b):
            raise ValueError(f"paired bootstrap: {len(a)} against {len(b)} items (the items must be paired)")
    diffs = [np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64) for a, b in tasks]
    if not diffs or any(d.size == 0 for d in diffs):
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = np.zeros(resamples)
    for d in diffs:
        means += d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    means /= len(diffs)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(np.mean([d.mean() for d in diffs])), float(lo), float(hi)


def sign_flip_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of ``mean(a) = mean(b)`` for paired 0/1 values (e.g. correctness of a row and
    of the best member on the same items): the exact paired sign-flip permutation test.

    Under the null hypothesis the two are exchangeable on every item, so each difference
    ``a[j] - b[j]`` is as likely to have either sign; the p-value is the share of the ``2**n`` sign
    flips whose ``|sum of differences|`` is at least the observed one. Items the two get alike
    (difference 0) do not move it; with ``w`` items where ``a`` alone is right and ``l`` where ``b``
    alone is, the flips' sum is ``2 X - (w + l)`` with ``X ~ Binomial(w + l, 1/2)``, so the p-value is
    ``min(1, 2 P(X <= min(w, l)))``, computed exactly here (integer binomial sums; the exact McNemar
    test). No items that differ give ``1.0``.

    Why this test and not a p-value from the bootstrap's resamples: exact and deterministic (no
    seed), and with no floor. A p-value counted from 1,000 resamples cannot go below about
    ``2 / 1001``, so Holm's correction over 50 comparisons or more could never reject, however clear
    a gain; this one falls as far as the data take it. It tests the same paired difference as
    ``paired_bootstrap``'s interval, but it is another procedure: near the edge the interval may
    exclude 0 where ``p`` is just above 0.05 or the other way round (the percentile interval is the
    more liberal of the two on a few items).
    """
    if len(a) != len(b):
        raise ValueError(f"sign-flip test: {len(a)} against {len(b)} items (the items must be paired)")
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if not (np.isin(x, (0.0, 1.0)).all() and np.isin(y, (0.0, 1.0)).all()):
        raise ValueError("sign-flip test: the exact p-value is for 0/1 values (correct or not)")
    wins, losses = int(np.sum(x > y)), int(np.sum(x < y))
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1))
    return min(1.0, 2 * tail / 2 ** n)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: with ``m`` p-values sorted ascending
    ``p_(1) <= ... <= p_(m)``, ``p_holm_(i) = max over j <= i of min(1, (m - j + 1) p_(j))``.

    A comparison is significant at level ``alpha`` after the correction exactly when its adjusted
    value is below ``alpha``; this controls the probability of any false rejection in the family at
    ``alpha`` whatever the dependence between the tests (Holm 1979), and rejects at least what
    Bonferroni's ``m p`` does. Ties keep their input order (it does not change the values)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out
