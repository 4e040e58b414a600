"""Interleaved runs of one job in several configurations: their order, what one run's time per
iteration is, and the statistics over repeats.

`deadpool bench overhead` (DeadPool off vs on) and `deadpool bench paper`'s failure-free matrix
(no fault tolerance, DeadPool, checkpoints of several kinds) are the same measurement; both
launch their runs themselves and hand them here.

**Order** (`interleave`): every configuration once per repeat, in the same order, repeat after
repeat (off, on, off, on, ...), so that drift in the machine's load hits every configuration
alike and the runs of one repeat are neighbours in time: ratios are taken within a repeat.

**Time per iteration** (`iteration_times`, one figure per run): *amortised* - the mean gap
between consecutive iteration ends (rank 0's wall-clock stamp `time` in each iteration record)
over the timed window, the iterations after the first `warmup`. Chosen over the median of the
step timer (`iter_time_s`, which `bench overhead` used before) because a gap counts everything
that happens between two iterations' ends - the step, replication's commit, the driver's
bookkeeping, a checkpoint save - and the mean counts a cost that comes every N iterations (a
save) at its true weight, where a median of step times leaves out both the work outside the
timed step and every periodic cost: the amortised time is the throughput a user gets. The
median gap (the typical iteration) is kept beside it, for the noise and for the one-time
start-up of the first save (`first_save_s`: the gap after the first saved iteration, less the
median).

**Statistics** (`compare`, with `stats.py`): per configuration the median over repeats of the
amortised time, and the ratio to the baseline configuration's run of the same repeat: the median
of those ratios and the distribution-free 95% interval of that median (`stats.ratio_summary`),
which reports print as a figure only when the interval excludes 1 (`stats.ratio_text`). Every
configuration must train as the baseline does (the same losses and final parameter digest),
which is checked for every run.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import ConfigError
from .stats import median, ratio_summary


class Launched(Protocol):
    """What a launch returns (`embedded.launch.RunResult`, `timed_launch.Launch`)."""

    returncode: int
    records: list[dict[str, Any]]
    summary: dict[str, Any]


def check_window(*, iters: int, warmup: int) -> None:
    """Refuse counts that leave no iteration to time."""
    if warmup < 0:
        raise ConfigError(f"warmup: must be >= 0, got {warmup}")
    if iters <= warmup:
        raise ConfigError(f"iters ({iters}) must exceed warmup ({warmup}) to leave timed steps")
    if iters < 2:
        raise ConfigError(
            f"iters ({iters}) must be at least 2: an iteration's time is the gap between its end "
            "and the previous one's"
        )


# ---------------------------------------------------------------------- one run
def iteration_gaps(records: list[dict[str, Any]]) -> dict[int, float]:
    """iteration i -> seconds between the ends of iterations i-1 and i (saves after i-1 count)."""
    by_it = {r["iteration"]: r["time"] for r in records}
    return {i: by_it[i] - by_it[i - 1] for i in sorted(by_it) if i - 1 in by_it}


@dataclass(frozen=True)
class IterationTimes:
    """One run's time per iteration over its timed window (the iterations after the warm-up)."""

    gaps_s: tuple[float, ...]
    """Each timed iteration's gap, in order."""
    amortised_s: float
    """Their mean: the run's time per iteration."""
    median_s: float
    """Their median: the typical iteration."""
    saves_in_window: int
    """Saves whose cost falls into the window (each lengthens the gap after it)."""
    first_save_s: float | None
    """The first save's extra time over the typical iteration (its one-time start-up
    included), None without saves; it falls before the window when `warmup` covers it."""


