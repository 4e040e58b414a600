"""`deadpool bench goodput`: a run through a trace of failures, three ways to survive it.

One job, one failure trace (`failure_trace.py`: process crashes, lost nodes, hangs, at a rate
and in a mix the flags set; by default Llama 3's interruption causes), compressed in time
(a failure every few iterations instead of every few hours), run three ways:

(a) ``respawn``: DeadPool with in-place respawn (`--deadpool-respawn-limit`): a failed process
    on a live node is replaced there by its node's agent, a lost node (its agent with it)
    takes spares;
(b) ``spares``: DeadPool as it was: every failure takes a spare; once none is left the run
    ends out of redundancy (exit 3), saves what survives, and is started again with `--load`
    and its spares back (as a requeued job would be);
    both with one `deadpool agent` per simulated node, as on a cluster (`deadpool train
    --node-agents`): a lost node's processes are found by their silence, not by their exit;
(c) ``restart``: what users run today: DeadPool off, a persistent checkpoint every
    `--save-interval` iterations; every failure stops the job (every process killed, as
    torchrun does) and it starts again with `--load`.
A run starts again at once (no queue wait: a real requeue adds its own). For each: the
effective training time ratio - the failure-free run's time for the job's iterations over the
wall time it took through the trace -, the failures survived without a restart, the restarts,
the iterations computed again, the spares used and the spare pool along the run (a plot), and
whether it ended with the failure-free run's parameters.

    deadpool bench goodput --iters 120 --failures 8 --json goodput.json --plot goodput.png

Each way's wall time is also predicted by the planner's goodput model (`deadpool plan
--trace`) from costs measured in the same run (`goodput_model.py`), with its error.

Exit status 1 when a way does not finish or ends with other parameters than the failure-free
run; 2 for bad flags.
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

from ..config.job import JobConfig
from ..config.numbers import check_number, number_arg
from ..errors import ConfigError, ExitCode
from ..planner.goodput import WAYS
from .failure_trace import LLAMA3_MIX, failure_trace, kind_of, parse_mix
from .goodput_model import measured_costs, predict
from .job_options import add_job_options, add_run_limit, base_job
from .plots import spare_pool
from .report import job_shape, publish, text_row, yes_no
from .timed_launch import Launch, launch

MODES = WAYS  # the planner's ways: `goodput_model.predict` simulates each mode by its name
LABELS = {
    "respawn": "DeadPool, in-place respawn",
    "spares": "DeadPool, spares only",
    "restart": "restart from checkpoints",
}
MAX_LAUNCHES = 50
"""A way that needs more launches than this is stuck, not slow."""


def configure(parser: argparse.ArgumentParser) -> None:
    add_job_options(parser, iters=120, iters_help="iterations")
    parser.add_argument(
        "--failures",
        type=number_arg(integer=True, minimum=1),
        default=8,
        help="failures in the trace (default 8)",
    )
    parser.add_argument(
        "--mix",
        default=",".join(f"{k}={v:.3f}" for k, v in LLAMA3_MIX.items()),
        help="kinds of failure and their weights, KIND=WEIGHT,... with KIND crash, node or hang "
        "(default: Llama 3 405B's interruptions, crash=0.773,node=0.210,hang=0.017)",
    )
    parser.add_argument(
        "--seed", type=number_arg(integer=True), default=0, help="seed of the trace (default 0)"
    )
    parser.add_argument(
        "--spares",
        type=number_arg(integer=True, minimum=0),
        default=2,
        help="spares of the DeadPool ways (default 2)",
    )
    parser.add_argument(
        "--respawn-limit",
        type=number_arg(integer=True, minimum=1),
        default=3,
        help="(a)'s --deadpool-respawn-limit: respawns per node (default 3)",
    )
    parser.add_argument(
        "--save-interval",
        type=number_arg(integer=True, minimum=1),
        default=10,
        help="(c)'s persistent checkpoint every N iterations (default 10)",
    )
    parser.add_argument("--json", dest="json_path", help="write the results as JSON here")
    parser.add_argument("--plot", help="draw the spare pool along each run here (PNG, SVG, ...)")
    add_run_limit(parser, timeout=900.0, per="launch")


# ---------------------------------------------------------------------- the runs
def mode_job(
    job: JobConfig, mode: str, *, spares: int, respawn_limit: int, save_interval: int, save: str
) -> JobConfig:
    """`job` as way `mode` runs it (its faults and `--load` are set per launch)."""
    dp = job.deadpool.replace(fail=[], respawn_limit=0)
    if mode == "restart":
        dp = dp.replace(enabled=False, spares=0)
        train = dataclasses.replace(job.train, save=save, save_interval=save_interval)
    else:
        dp = dp.replace(
            enabled=True, spares=spares, respawn_limit=respawn_limit if mode == "respawn" else 0
        )
        train = dataclasses.replace(job.train, save=save, save_interval=0)
    return dataclasses.replace(job, train=dataclasses.replace(train, load=None), deadpool=dp)


def failure_free(job: JobConfig) -> JobConfig:
    """The reference: `job` with DeadPool off, no failure, no checkpoint."""
    train = dataclasses.replace(job.train, save=None, save_interval=0, load=None)
    dp = job.deadpool.replace(enabled=False, spares=0, fail=[], respawn_limit=0)
    return dataclasses.replace(job, train=train, deadpool=dp)


Launcher = Callable[[JobConfig, Path, bool], Launch]


def run_through(
    job: JobConfig,
    trace: list[str],
    stop_on_failure: bool,
    runner: Launcher,
    work_dir: Path,
    walls: list[float] | None = None,
) -> tuple[list[Launch], float]:
    """`job` through `trace`: launched, and launched again with `--load` and the failures that
    have not struck yet each time a failure of the trace stops it - out of redundancy (exit 3),
    or with DeadPool off any failure (exit 1) - until it completes; its launches and the wall
    time of all of them (each launch's appended to `walls`). Any other end is an error."""
    launches: list[Launch] = []
    faults, load = list(trace), None
    t0 = time.monotonic()
    while len(launches) < MAX_LAUNCHES:
        train = dataclasses.replace(job.train, load=load)
        this = dataclasses.replace(job, train=train, deadpool=job.deadpool.replace(fail=faults))
        started = time.monotonic()
        run = runner(this, work_dir / f"launch-{len(launches)}", stop_on_failure)
        if walls is not None:
            walls.append(time.monotonic() - started)
        launches.append(run)
        if run.returncode == 0:
            return launches, time.monotonic() - t0
        stopped_by = ExitCode.FAILED if not job.deadpool.enabled else ExitCode.OUT_OF_REDUNDANCY
        if run.returncode != stopped_by or not run.fired:
            raise RuntimeError(
                f"launch {len(launches)} ended with exit code {run.returncode}, not stopped by a "
                f"failure of the trace; logs in {run.run_dir}"
            )
        faults = [f for i, f in enumerate(faults) if i not in run.fired]
        load = job.train.save
    raise RuntimeError(f"still not done after {MAX_LAUNCHES} launches; logs in {work_dir}")


# ---------------------------------------------------------------------- accounting (pure)
def account(
    launches: list[Launch],
    wall_s: float,
    *,
    iters: int,
    iter_s: float,
    spares: int,
    reference_digest: str | None,
) -> dict[str, Any]:
    """What one way's launches came to: effective training time ratio, failures survived
    without a restart, restarts, iterations computed again, spares used, the spare pool after each event
    (iteration, spares waiting) and whether the parameters are the failure-free run's."""
    recoveries = [rec for run in launches for rec in run.summary.get("recoveries") or []]
    recomputed = sum(int(rec["recomputed_iterations"]) for rec in recoveries)
    pool: list[tuple[int, int]] = []
    for i, run in enumerate(launches):
        first = min((r["iteration"] for r in run.records), default=1)
        left = spares
        pool.append((first, left))
        for rec in run.summary.get("recoveries") or []:
            left -= len(rec["replaced_by"]) - len(rec.get("respawned") or {})
            pool.append((int(rec["restore_iteration"]) + 1, left))
        if i + 1 < len(launches):  # started again: from the iteration after what it loaded
            reached = max((r["iteration"] for r in run.records), default=0)
            resumed = min((r["iteration"] for r in launches[i + 1].records), default=1) - 1
            recomputed += max(0, reached - resumed)
    respawned = sum(len(rec.get("respawned") or {}) for rec in recoveries)
    used = sum(spares - len(run.summary.get("spares_left") or []) for run in launches)
    final = launches[-1].summary.get("final_param_digest")
    return {
        "wall_s": round(wall_s, 3),
        "ettr": round(iters * iter_s / wall_s, 4),
        "survived_without_restart": len(recoveries),
        "respawned": respawned,
        "restarts": len(launches) - 1,
        "recomputed_iterations": recomputed,
        "spares_used": used,
        "spare_pool": pool,
        "matches_failure_free": final is not None and final == reference_digest,
    }


def table(result: dict[str, Any]) -> list[str]:
    specs = ("<28", ">8", ">6", ">9", ">9", ">11", ">7", ">10")
    header = ["way", "wall s", "ETTR", "survived", "restarts", "recomputed", "spares", "bitwise"]
    lines = [text_row(header, specs)]
    for mode in MODES:
        r = result["modes"][mode]
        cells = [
            LABELS[mode],
            f"{r['wall_s']:.1f}",
            f"{r['ettr']:.2f}",
            str(r["survived_without_restart"]),
            str(r["restarts"]),
            str(r["recomputed_iterations"]),
            str(r["spares_used"]),
            yes_no(r["matches_failure_free"]),
        ]
        lines.append(text_row(cells, specs))
    for mode in MODES:
        r = result["modes"][mode]
        if "model" in r:
            m = r["model"]
            lines.append(
                f"model ({mode}): {m['wall_s']:.1f} s ({r['model_error']:+.1%}), "
                f"{m['restarts']} restart(s), {m['survived_without_restart']} survived, "
                f"{m['lost_iterations']} iteration(s) lost; costs measured in this run: "
                f"iteration {m['costs']['iter_s']:.3f} s, launch {m['costs']['launch_s']:.1f} s,"
                f" crash {m['costs']['crash_s']:.2f} s, node {m['costs']['node_s']:.2f} s"
            )
    c = result["config"]
    lines.append(
        f"ETTR: the failure-free run's {c['iters']} iterations ({result['iter_s']:.3f} s each) "
        "over the wall time through the trace; survived: failures recovered without a restart"
    )
    return lines


# ---------------------------------------------------------------------- the command
def _check(args: argparse.Namespace) -> dict[str, float]:
    check_number(args.iters, "--iters", integer=True, minimum=1)
    check_number(args.spares, "--spares", integer=True, minimum=0)
    check_number(args.respawn_limit, "--respawn-limit", integer=True, minimum=1)
    check_number(args.save_interval, "--save-interval", integer=True, minimum=1)
    return parse_mix(args.mix)


def run(args: argparse.Namespace, runner: Launcher | None = None) -> int:
    job = base_job(args.config)
    try:
        mix = _check(args)
        trace = failure_trace(
            iters=args.iters,
            failures=args.failures,
            mix=mix,
            world_size=job.parallel.world_size,
            ranks_per_node=job.ranks_per_node,
            seed=args.seed,
        )
    except ConfigError as exc:
        print(f"deadpool bench goodput: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    work_dir = Path(tempfile.mkdtemp(prefix="deadpool-bench-goodput-"))
    print(
        f"deadpool bench goodput: {job.parallel.world_size} ranks, {args.iters} iterations, "
        f"{len(trace)} failures ({', '.join(trace) or 'none'}); runs in {work_dir}",
        flush=True,
    )

    def launch_way(j: JobConfig, d: Path, stop: bool) -> Launch:
        """(a) and (b) as a cluster runs them: one `deadpool agent` per simulated node."""
        return launch(j, d, stop, args.timeout, node_agents=j.deadpool.enabled)

    runner = runner or launch_way
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, iters=args.iters))
    try:
        reference = runner(failure_free(job), work_dir / "failure-free", False)
        if reference.returncode != 0:
            raise RuntimeError(f"the failure-free run failed; logs in {reference.run_dir}")
        iter_s = statistics.median(r["iter_time_s"] for r in reference.records)
        modes = {}
        for mode in MODES:
            save = str(work_dir / mode / "ckpt")
            way = mode_job(
                job,
                mode,
                spares=args.spares,
                respawn_limit=args.respawn_limit,
                save_interval=args.save_interval,
                save=save,
            )
            walls: list[float] = []
            launches, wall = run_through(
                way, trace, mode == "restart", runner, work_dir / mode, walls
            )
            modes[mode] = account(
                launches,
                wall,
                iters=args.iters,
                iter_s=iter_s,
                spares=args.spares if mode != "restart" else 0,
                reference_digest=reference.summary.get("final_param_digest"),
            )
            modes[mode]["model"] = predict(
                mode,
                trace,
                measured_costs(launches, walls),
                iters=args.iters,
                save_interval=args.save_interval,
                spares=args.spares,
                ranks_per_node=job.ranks_per_node,
            )
            modes[mode]["model_error"] = round(modes[mode]["model"]["wall_s"] / wall - 1, 4)
            print(f"  {LABELS[mode]}: done in {wall:.1f}s", flush=True)
    except RuntimeError as exc:
        print(f"deadpool bench goodput: {exc}", file=sys.stderr)
        return 1
    result = {
        "config": {
            **job_shape(job),
            "iters": args.iters,
            "spares": args.spares,
            "respawn_limit": args.respawn_limit,
            "save_interval": args.save_interval,
            "seed": args.seed,
            "mix": mix,
        },
        "trace": trace,
        "trace_kinds": [kind_of(s) for s in trace],
        "iter_s": iter_s,
        "modes": modes,
    }
    if args.plot:
        result["plot"] = str(spare_pool(result, args.plot, LABELS))
    publish(table(result), result, args.json_path)
    if not args.keep:
        shutil.rmtree(work_dir, ignore_errors=True)
    if not all(m["matches_failure_free"] for m in modes.values()):
        print("deadpool bench goodput: a way ended with other parameters", file=sys.stderr)
        return 1
    return 0
