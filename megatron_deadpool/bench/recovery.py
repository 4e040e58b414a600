"""`deadpool bench recovery`: hot swap vs. the restart from a checkpoint a user has today.

The same job meets the same failure twice:

(a) **DeadPool hot swap**: DeadPool on with spares; a spare takes the failed rank's slot (in-place
    respawn off: `deadpool bench goodput` measures respawns) and the survivors roll back to the
    last replicated iteration. Phases from the run's summary
    (`recoveries`: detect, agree, reconstruct, restore, first iteration). With `--node-agents`
    the hot swap runs the way the Slurm scripts run a job: one `deadpool agent` per simulated
    node starts its processes and reports a crash the moment it happens (its detection).
(b) **Restart baseline**: DeadPool off, persistent Megatron checkpoints every `--save-interval`
    iterations (`--save DIR`); the failure kills the job; the launcher stops every process (as
    torchrun does on a worker failure) and the whole job is relaunched at once with
    `--load DIR`, resuming from the last checkpoint. Phases: detect (the launcher sees the
    exit), teardown (every process stopped), relaunch + init (process start, imports,
    process groups, model and optimizer build), checkpoint load, recomputation of the lost
    iterations (checkpoint + 1 .. failure - 1), first iteration.

Both times run from the failure (the dying process's own timestamp) until training is back where
it failed: the iteration during which it failed has completed again. A failure-free reference
run (DeadPool off) gives the loss sequence and final parameter digest both must reproduce. Each
run is launched, and its times recorded, by `timed_launch.py`.

    deadpool bench recovery --iters 12 --fail 2@8 --save-interval 5 --json recovery.json

writes `{"deadpool_recovery_s", "restart_recovery_s", "speedup", "deadpool_recomputed",
"restart_recomputed", "deadpool_phases_s", "restart_phases_s", "deadpool_matches_reference",
"restart_matches_reference", ...}`. Exit status 1 when a run fails or does not reproduce the
failure-free run.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config.faults import check_faults, parse_fault
from ..config.job import JobConfig
from ..config.numbers import number_arg
from ..errors import ConfigError
from .job_options import add_job_options, add_run_limit, base_job
from .report import job_shape, publish, text_row, yes_no
from .stats import ratio_summary, ratio_text
from .timed_launch import Launch, Runner, launch

DEADPOOL_PHASES = ("detect", "agree", "reconstruct", "restore")
RESTART_PHASES = ("detect", "teardown", "relaunch_init", "checkpoint_load")
COMMON_PHASES = ("recompute", "first_iteration")
PHASE_ORDER = (*DEADPOOL_PHASES, *RESTART_PHASES[1:], *COMMON_PHASES)
"""The rows of a side-by-side table: the hot swap's phases, then the restart's own."""
PHASE_LABELS = {
    "detect": "detect failure",
    "agree": "agree (dead set, restore iteration)",
    "reconstruct": "reconstruct process groups",
    "restore": "restore state from replicas",
    "teardown": "tear down the job",
    "relaunch_init": "relaunch + init (start to load)",
    "checkpoint_load": "load persistent checkpoint",
    "recompute": "recompute lost iterations",
    "first_iteration": "the failed iteration again",
}


def configure(parser: argparse.ArgumentParser) -> None:
    add_job_options(parser, iters=12)
    parser.add_argument(
        "--fail",
        default="2@8",
        help="the failure, RANK@ITER or node:N@ITER (a crash; default 2@8)",
    )
    parser.add_argument(
        "--save-interval",
        type=number_arg(integer=True, minimum=0),
        default=5,
        help="restart baseline: persistent checkpoint every N iterations (default 5)",
    )
    parser.add_argument(
        "--spares",
        type=number_arg(integer=True, minimum=0),
        default=None,
        help="spares for the hot swap (default: the config's, at least one per failed rank)",
    )
    parser.add_argument(
        "--repeats",
        type=number_arg(integer=True, minimum=1),
        default=1,
        help="measure the pair N times: medians, and the speedup's 95%% interval from 6 on "
        "(default 1)",
    )
    parser.add_argument(
        "--node-agents",
        action="store_true",
        help="run the hot swap as the Slurm scripts do: one `deadpool agent` per simulated node "
        "(it reports a crash at once); the restart baseline as before",
    )
    parser.add_argument("--json", dest="json_path", help="write the results as JSON here")
    add_run_limit(parser, timeout=600.0)


# ---------------------------------------------------------------------- jobs
def jobs(
    job: JobConfig, *, iters: int, fail: str, save_interval: int, save_dir: str, spares: int | None
) -> dict[str, JobConfig]:
    """The four launches: reference, hot swap, restart (failing part), restart (relaunch)."""
    fault = parse_fault(fail)
    if fault.kind != "kill":
        raise ConfigError(
            f"fail: the restart baseline needs a crash ({fail!r} is a hang, which only the "
            "collective timeout would end); use RANK@ITER or RANK@ITER:kill"
        )
    if save_interval < 0:
        raise ConfigError(f"save-interval: must be >= 0, got {save_interval}")
    train = dataclasses.replace(job.train, iters=iters, save=None, save_interval=0, load=None)
    dp = job.deadpool.replace(fail=[])
    check_faults([fault], job.parallel.world_size, job.ranks_per_node, iters)
    hit = len(fault.ranks(job.ranks_per_node))
    hot_spares = max(dp.spares, hit) if spares is None else spares
    off = dp.replace(enabled=False, spares=0)
    saving = dataclasses.replace(
        train, save=save_dir if save_interval else None, save_interval=save_interval
    )
    return {
        "reference": dataclasses.replace(job, train=train, deadpool=off),
        "deadpool": dataclasses.replace(
            job,
            train=train,
            # a spare's takeover, as this benchmark has always measured (a respawn: goodput)
            deadpool=dp.replace(enabled=True, spares=hot_spares, fail=[fail], respawn_limit=0),
        ),
        "restart_fail": dataclasses.replace(job, train=saving, deadpool=off.replace(fail=[fail])),
        "restart_resume": dataclasses.replace(
            job, train=dataclasses.replace(saving, load=save_dir), deadpool=off
        ),
    }


# ---------------------------------------------------------------------- timing
def _by_iteration(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["iteration"]: r for r in records}


def catch_up(
    records: list[dict[str, Any]], *, fail_iter: int, resumed_from: int, ready_at: float
) -> dict[str, float]:
    """Recompute and first-iteration phases after training restarts at `resumed_from + 1`.

    `ready_at` is when state was back (restored or loaded); `records` are the ones of the run
    after the failure. Recompute covers iterations resumed_from + 1 .. fail_iter - 1, the first
    iteration is `fail_iter` itself.
    """
    by_it = _by_iteration(records)
    if fail_iter not in by_it:
        raise RuntimeError(f"no record of iteration {fail_iter} after the failure")
    recompute, start = 0.0, ready_at
    if resumed_from < fail_iter - 1:
        recompute = by_it[fail_iter - 1]["time"] - ready_at
        start = by_it[fail_iter - 1]["time"]
    return {"recompute": recompute, "first_iteration": by_it[fail_iter]["time"] - start}


def deadpool_timing(run: Launch, fail_iter: int) -> dict[str, Any]:
    """Phases of the hot swap, from the summary's recovery record and the iteration records."""
    recoveries = run.summary.get("recoveries") or []
    if run.returncode != 0 or not recoveries or run.failed_at is None:
        raise RuntimeError(
            f"hot-swap run failed (exit {run.returncode}, {len(recoveries)} recoveries); "
            f"logs in {run.run_dir}"
        )
    rec = recoveries[0]
    phases = {k: float(rec["phases_s"][k]) for k in DEADPOOL_PHASES}
    restored_at = run.failed_at + sum(phases.values())
    phases.update(
        catch_up(
            run.records,
            fail_iter=fail_iter,
            resumed_from=rec["restore_iteration"],
            ready_at=restored_at,
        )
    )
    back = _by_iteration(run.records)[fail_iter]["time"]
    return {
        "recovery_s": back - run.failed_at,
        "phases_s": phases,
        "recomputed": int(rec["recomputed_iterations"]),
        "restore_iteration": rec["restore_iteration"],
        "summary_total_s": rec.get("total_s"),
        "newcomers_claimed_s": rec.get("newcomers_claimed_s"),
    }


