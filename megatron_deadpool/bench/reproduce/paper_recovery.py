"""The recovery part of `deadpool bench paper`: hot swap vs restart from a checkpoint.

`bench recovery`'s pair (DeadPool's hot swap, and the restart from a persistent checkpoint every
N iterations), timed by phase and repeated; the failure-free reference is the matrix's first
`no_ft` run. Also the data of the loss curve: the hot-swap run's losses against the reference's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...config.faults import parse_fault
from ...config.job import JobConfig
from .. import recovery as rec
from ..timed_launch import Launch
from .paper_matrix import matrix_jobs
from .paper_workers import Runner


def recovery_part(
    job: JobConfig,
    s: dict[str, Any],
    runner: Runner,
    work_dir: Path,
    reference: Launch | None,
    progress: Callable[[str], None],
) -> tuple[dict[str, Any], Launch | None, Launch | None]:
    """bench recovery's measure, `recovery_repeats` times; medians of totals and phases.

    Returns the result, the reference run and the first hot-swap run (for the loss curve).
    """
    jobs = matrix_jobs(job, s)
    seen: dict[str, Launch] = {}

    def run_one(variant: JobConfig, run_dir: Path, stop: bool) -> Launch:
        if reference is not None and variant == jobs["reference"]:
            seen.setdefault("reference", reference)
            return reference  # the first no-FT run is this very job: not run again
        launched = runner(variant, run_dir, stop, "")
        if variant == jobs["reference"]:
            seen.setdefault("reference", launched)
        if variant == jobs["deadpool"]:
            seen.setdefault("deadpool", launched)
        return launched

    results = []
    for rep in range(1, s["recovery_repeats"] + 1):
        progress(f"  recovery {rep}/{s['recovery_repeats']}: hot swap vs restart, {s['fail']}")
        results.append(
            rec.measure(
                job,
                iters=s["iters"],
                fail=s["fail"],
                save_interval=s["interval"],
                spares=None,
                runner=run_one,
                work_dir=work_dir / f"recovery-{rep}",
                progress=progress,
            )
        )
    out = rec.combine(results)
    out["phase_labels"] = dict(rec.PHASE_LABELS)
    return out, seen.get("reference"), seen.get("deadpool")


def loss_data(reference: Launch, hot: Launch, result: dict[str, Any], fail: str) -> dict[str, Any]:
    """The loss curve's data: both runs' losses, the failure, the recomputed iterations."""
    fault = parse_fault(fail)
    restore = int(result["deadpool_restore_iteration"])
    return {
        "reference_losses": [r["loss"] for r in reference.records],
        "deadpool_losses": [r["loss"] for r in hot.records],
        "fail_iteration": fault.iteration,
        "failure": str(fault),
        "restore_iteration": restore,
        "recomputed_iterations": list(range(restore + 1, fault.iteration)),
        "bitwise_identical": bool(result["deadpool_matches_reference"]),
    }