def iteration_times(
    records: list[dict[str, Any]], warmup: int, save_every: int = 0
) -> IterationTimes:
    """The time per iteration of a run whose records are `records`, iterations after `warmup`
    timed; `save_every`: the run saved after every such iteration (0: never)."""
    gaps = iteration_gaps(records)
    window = [g for i, g in gaps.items() if i > warmup]
    if not window:
        raise ValueError(f"no iteration after the first {warmup} to time")
    typical = statistics.median(window)
    first = gaps.get(save_every + 1) if save_every else None
    return IterationTimes(
        gaps_s=tuple(window),
        amortised_s=statistics.fmean(window),
        median_s=typical,
        saves_in_window=sum(
            1 for i in gaps if i > warmup and save_every and (i - 1) % save_every == 0
        ),
        first_save_s=None if first is None else first - typical,
    )


@dataclass
class Run:
    """One run of one configuration in one repeat, as measured."""

    config: str
    repeat: int
    times: IterationTimes
    losses: list[float]
    digest: str | None
    wall_s: float | None
    extra: dict[str, Any] = field(default_factory=dict)
    """What a command records besides (its JSON shows it with the rest)."""

    def to_dict(self) -> dict[str, Any]:
        t = self.times
        return {
            "config": self.config,
            "repeat": self.repeat,
            "gaps_s": [round(g, 6) for g in t.gaps_s],
            "amortised_s": t.amortised_s,
            "median_s": t.median_s,
            "saves_in_window": t.saves_in_window,
            "first_save_s": t.first_save_s,
            "losses": self.losses,
            "digest": self.digest,
            "wall_s": self.wall_s,
            **self.extra,
        }


def measured_run(
    config: str,
    repeat: int,
    launched: Launched,
    *,
    iters: int,
    warmup: int,
    save_every: int = 0,
    what: str,
    run_dir: Path,
) -> Run:
    """`launched` (the run of `config` in `repeat`, described as `what`) measured; raises
    RuntimeError when it did not complete every one of its `iters` iterations."""
    n = len(launched.records)
    if launched.returncode != 0 or n != iters:
        raise RuntimeError(
            f"{what}, repeat {repeat}: the run failed (exit {launched.returncode}, {n}/{iters} "
            f"iterations); logs in {run_dir}"
        )
    return Run(
        config=config,
        repeat=repeat,
        times=iteration_times(launched.records, warmup, save_every),
        losses=[r["loss"] for r in launched.records],
        digest=launched.summary.get("final_param_digest"),
        wall_s=launched.summary.get("wall_s"),
    )


# ---------------------------------------------------------------------- many runs
def interleave(
    configs: Sequence[str], repeats: int, run_one: Callable[[str, int], Run]
) -> dict[str, list[Run]]:
    """`run_one(config, repeat)` for every configuration in order, once per repeat, repeat
    after repeat; each configuration's runs in repeat order."""
    if repeats < 1:
        raise ConfigError(f"repeats: must be >= 1, got {repeats}")
    runs: dict[str, list[Run]] = {c: [] for c in configs}
    for repeat in range(1, repeats + 1):
        for config in configs:
            runs[config].append(run_one(config, repeat))
    return runs


def compare(runs: Sequence[Run], baseline: Sequence[Run]) -> dict[str, Any]:
    """One configuration's `runs` against the baseline configuration's runs of the same
    repeats: medians over repeats, the paired ratios to the baseline with their median's 95%
    interval, and whether every run trained as the baseline's first did."""
    ratios = [r.times.amortised_s / b.times.amortised_s for r, b in zip(runs, baseline)]
    first_saves = [r.times.first_save_s for r in runs if r.times.first_save_s is not None]
    base = baseline[0] if baseline else None
    return {
        "amortised_s": median([r.times.amortised_s for r in runs]),
        "median_s": median([r.times.median_s for r in runs]),
        "per_run_amortised_s": [r.times.amortised_s for r in runs],
        "ratio_median": median(ratios),
        "ratio": ratio_summary(ratios),
        "ratios": ratios,
        "first_save_s": median(first_saves),
        "saves_in_window": runs[0].times.saves_in_window if runs else 0,
        "losses_match": base is not None and all(r.losses == base.losses for r in runs),
        "digests_match": base is not None
        and all(r.digest is not None and r.digest == base.digest for r in runs),
    }