def restart_timing(failing: Launch, resumed: Launch, fail_iter: int) -> dict[str, Any]:
    """Phases of the restart: failure -> detect -> teardown -> relaunch -> load -> catch up."""
    if failing.failed_at is None or failing.detected_at is None or failing.stopped_at is None:
        raise RuntimeError(
            f"restart baseline: the failing run did not fail as injected (exit "
            f"{failing.returncode}); logs in {failing.run_dir}"
        )
    if resumed.returncode != 0 or not resumed.records:
        raise RuntimeError(
            f"restart baseline: the relaunch failed (exit {resumed.returncode}); logs in "
            f"{resumed.run_dir}"
        )
    first = resumed.records[0]
    checkpoint_iter = first["iteration"] - 1
    first_start = first["time"] - first["iter_time_s"]  # the load ends right before it
    load_s = resumed.load_s if checkpoint_iter > 0 and resumed.load_s is not None else 0.0
    phases = {
        "detect": failing.detected_at - failing.failed_at,
        "teardown": failing.stopped_at - failing.detected_at,
        "relaunch_init": first_start - load_s - failing.stopped_at,
        "checkpoint_load": load_s,
    }
    phases.update(
        catch_up(
            resumed.records,
            fail_iter=fail_iter,
            resumed_from=checkpoint_iter,
            ready_at=first_start,
        )
    )
    back = _by_iteration(resumed.records)[fail_iter]["time"]
    return {
        "recovery_s": back - failing.failed_at,
        "phases_s": phases,
        "recomputed": max(0, fail_iter - 1 - checkpoint_iter),
        "checkpoint_iteration": checkpoint_iter,
        "load_measured": resumed.load_s is not None,
        "relaunch_gap_s": resumed.spawned_at - failing.stopped_at,
    }


