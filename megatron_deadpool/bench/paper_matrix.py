"""The failure-free part of `deadpool bench paper`: what fault tolerance costs per iteration.

The same job runs in each configuration of `MODES`, all configurations once per repeat,
interleaved (so drift in the machine's load hits all alike). The figure per run is the amortised
time per iteration: the mean gap between consecutive iteration ends over a window that starts
after the first save (its one-time start-up, e.g. the checkpoint writer's helper process, is
reported apart), so every save in the window is counted. The median over repeats is reported,
with the ratio to `no_ft`. Every configuration must give the same losses as `no_ft`.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config.job import JobConfig
from . import recovery as rec
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


def iteration_gaps(records: list[dict[str, Any]]) -> dict[int, float]:
    """iteration i -> seconds between the ends of iterations i-1 and i (saves after i-1 count)."""
    by_it = {r["iteration"]: r["time"] for r in records}
    return {i: by_it[i] - by_it[i - 1] for i in sorted(by_it) if i - 1 in by_it}


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def run_figures(records: list[dict[str, Any]], warmup: int, save_every: int) -> dict[str, Any]:
    """Amortised and median s/iteration of one run over iterations warmup+1.., first-save cost."""
    gaps = iteration_gaps(records)
    window = [g for i, g in gaps.items() if i > warmup]
    typical = _median(window)
    first = gaps.get(save_every + 1) if save_every else None
    return {
        "gaps_s": [round(g, 6) for g in window],
        "amortised_s": statistics.fmean(window) if window else None,
        "median_s": typical,
        "saves_in_window": sum(
            1 for i in gaps if i > warmup and save_every and (i - 1) % save_every == 0
        ),
        "first_save_s": None if first is None or typical is None else first - typical,
    }


def failure_free(
    jobs: dict[str, JobConfig],
    s: dict[str, Any],
    runner: Runner,
    work_dir: Path,
    unavailable: dict[str, str],
    progress: Callable[[str], None],
) -> tuple[dict[str, Any], rec.Launch | None]:
    """Run the matrix; its figures by configuration with the notes, and the first no-FT run."""
    modes = {m.key: m for m in MODES if m.key in s["modes"]}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in modes}
    reference: rec.Launch | None = None
    for rep in range(1, s["repeats"] + 1):
        for key, mode in modes.items():
            if key in unavailable:
                continue
            run_dir = work_dir / f"{key}-{rep}"
            job = mode_job(jobs, mode, s["interval"], run_dir / "ckpt")
            t0 = time.monotonic()
            result = runner(job, run_dir, False, mode.worker)
            ok = result.returncode == 0 and len(result.records) == s["iters"]
            progress(
                f"  {rep}/{s['repeats']} {mode.label:<46} exit {result.returncode}, "
                f"{len(result.records)} iterations, {time.monotonic() - t0:.0f}s"
            )
            if not ok:
                raise RuntimeError(
                    f"{mode.label}: run failed (exit {result.returncode}); logs in {run_dir}"
                )
            fig = run_figures(result.records, s["warmup"], job.train.save_interval)
            fig.update(
                repeat=rep,
                losses=[r["loss"] for r in result.records],
                digest=result.summary.get("final_param_digest"),
                wall_s=result.summary.get("wall_s"),
            )
            runs[key].append(fig)
            if key == "no_ft" and reference is None:
                reference = result
            if not s.get("keep"):
                shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
    base = runs.get("no_ft") or []
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
        mine = runs[key]
        ratios = [r["amortised_s"] / b["amortised_s"] for r, b in zip(mine, base)]
        entry.update(
            amortised_s=_median([r["amortised_s"] for r in mine]),
            median_s=_median([r["median_s"] for r in mine]),
            per_run_amortised_s=[r["amortised_s"] for r in mine],
            ratio_vs_no_ft=_median(ratios),
            ratios=ratios,
            first_save_s=_median(
                [r["first_save_s"] for r in mine if r["first_save_s"] is not None]
            ),
            saves_in_window=mine[0]["saves_in_window"],
            losses_match_no_ft=bool(base) and all(r["losses"] == base[0]["losses"] for r in mine),
            digests_match_no_ft=bool(base)
            and all(r["digest"] is not None and r["digest"] == base[0]["digest"] for r in mine),
            runs=mine,
        )
        out[key] = entry
    return {"modes": out, "notes": NOTES + _noise(out, s["repeats"])}, reference


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
    if repeats == 1:
        line += (
            "; with one repeat a ratio carries that noise: run without --quick (3 interleaved "
            "repeats) for figures to quote"
        )
    return [line]
