"""Distribution-free confidence intervals for the medians the benchmarks report.

Paired benchmark runs on a shared machine are noisy and not normally distributed, so the
interval for a median comes from order statistics: with n independent samples, the true median
lies between the k-th smallest and the k-th largest with probability
``1 - 2 * P(Binomial(n, 1/2) < k)``. `median_ci` picks the largest such k whose coverage is
still at least the level asked for; with too few samples (fewer than 6 for 95%) no interval
exists and it says so with None.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb


def median_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """(low, high) covering the median of the population `values` came from with probability
    at least `level`, or None when there are too few values for that."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level: must be between 0 and 1, got {level}")
    n = len(values)
    ordered = sorted(values)
    best = None
    below = 0.0  # P(Binomial(n, 1/2) < k), for k = 1, 2, ...
    for k in range(1, n // 2 + 1):
        below += comb(n, k - 1) / 2**n
        if 1.0 - 2.0 * below < level:
            break
        best = (ordered[k - 1], ordered[n - k])
    return best
