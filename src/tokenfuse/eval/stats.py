"""Accuracy with a bootstrap 95 % confidence interval."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_RESAMPLES = 1000
DEFAULT_SEED = 0


def bootstrap_ci(values: Sequence[float], *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (e.g. 0/1 correctness).

    ``resamples`` resamples of ``len(values)`` items with replacement, drawn by
    ``numpy.random.default_rng(seed)``; the interval is the ``(1 - level) / 2`` and
    ``(1 + level) / 2`` quantiles (numpy's default linear interpolation) of their means.
    Deterministic for a given seed. An empty input gives ``(nan, nan)``.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)

