"""Tests of bench.stats.median_ci: the order-statistic confidence interval of a median."""

from __future__ import annotations

import random
import statistics
from math import comb

import pytest

from megatron_deadpool.bench.stats import (
    NOT_MEASURABLE,
    median_ci,
    min_repeats,
    ratio_summary,
    ratio_text,
)


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


@pytest.mark.timeout(30)
def test_a_ratio_is_a_figure_only_when_its_interval_excludes_one() -> None:
    assert min_repeats() == 6 and min_repeats(0.99) == 8
    noise = ratio_summary([1.02, 0.99, 1.05, 0.97, 1.01, 1.03])
    assert noise["verdict"] == "none"
    assert ratio_text(noise) == f"{NOT_MEASURABLE} (95% CI 0.97-1.05, 6 repeats)"
    slower = ratio_summary([1.12, 1.19, 1.15, 1.17, 1.11, 1.13])
    assert slower["verdict"] == "higher" and slower["median"] == pytest.approx(1.14)
    assert ratio_text(slower) == "1.14x (95% CI 1.11-1.19, 6 repeats)"
    faster = ratio_summary([0.05, 0.04, 0.06, 0.05, 0.045, 0.055, 0.05])
    assert faster["verdict"] == "lower" and ratio_text(faster, 3, "").startswith("0.050 (95% CI")
    few = ratio_summary([3.08, 0.56])
    assert few["verdict"] == "no interval" and few["ci"] is None
    assert ratio_text(few) == "not measured: 2 repeat(s) give no 95% interval (6 needed)"