def first_save_stall_s(run: Launch, save_interval: int) -> float | None:
    """How long the first persistent save held training up (gap after its iteration)."""
    by_it = _by_iteration(run.records)
    if not save_interval or save_interval + 1 not in by_it or save_interval not in by_it:
        return None
    nxt = by_it[save_interval + 1]
    return nxt["time"] - nxt["iter_time_s"] - by_it[save_interval]["time"]


# ---------------------------------------------------------------------- the bench
def measure(
    job: JobConfig,
    *,
    iters: int,
    fail: str,
    save_interval: int,
    spares: int | None,
    runner: Runner,
    work_dir: Path,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Run reference, hot swap and restart; compare. Raises RuntimeError when a run fails."""
    save_dir = work_dir / "checkpoints"
    variants = jobs(
        job,
        iters=iters,
        fail=fail,
        save_interval=save_interval,
        save_dir=str(save_dir),
        spares=spares,
    )
    fail_iter = parse_fault(fail).iteration
    runs: dict[str, Launch] = {}
    describe = {
        "reference": "reference: DeadPool off, no failure",
        "deadpool": f"hot swap: DeadPool on, {fail}",
        "restart_fail": f"restart: DeadPool off, checkpoint every {save_interval}, {fail}",
        "restart_resume": "restart: relaunch with --load",
    }
    for name, variant in variants.items():
        t0 = time.monotonic()
        runs[name] = runner(variant, work_dir / name, name == "restart_fail")
        run = runs[name]
        progress(
            f"  {describe[name]:<52} exit {run.returncode}, {len(run.records)} iterations "
            f"recorded, {time.monotonic() - t0:.1f}s"
        )
    ref = runs["reference"]
    if ref.returncode != 0 or not ref.summary.get("final_param_digest"):
        raise RuntimeError(f"reference run failed (exit {ref.returncode}); logs in {ref.run_dir}")
    hot = deadpool_timing(runs["deadpool"], fail_iter)
    restart = restart_timing(runs["restart_fail"], runs["restart_resume"], fail_iter)
    reference_digest = ref.summary["final_param_digest"]
    ckpt = restart["checkpoint_iteration"]
    restart_losses = [r["loss"] for r in runs["restart_fail"].records[:ckpt]] + [
        r["loss"] for r in runs["restart_resume"].records
    ]
    hot_losses = [r["loss"] for r in runs["deadpool"].records]
    ref_losses = [r["loss"] for r in ref.records]
    return {
        "deadpool_recovery_s": hot["recovery_s"],
        "process_groups": groups_way(runs["deadpool"].run_dir),
        "restart_recovery_s": restart["recovery_s"],
        "speedup": restart["recovery_s"] / hot["recovery_s"],
        "deadpool_recomputed": hot["recomputed"],
        "restart_recomputed": restart["recomputed"],
        "deadpool_phases_s": hot["phases_s"],
        "restart_phases_s": restart["phases_s"],
        "deadpool_restore_iteration": hot["restore_iteration"],
        "deadpool_summary_total_s": hot["summary_total_s"],
        "deadpool_newcomers_claimed_s": hot["newcomers_claimed_s"],
        "restart_checkpoint_iteration": ckpt,
        "restart_load_measured": restart["load_measured"],
        "restart_relaunch_gap_s": restart["relaunch_gap_s"],
        "restart_first_save_stall_s": first_save_stall_s(runs["restart_fail"], save_interval),
        "reference_digest": reference_digest,
        "deadpool_digest": runs["deadpool"].summary.get("final_param_digest"),
        "restart_digest": runs["restart_resume"].summary.get("final_param_digest"),
        "deadpool_matches_reference": runs["deadpool"].summary.get("final_param_digest")
        == reference_digest
        and hot_losses == ref_losses,
        "restart_matches_reference": runs["restart_resume"].summary.get("final_param_digest")
        == reference_digest
        and restart_losses == ref_losses,
        "job_wall_s": {
            "reference": ref.summary.get("wall_s"),
            "deadpool": runs["deadpool"].summary.get("wall_s"),
            "restart": (runs["restart_fail"].summary.get("wall_s") or 0.0)
            + (runs["restart_resume"].summary.get("wall_s") or 0.0),
        },
        "median_iter_s": ref.summary.get("median_iter_time_s"),
        "definition": (
            "seconds from the failure (the dying process's timestamp) until the iteration "
            "during which it failed has completed again"
        ),
        "config": {
            **job_shape(variants["deadpool"]),
            "spares": variants["deadpool"].deadpool.spares,
            "iters": iters,
            "fail": fail,
            "fail_iteration": fail_iter,
            "save_interval": save_interval,
        },
    }


GROUPS_LINE = "process groups on a recovery: "
"""What each DeadPool process logs as it starts (`Driver`): repaired in place or rebuilt, why."""


def groups_way(run_dir: Path) -> str:
    """How the hot-swap run's processes reconstruct their groups on a recovery, as their logs
    say (`devices.reconfigure.choose`: ``repair (...)`` or ``rebuild (...)``); the distinct
    answers joined by ``; `` (one, unless processes differ), or ``unknown``."""
    ways: set[str] = set()
    for path in sorted(run_dir.glob("**/*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if GROUPS_LINE in line:
                ways.add(line.split(GROUPS_LINE, 1)[1].strip())
    return "; ".join(sorted(ways)) or "unknown"


def combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of `measure`: the first one's details, with the medians of the totals and of
    every phase, each repeat's totals and recomputations, and the median speedup with its
    interval (`stats.ratio_summary`)."""
    out = dict(results[0])
    for side in ("deadpool", "restart"):
        out[f"{side}_recovery_s"] = statistics.median(r[f"{side}_recovery_s"] for r in results)
        out[f"{side}_recovery_runs_s"] = [r[f"{side}_recovery_s"] for r in results]
        out[f"{side}_recomputed_runs"] = [r[f"{side}_recomputed"] for r in results]
        out[f"{side}_phases_runs_s"] = {
            k: [r[f"{side}_phases_s"][k] for r in results] for k in results[0][f"{side}_phases_s"]
        }
        out[f"{side}_phases_s"] = {
            k: statistics.median(v) for k, v in out[f"{side}_phases_runs_s"].items()
        }
    claimed = [r["deadpool_newcomers_claimed_s"] for r in results]
    out["deadpool_newcomers_claimed_runs_s"] = claimed
    if None not in claimed:
        out["deadpool_newcomers_claimed_s"] = statistics.median(claimed)
    out["speedup"] = out["restart_recovery_s"] / out["deadpool_recovery_s"]
    out["speedup_runs"] = [r["restart_recovery_s"] / r["deadpool_recovery_s"] for r in results]
    out["speedup_ratio"] = ratio_summary(out["speedup_runs"])
    for flag in ("deadpool_matches_reference", "restart_matches_reference"):
        out[flag] = all(r[flag] for r in results)
    out["repeats"] = len(results)
    out["process_groups"] = "; ".join(sorted({r.get("process_groups", "unknown") for r in results}))
    return out


def phase_rows(result: dict[str, Any], cell: Callable[[float], str]) -> list[list[str]]:
    """Label, hot-swap cell, restart cell for each phase of `PHASE_ORDER` ('-': not a phase of
    that side)."""
    sides = (result["deadpool_phases_s"], result["restart_phases_s"])
    return [[PHASE_LABELS[k], *(cell(d[k]) if k in d else "-" for d in sides)] for k in PHASE_ORDER]


def spread_lines(result: dict[str, Any]) -> list[str]:
    """Each repeat's hot swap, in total and by phase (the medians' spread: a figure near a
    target is read with it)."""

    def runs(values: list[float]) -> str:
        return "/".join(f"{v:.3f}" for v in values)

    phases = result["deadpool_phases_runs_s"]
    lines = [f"hot swap per repeat (s): total {runs(result['deadpool_recovery_runs_s'])}"]
    lines += [f"  {PHASE_LABELS[k]:<36}{runs(phases[k])}" for k in PHASE_ORDER if k in phases]
    return lines


def table(result: dict[str, Any]) -> list[str]:
    """The side-by-side table, then totals, recomputation, correctness and the speedup."""
    specs = ("<36", ">18", ">18")
    header = text_row(["phase", "DeadPool hot swap", "restart from ckpt"], specs)
    totals = [
        [
            "failure -> failed iteration done",
            f"{result['deadpool_recovery_s']:.3f}s",
            f"{result['restart_recovery_s']:.3f}s",
        ],
        [
            "iterations recomputed",
            *(
                "/".join(
                    map(str, result.get(f"{side}_recomputed_runs", [result[f"{side}_recomputed"]]))
                )
                for side in ("deadpool", "restart")
            ),
        ],
        [
            "same losses + params as no failure",
            yes_no(result["deadpool_matches_reference"]),
            yes_no(result["restart_matches_reference"]),
        ],
    ]
    lines = [header, *(text_row(r, specs) for r in phase_rows(result, lambda s: f"{s:.3f}s"))]
    lines.append("-" * len(header))
    lines += [text_row(r, specs) for r in totals]
    c = result["config"]
    lines.append(
        f"restart resumed from the checkpoint of iteration {result['restart_checkpoint_iteration']}"
        f" (every {c['save_interval']}); DeadPool restored iteration "
        f"{result['deadpool_restore_iteration']} from memory"
    )
    stall = result.get("restart_first_save_stall_s")
    if stall is not None:
        lines.append(f"the restart run's first persistent save held training up {stall:.2f}s")
    claimed = result.get("deadpool_newcomers_claimed_s")
    if claimed is not None:
        lines.append(
            f"of the hot swap's reconstruct, {claimed:.3f}s until the newcomer claimed its slot "
            "(its objects built after the agreement), the rest its groups' repair or creation"
        )
    lines.append(f"process groups on the hot swap: {result.get('process_groups', 'unknown')}")
    if result.get("node_agents"):
        lines.append("the hot swap launched by node agents: one `deadpool agent` per node")
    repeats = result.get("repeats", 1)
    if repeats == 1:
        lines.append(f"speedup of the hot swap: {result['speedup']:.1f}x")
        return lines
    runs = ", ".join(f"{x:.1f}x" for x in result["speedup_runs"])
    lines.insert(0, f"medians of {repeats} repeats (each repeat's counts separated by /)")
    lines.append(f"speedup of the hot swap per repeat: {runs}")
    lines += spread_lines(result)
    lines.append(
        f"speedup of the hot swap, median: {ratio_text(result['speedup_ratio'], 1)}; "
        f"lowest {min(result['speedup_runs']):.1f}x"
    )
    return lines


def run(args: argparse.Namespace, runner: Runner | None = None) -> int:
    job = base_job(args.config)
    try:
        jobs(
            job,
            iters=args.iters,
            fail=args.fail,
            save_interval=args.save_interval,
            save_dir="-",
            spares=args.spares,
        )
    except ConfigError as exc:
        print(f"deadpool bench recovery: {exc}", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(
            f"deadpool bench recovery: --repeats: must be >= 1, got {args.repeats}", file=sys.stderr
        )
        return 2
    work_dir = Path(tempfile.mkdtemp(prefix="deadpool-bench-recovery-"))
    p = job.parallel
    print(
        f"deadpool bench recovery: tp={p.tp} pp={p.pp} dp={p.dp}, {args.iters} iterations, "
        f"failure {args.fail}, restart baseline checkpoints every {args.save_interval}; runs in "
        f"{work_dir}",
        flush=True,
    )
    results = []
    runner = runner or (
        lambda j, d, stop: launch(
            j, d, stop, args.timeout, node_agents=args.node_agents and j.deadpool.enabled
        )
    )
    try:
        for rep in range(1, args.repeats + 1):
            if args.repeats > 1:
                print(f"repeat {rep}/{args.repeats}", flush=True)
            results.append(
                measure(
                    job,
                    iters=args.iters,
                    fail=args.fail,
                    save_interval=args.save_interval,
                    spares=args.spares,
                    runner=runner,
                    work_dir=work_dir / f"repeat-{rep}" if args.repeats > 1 else work_dir,
                    progress=lambda line: print(line, flush=True),
                )
            )
        result = results[0] if args.repeats == 1 else combine(results)
    except RuntimeError as exc:
        print(f"deadpool bench recovery: {exc}", file=sys.stderr)
        return 1
    result["node_agents"] = args.node_agents
    publish(table(result), result, args.json_path)
    if not args.keep:
        shutil.rmtree(work_dir, ignore_errors=True)
    if not (result["deadpool_matches_reference"] and result["restart_matches_reference"]):
        print(
            "deadpool bench recovery: a recovered run differs from the failure-free run",
            file=sys.stderr,
        )
        return 1
    return 0
