"""The failure-free part of `deadpool bench paper`: what fault tolerance costs per iteration.

The same job runs in each configuration of `MODES`, all configurations once per repeat,
interleaved (so drift in the machine's load hits all alike). The figure per run is the amortised
time per iteration: the mean gap between consecutive iteration ends over a window that starts
after the first save (its one-time start-up, e.g. the checkpoint writer's helper process, is
reported apart), so every save in the window is counted. The median over repeats is reported,
with the ratio to `no_ft` of the same repeat: its median over repeats and the 95% interval of
that median (`stats.ratio_summary`), printed as a figure only when the interval excludes 1.
Every configuration must give the same losses as `no_ft`. The order of the runs, this definition
of time per iteration and the statistics are `interleaved.py`'s, shared with `bench overhead`;
this module adds the configurations and the report's entries.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...config.job import JobConfig
from .. import recovery as rec
from ..interleaved import Run, compare, interleave, measured_run
from ..stats import min_repeats
from ..timed_launch import Launch
from .paper_workers import Runner


@dataclasses.dataclass(frozen=True)
class Mode:
    key: str
    label: str
    deadpool: bool = False
    interval: str = ""  # "", "1" or "n"
    worker: str = ""  # "" or a paper_workers.KINDS
    protects: str = ""


MODES = (
    Mode("no_ft", "no fault tolerance", protects="nothing: a failure loses the job"),
    Mode("deadpool", "DeadPool", deadpool=True, protects="in-memory replicas; at most 1 iteration"),
    Mode("ckpt_1", "checkpoint every iteration", interval="1", protects="disk; restart"),
    Mode("ckpt_n", "checkpoint every N", interval="n", protects="disk; restart, up to N-1 lost"),
    Mode(
        "async_1",
        "async checkpoint every iteration",
        interval="1",
        worker="async",
        protects="disk; restart",
    ),
    Mode(
        "nvrx_local_1",
        "NVRx local ckpt + replication every iteration",
        interval="1",
        worker="nvrx-local",
        protects="local files + 1 peer copy; restart",
    ),
)
MODE_KEYS = tuple(m.key for m in MODES)

NOTES = [
    (
        "async: megatron-core `dist_checkpointing.save(..., async_sharded_save=True)` with its "
        "`AsyncCallsQueue` (forked writer, as Megatron-LM's `--async-save` without the "
        "persistent worker); one save in flight: the next save first waits for the previous "
        "one. Not in checkpoint.py yet: the bench's worker passes its own saver."
    ),
    (
        "NVRx: `LocalCheckpointManager` + `LazyCliqueReplicationStrategy(jump = ranks per node, "
        "factor 2)` on `MCoreTensorAwareStateDict.from_state_dict(algo='fully_parallel')`, "
        "synchronous (`is_async=False`), as Megatron-LM's `--non-persistent-ckpt-type local "
        "--replication`; failure-free cost only (its restart path is not measured here)."
    ),
    (
        "the first save of a process starts megatron-core's writer helper (spawned process); "
        "that start-up is the 'first-save start-up' column and stays out of the window."
    ),
]
"""How the configurations that are not `checkpoint.py`'s were measured, for the report."""


def matrix_jobs(job: JobConfig, s: dict[str, Any]) -> dict[str, JobConfig]:
    """bench recovery's jobs for `job`: the failure-free reference and the hot-swap job."""
    return rec.jobs(
        job,
        iters=s["iters"],
        fail=s["fail"],
        save_interval=s["interval"],
        save_dir="-",
        spares=None,
    )


def mode_job(jobs: dict[str, JobConfig], mode: Mode, interval: int, save_dir: Path) -> JobConfig:
    """The reference (DeadPool off, no checkpoint, no fault) turned into `mode`."""
    ref = jobs["reference"]
    if mode.deadpool:  # the hot-swap job's DeadPool settings and spares, without the failure
        return dataclasses.replace(ref, deadpool=jobs["deadpool"].deadpool.replace(fail=[]))
    if not mode.interval:
        return ref
    every = 1 if mode.interval == "1" else interval
    train = dataclasses.replace(ref.train, save=str(save_dir), save_interval=every)
    return dataclasses.replace(ref, train=train)


def failure_free(
    jobs: dict[str, JobConfig],
    s: dict[str, Any],
    runner: Runner,
    work_dir: Path,
    unavailable: dict[str, str],
    progress: Callable[[str], None],
) -> tuple[dict[str, Any], Launch | None]:
    """Run the matrix; its figures by configuration with the notes, and the first no-FT run."""
    modes = {m.key: m for m in MODES if m.key in s["modes"]}
    reference: list[Launch] = []  # the first no-FT run (bench recovery's reference)

    def run_one(key: str, repeat: int) -> Run:
        mode = modes[key]
        run_dir = work_dir / f"{key}-{repeat}"
        job = mode_job(jobs, mode, s["interval"], run_dir / "ckpt")
        t0 = time.monotonic()
        result = runner(job, run_dir, False, mode.worker)
        progress(
            f"  {repeat}/{s['repeats']} {mode.label:<46} exit {result.returncode}, "
            f"{len(result.records)} iterations, {time.monotonic() - t0:.0f}s"
        )
        run = measured_run(
            key,
            repeat,
            result,
            iters=s["iters"],
            warmup=s["warmup"],
            save_every=job.train.save_interval,
            what=mode.label,
            run_dir=run_dir,
        )
        if key == "no_ft" and not reference:
            reference.append(result)
        if not s.get("keep"):
            shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
        return run

    measured = [k for k in modes if k not in unavailable]
    runs = interleave(measured, s["repeats"], run_one)
    out: dict[str, Any] = {}
    for key, mode in modes.items():
        entry: dict[str, Any] = {
            "label": mode.label,
            "protects": mode.protects,
            "save_every": {"1": 1, "n": s["interval"]}.get(mode.interval, 0),
        }
        if key in unavailable:
            entry.update(amortised_s=None, reason=unavailable[key], runs=[])
            out[key] = entry
            continue
        c = compare(runs[key], runs.get("no_ft", []))
        entry.update(
            amortised_s=c["amortised_s"],
            median_s=c["median_s"],
            per_run_amortised_s=c["per_run_amortised_s"],
            ratio_vs_no_ft=c["ratio_median"],
            ratio=c["ratio"],
            ratios=c["ratios"],
            first_save_s=c["first_save_s"],
            saves_in_window=c["saves_in_window"],
            losses_match_no_ft=c["losses_match"],
            digests_match_no_ft=c["digests_match"],
            runs=[r.to_dict() for r in runs[key]],
        )
        out[key] = entry
    return {"modes": out, "notes": NOTES + _noise(out, s["repeats"])}, next(iter(reference), None)


def _noise(modes: dict[str, Any], repeats: int) -> list[str]:
    """How much the machine moved the baseline: the no-FT run's gaps, first repeat."""
    runs = modes.get("no_ft", {}).get("runs") or []
    if not runs or not runs[0]["gaps_s"]:
        return []
    gaps = runs[0]["gaps_s"]
    line = (
        f"noise: the no-FT run's per-iteration gaps ranged {min(gaps):.3f}-{max(gaps):.3f} s "
        f"(median {statistics.median(gaps):.3f} s)"
    )
    if repeats < min_repeats():
        line += (
            f"; {repeats} repeat(s) give no 95% interval for a ratio: run without --quick "
            f"({min_repeats()} or more interleaved repeats) for figures to quote"
        )
    return [line]
