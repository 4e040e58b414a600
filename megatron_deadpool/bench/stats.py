"""Distribution-free confidence intervals for the medians the benchmarks report.

Paired benchmark runs on a shared machine are noisy and not normally distributed, so the
interval for a median comes from order statistics: with n independent samples, the true median
lies between the k-th smallest and the k-th largest with probability
``1 - 2 * P(Binomial(n, 1/2) < k)``. `median_ci` picks the largest such k whose coverage is
still at least the level asked for; with too few samples (fewer than 6 for 95%) no interval
exists and it says so with None.

`ratio_summary` and `ratio_text` are how every benchmark reports a ratio of paired runs: the
median with its interval, and the figure itself only when the interval lies on one side of 1;
otherwise "no difference measurable at this noise" (or, with too few repeats for an
interval, that it was not measured). `median` is the benchmarks' median of a list that may be
empty.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from math import comb
from typing import Any


def median(values: Sequence[float]) -> float | None:
    """The median of `values`; None when there are none."""
    return float(statistics.median(values)) if values else None


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


NOT_MEASURABLE = "no difference measurable at this noise"


def ratio_summary(ratios: Sequence[float], level: float = 0.95) -> dict[str, Any]:
    """The median of paired `ratios` (one per repeat), its interval and what it can claim.

    `verdict`: "higher" or "lower" when the whole interval lies above or below 1, "none" when
    it spans 1, "no interval" when there are too few repeats for one."""
    ci = median_ci(ratios, level) if ratios else None
    if ci is None:
        verdict = "no interval"
    elif ci[0] > 1.0:
        verdict = "higher"
    elif ci[1] < 1.0:
        verdict = "lower"
    else:
        verdict = "none"
    return {
        "median": median(ratios),
        "ci": list(ci) if ci else None,
        "level": level,
        "n": len(ratios),
        "ratios": list(ratios),
        "verdict": verdict,
    }


def min_repeats(level: float = 0.95) -> int:
    """The fewest values for which `median_ci` gives an interval at `level`."""
    n = 1
    while median_ci([0.0] * n, level) is None:
        n += 1
    return n


def ratio_text(summary: dict[str, Any], digits: int = 2, suffix: str = "x") -> str:
    """A ratio as a report may print it: the figure only when its interval excludes 1."""
    n, ci = summary["n"], summary["ci"]
    pct = f"{summary['level']:.0%}"
    if ci is None:
        return (
            f"not measured: {n} repeat(s) give no {pct} interval "
            f"({min_repeats(summary['level'])} needed)"
        )
    interval = f"{pct} CI {ci[0]:.{digits}f}-{ci[1]:.{digits}f}, {n} repeats"
    if summary["verdict"] == "none":
        return f"{NOT_MEASURABLE} ({interval})"
    return f"{summary['median']:.{digits}f}{suffix} ({interval})"
