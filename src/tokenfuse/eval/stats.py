"""Accuracy with a bootstrap 95 % confidence interval, and paired intervals of a difference.

Every interval is a percentile bootstrap with ``numpy.random.default_rng(seed)`` (deterministic for
a given seed): ``resamples`` draws of the items with replacement, the interval the
``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles (numpy's default linear interpolation) of
the resampled statistic.
"""

from __future__ import annotations

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
