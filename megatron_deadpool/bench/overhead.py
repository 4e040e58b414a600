"""`deadpool bench overhead`: what per-iteration replication costs, DeadPool on vs off.

The same job runs with DeadPool off and on, interleaved (off, on, off, on, ...) so that drift
in the machine's load hits both alike. Each run's first `--warmup` iterations are dropped
(process start-up, allocator and gloo warm-up); the figure per run is the median of the rest.
The result is the median over repeats of the on/off ratio of paired runs, plus the pooled
medians of each mode:

    deadpool bench overhead --repeats 20 --iters 30 --json overhead.json

writes `{"off_iter_s", "on_iter_s", "ratio_median", "ratio_ci95", "ratio", "overhead_pct",
"runs": [...], ...}`; `ratio_ci95` is a distribution-free 95% confidence interval of the median
ratio (`stats.median_ci`; it needs at least 6 pairs), since a shared machine's run-to-run noise
can be larger than the overhead measured. The ratio is printed as a figure only when that
interval excludes 1 (`stats.ratio_text`), else as "no difference measurable at this noise".
Runs also check the invariant that DeadPool does not change training: the losses and final
parameter digests of all runs must be identical. Each run also records the CPU its processes
used per timed iteration, by role (`cpu_use`: ranks, spares, the launcher with the store and
coordinator): on a machine with fewer cores than processes, CPU spent outside the ranks'
training is what a failure-free overhead is made of.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..config.job import JobConfig, ParallelConfig, load_job
from ..errors import ConfigError
from .cpu_use import CpuSampler
from .report import job_shape, publish, text_row
from .stats import median_ci, ratio_summary, ratio_text

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "cpu-demo.yaml"
"""The CPU demo job, used when no --config is given (and present in the source tree)."""


class _Result(Protocol):
    returncode: int
    records: list[dict[str, Any]]
    summary: dict[str, Any]


Runner = Callable[[JobConfig, Path], _Result]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help="YAML job config (default: configs/cpu-demo.yaml when present, else tp 2 x dp 2)",
    )
    parser.add_argument("--iters", type=int, default=20, help="iterations per run (default 20)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=6,
        help="pairs of runs, off then on (default 6, the fewest that give a 95%% interval)",
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="first iterations of each run left out (default 2)"
    )
    parser.add_argument(
        "--spares", type=int, default=None, help="spares in the DeadPool-on runs (default: config)"
    )
    parser.add_argument("--json", dest="json_path", help="write the results as JSON here")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="wall-clock limit of one run in s"
    )


def base_job(config: str | None) -> JobConfig:
    """The job to measure: --config, else the CPU demo, else the tp 2 x dp 2 default."""
    if config:
        return load_job(config)
    if DEFAULT_CONFIG.is_file():
        return load_job(DEFAULT_CONFIG)
    return JobConfig(parallel=ParallelConfig(tp=2, pp=1, dp=2))


def variants(job: JobConfig, iters: int, spares: int | None = None) -> dict[str, JobConfig]:
    """The off and on versions of `job`, `iters` iterations each, no fault injection."""
    train = dataclasses.replace(job.train, iters=iters)
    dp = job.deadpool.replace(fail=[])
    on_spares = dp.spares if spares is None else spares
    return {
        "off": dataclasses.replace(job, train=train, deadpool=dp.replace(enabled=False, spares=0)),
        "on": dataclasses.replace(
            job, train=train, deadpool=dp.replace(enabled=True, spares=on_spares)
        ),
    }


def check_counts(*, iters: int, repeats: int, warmup: int) -> None:
    """Refuse counts that leave nothing to measure."""
    if repeats < 1:
        raise ConfigError(f"repeats: must be >= 1, got {repeats}")
    if warmup < 0:
        raise ConfigError(f"warmup: must be >= 0, got {warmup}")
    if iters <= warmup:
        raise ConfigError(f"iters ({iters}) must exceed warmup ({warmup}) to leave timed steps")


def _launch(job: JobConfig, run_dir: Path, timeout_s: float = 600.0) -> _Result:
    """Run `job`; the result also carries the CPU its processes used, by role (`cpu_use`)."""
    from ..embedded.launch import LocalLauncher

    class SampledLauncher(LocalLauncher):
        sampler: CpuSampler | None = None

        def _monitor(self, *args: Any, **kwargs: Any) -> int:
            self.sampler = CpuSampler(self.local.procs)
            self.sampler.start()
            try:
                return super()._monitor(*args, **kwargs)
            finally:
                self.sampler.stop()

    launcher = SampledLauncher(job, run_dir=str(run_dir), quiet=True, timeout_s=timeout_s)
    result = launcher.run()
    result.sampler = launcher.sampler  # type: ignore[attr-defined]
    return result


def cpu_per_iteration(result: Any, warmup: int) -> dict[str, float] | None:
    """CPU seconds per timed iteration by role (ranks, spares, launcher), if sampled."""
    sampler = getattr(result, "sampler", None)
    records = result.records
    if sampler is None or len(records) <= max(warmup, 1):
        return None
    start = records[max(warmup, 1) - 1]["time"]
    timed = len(records) - max(warmup, 1)
    return {k: v / timed for k, v in sampler.window(start, records[-1]["time"]).items()}


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def measure(
    job: JobConfig,
    *,
    iters: int,
    repeats: int,
    warmup: int,
    runner: Runner,
    work_dir: Path,
    spares: int | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Run the interleaved pairs and aggregate; raises RuntimeError when a run fails."""
    check_counts(iters=iters, repeats=repeats, warmup=warmup)
    jobs = variants(job, iters, spares)
    runs: list[dict[str, Any]] = []
    for rep in range(1, repeats + 1):
        for mode in ("off", "on"):
            run_dir = work_dir / f"{mode}-{rep}"
            result = runner(jobs[mode], run_dir)
            if result.returncode != 0 or len(result.records) != iters:
                raise RuntimeError(
                    f"run {rep} with DeadPool {mode} failed (exit {result.returncode}, "
                    f"{len(result.records)}/{iters} iterations); logs in {run_dir}"
                )
            timed = [r["iter_time_s"] for r in result.records[warmup:]]
            run = {
                "mode": mode,
                "repeat": rep,
                "iter_times_s": timed,
                "median_iter_s": _median(timed),
                "median_replication_s": _median(
                    [r.get("replication_s", 0.0) for r in result.records[warmup:]]
                ),
                "replica_bytes_per_rank": result.records[-1].get("replica_bytes_sent", 0),
                "losses": [r["loss"] for r in result.records],
                "final_param_digest": result.summary.get("final_param_digest"),
                "wall_s": result.summary.get("wall_s"),
                "cpu_per_iter_s": cpu_per_iteration(result, warmup),
            }
            runs.append(run)
            progress(_row(run))
    off = [r for r in runs if r["mode"] == "off"]
    on = [r for r in runs if r["mode"] == "on"]
    off_iter = _median([t for r in off for t in r["iter_times_s"]])
    on_iter = _median([t for r in on for t in r["iter_times_s"]])
    ratios = [b["median_iter_s"] / a["median_iter_s"] for a, b in zip(off, on)]
    ratio = _median(ratios)
    ci = median_ci(ratios)
    return {
        "cpu_per_iter_s": {mode: _cpu_medians(runs, mode) for mode in ("off", "on")},
        "off_iter_s": off_iter,
        "on_iter_s": on_iter,
        "ratio_median": ratio,
        "ratio_ci95": list(ci) if ci else None,
        "ratio": ratio_summary(ratios),
        "ratios": ratios,
        "overhead_pct": (ratio - 1.0) * 100.0,
        "losses_identical": all(r["losses"] == runs[0]["losses"] for r in runs),
        "digests_identical": runs[0]["final_param_digest"] is not None
        and len({r["final_param_digest"] for r in runs}) == 1,
        "config": {
            **job_shape(jobs["on"]),
            "spares_on": jobs["on"].deadpool.spares,
            "iters": iters,
            "warmup": warmup,
            "repeats": repeats,
        },
        "runs": runs,
    }


