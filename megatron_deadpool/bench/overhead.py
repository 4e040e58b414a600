"""`deadpool bench overhead`: what per-iteration replication costs, DeadPool on vs off.

The same job runs with DeadPool off and on, interleaved (off, on, off, on, ...) so that drift
in the machine's load hits both alike. Each run's first `--warmup` iterations are left out
(process start-up, allocator and gloo warm-up); the figure per run is its amortised time per
iteration over the rest: the mean gap between consecutive iteration ends (`interleaved.py` owns
the order of the runs, this definition and the statistics, shared with `bench paper`). The
result is the median over repeats of the on/off ratio of paired runs, plus the median of each
mode's runs:

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
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.job import JobConfig
from ..config.numbers import number_arg
from ..errors import ConfigError
from .cpu_use import CpuSampler
from .interleaved import Launched, Run, check_window, compare, interleave, measured_run
from .job_options import add_job_options, add_run_limit, base_job
from .report import job_shape, publish, text_row
from .stats import median, ratio_text

if TYPE_CHECKING:
    from ..hotswap.launch.local_job import LocalJob


@dataclasses.dataclass
class SampledRun:
    """A run's result and the CPU its processes used, by role (`cpu_use`)."""

    returncode: int
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    cpu: CpuSampler | None = None


Runner = Callable[[JobConfig, Path], Launched]


def configure(parser: argparse.ArgumentParser) -> None:
    add_job_options(parser, iters=20)
    parser.add_argument(
        "--repeats",
        type=number_arg(integer=True, minimum=1),
        default=6,
        help="pairs of runs, off then on (default 6, the fewest that give a 95%% interval)",
    )
    parser.add_argument(
        "--warmup",
        type=number_arg(integer=True, minimum=0),
        default=2,
        help="first iterations of each run left out (default 2)",
    )
    parser.add_argument(
        "--spares",
        type=number_arg(integer=True, minimum=0),
        default=None,
        help="spares in the DeadPool-on runs (default: config)",
    )
    parser.add_argument("--json", dest="json_path", help="write the results as JSON here")
    add_run_limit(parser, timeout=600.0, keep=False)


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
    check_window(iters=iters, warmup=warmup)


def _launch(job: JobConfig, run_dir: Path, timeout_s: float = 600.0) -> SampledRun:
    """Run `job`, sampling the CPU its processes use from the moment they start."""
    from ..embedded.launch import LaunchHooks, LocalLauncher

    samplers: list[CpuSampler] = []

    def started(local: LocalJob) -> None:
        samplers.append(CpuSampler(local.procs))  # the processes join it as they start
        samplers[0].start()

    launcher = LocalLauncher(
        job, run_dir=str(run_dir), quiet=True, timeout_s=timeout_s, hooks=LaunchHooks(started)
    )
    try:
        result = launcher.run()
    finally:
        for sampler in samplers:
            sampler.stop()
    return SampledRun(result.returncode, result.records, result.summary, samplers[0])


def cpu_per_iteration(result: Launched, warmup: int) -> dict[str, float] | None:
    """CPU seconds per timed iteration by role (ranks, spares, launcher), if sampled."""
    sampler = getattr(result, "cpu", None)
    records = result.records
    if sampler is None or len(records) <= max(warmup, 1):
        return None
    start = records[max(warmup, 1) - 1]["time"]
    timed = len(records) - max(warmup, 1)
    return {k: v / timed for k, v in sampler.window(start, records[-1]["time"]).items()}


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

    def run_one(mode: str, repeat: int) -> Run:
        run_dir = work_dir / f"{mode}-{repeat}"
        result = runner(jobs[mode], run_dir)
        run = measured_run(
            mode,
            repeat,
            result,
            iters=iters,
            warmup=warmup,
            what=f"DeadPool {mode}",
            run_dir=run_dir,
        )
        timed = result.records[warmup:]
        run.extra.update(
            median_replication_s=median([r.get("replication_s", 0.0) for r in timed]),
            replica_bytes_per_rank=result.records[-1].get("replica_bytes_sent", 0),
            cpu_per_iter_s=cpu_per_iteration(result, warmup),
        )
        progress(_row(run))
        return run

    runs = interleave(("off", "on"), repeats, run_one)
    off, on = compare(runs["off"], runs["off"]), compare(runs["on"], runs["off"])
    ci = on["ratio"]["ci"]
    return {
        "cpu_per_iter_s": {mode: _cpu_medians(runs[mode]) for mode in ("off", "on")},
        "off_iter_s": off["amortised_s"],
        "on_iter_s": on["amortised_s"],
        "ratio_median": on["ratio_median"],
        "ratio_ci95": list(ci) if ci else None,
        "ratio": on["ratio"],
        "ratios": on["ratios"],
        "overhead_pct": (on["ratio_median"] - 1.0) * 100.0,
        "losses_identical": off["losses_match"] and on["losses_match"],
        "digests_identical": off["digests_match"] and on["digests_match"],
        "time_per_iteration": "amortised: the mean gap between consecutive iteration ends, "
        "warm-up left out (median over a mode's runs)",
        "config": {
            **job_shape(jobs["on"]),
            "spares_on": jobs["on"].deadpool.spares,
            "iters": iters,
            "warmup": warmup,
            "repeats": repeats,
        },
        "runs": [r.to_dict() for pair in zip(runs["off"], runs["on"]) for r in pair],
    }


def _cpu_medians(runs: list[Run]) -> dict[str, float | None] | None:
    """Median over `runs` of the CPU seconds per iteration of each role."""
    cpu = [r.extra["cpu_per_iter_s"] for r in runs if r.extra["cpu_per_iter_s"]]
    return {k: median([c[k] for c in cpu]) for k in cpu[0]} if cpu else None


_SPECS = (">4", ">8", ">12", ">10", ">11")
_HEADER = text_row(["run", "deadpool", "s/it", "repl s/it", "bytes/rank"], _SPECS)


def _row(run: Run) -> str:
    cells = [
        str(run.repeat),
        run.config,
        f"{run.times.amortised_s:.4f}",
        f"{run.extra['median_replication_s']:.4f}",
        f"{run.extra['replica_bytes_per_rank']:,d}",
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
