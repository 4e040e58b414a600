"""Tests of bench.stats.median_ci: the order-statistic confidence interval of a median."""

from __future__ import annotations

import random
import statistics
from math import comb

import pytest

from megatron_deadpool.bench.stats import median_ci


def _coverage(n: int, k: int) -> float:
    return 1.0 - 2.0 * sum(comb(n, j) for j in range(k)) / 2**n


@pytest.mark.timeout(30)
def test_interval_uses_the_widest_order_statistics_that_still_cover() -> None:
    assert median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # 5 values: at most 93.75%
    assert median_ci(list(range(6))) == (0, 5)  # 96.9%
    values = [1.08, 0.97, 1.02, 1.15, 0.95, 1.04, 1.01, 1.07, 1.03, 0.99]
    assert median_ci(values) == (0.97, 1.08)  # 2nd smallest and 2nd largest: 97.9%
    assert _coverage(10, 2) >= 0.95 > _coverage(10, 3)
    low, high = median_ci(list(range(20)))  # type: ignore[misc]
    assert (low, high) == (5, 14) and _coverage(20, 6) >= 0.95 > _coverage(20, 7)
    assert median_ci(list(range(10)), level=0.5) == (3, 6)
    with pytest.raises(ValueError, match="level"):
        median_ci([1.0] * 10, level=1.0)


@pytest.mark.timeout(30)
def test_interval_covers_the_true_median_at_least_as_often_as_promised() -> None:
    rng = random.Random(0)
    trials, hits = 2000, 0
    for _ in range(trials):  # a skewed population whose median is 1.0 exactly
        sample = [rng.lognormvariate(0.0, 0.5) for _ in range(10)]
        low, high = median_ci(sample)  # type: ignore[misc]
        hits += low <= 1.0 <= high
        assert low <= statistics.median(sample) <= high
    assert hits / trials >= 0.95