def _cpu_medians(runs: list[dict[str, Any]], mode: str) -> dict[str, float] | None:
    """Median over `mode`'s runs of the CPU seconds per iteration of each role."""
    cpu = [r["cpu_per_iter_s"] for r in runs if r["mode"] == mode and r["cpu_per_iter_s"]]
    return {k: _median([c[k] for c in cpu]) for k in cpu[0]} if cpu else None


_SPECS = (">4", ">8", ">12", ">10", ">11")
_HEADER = text_row(["run", "deadpool", "median s/it", "repl s/it", "bytes/rank"], _SPECS)


def _row(run: dict[str, Any]) -> str:
    cells = [
        str(run["repeat"]),
        run["mode"],
        f"{run['median_iter_s']:.4f}",
        f"{run['median_replication_s']:.4f}",
        f"{run['replica_bytes_per_rank']:,d}",
    ]
    return text_row(cells, _SPECS)


def summary_lines(result: dict[str, Any]) -> list[str]:
    ratio = (
        f"DeadPool off: {result['off_iter_s']:.4f} s/it   on: {result['on_iter_s']:.4f} s/it   "
        f"on/off, median of paired runs: {ratio_text(result['ratio'], digits=3)}"
    )
    same = (
        f"losses identical across runs: {result['losses_identical']}; final parameters "
        f"identical: {result['digests_identical']}"
    )
    lines = [ratio, same]
    cpu = result.get("cpu_per_iter_s") or {}
    if cpu.get("off") and cpu.get("on"):
        lines.append(
            f"CPU per iteration (median of runs), off -> on, on {os.cpu_count()} CPUs: "
            + ", ".join(
                f"{role} {1e3 * cpu['off'][role]:.1f} -> {1e3 * cpu['on'][role]:.1f} ms"
                for role in cpu["on"]
            )
        )
    return lines


def run(args: argparse.Namespace, runner: Runner | None = None) -> int:
    check_counts(iters=args.iters, repeats=args.repeats, warmup=args.warmup)
    job = base_job(args.config)
    work_dir = Path(tempfile.mkdtemp(prefix="deadpool-bench-overhead-"))
    p = job.parallel
    print(
        f"deadpool bench overhead: tp={p.tp} pp={p.pp} dp={p.dp}, {args.iters} iterations per "
        f"run ({args.warmup} warm-up left out), {args.repeats} x (off, on); runs in {work_dir}",
        flush=True,
    )
    print(_HEADER, flush=True)
    launch = runner or (lambda j, d: _launch(j, d, args.timeout))
    try:
        result = measure(
            job,
            iters=args.iters,
            repeats=args.repeats,
            warmup=args.warmup,
            runner=launch,
            work_dir=work_dir,
            spares=args.spares,
            progress=lambda line: print(line, flush=True),
        )
    except RuntimeError as exc:
        print(f"deadpool bench overhead: {exc}", file=sys.stderr)
        return 1
    publish(summary_lines(result), result, args.json_path)
    shutil.rmtree(work_dir, ignore_errors=True)
    if not (result["losses_identical"] and result["digests_identical"]):
        print(
            "deadpool bench overhead: DeadPool changed training (losses or parameters differ)",
            file=sys.stderr,
        )
        return 1
    return 0
