"""`deadpool bench paper`: the paper's experiment matrix at the scale this machine has.

Two claims, measured on one job (the CPU demo unless --config names another):

1. **Failure-free cost of fault tolerance.** The same job runs in each configuration, all
   configurations once per repeat, interleaved (so drift in the machine's load hits all alike):

   - `no_ft`        no fault tolerance (DeadPool off, no checkpoint);
   - `deadpool`     DeadPool on (per-iteration replication of optimizer shards, spares waiting);
   - `ckpt_1`       Megatron persistent checkpoint (torch_dist) after every iteration;
   - `ckpt_n`       the same every N iterations (`--interval`);
   - `async_1`      megatron-core `dist_checkpointing` asynchronous save after every iteration;
   - `nvrx_local_1` nvidia-resiliency-ext local checkpoint with replication after every
                    iteration (Megatron-LM's `--non-persistent-ckpt-type local --replication`).

   The figure per run is the amortised time per iteration: the mean gap between consecutive
   iteration ends over a window that starts after the first save (its one-time start-up, e.g.
   the checkpoint writer's helper process, is reported apart), so every save in the window is
   counted. The median over repeats is reported, with the ratio to `no_ft`. Every
   configuration must give the same losses as `no_ft`.

   `async_1` and `nvrx_local_1` are not in `checkpoint.py`: their workers run with
   `Runtime._save` replaced (see `_worker_main`), the way Megatron-LM calls these APIs. The
   nvidia-resiliency-ext workers run under an interpreter that has the package
   (`--nvrx-python`); without one, the table says why the row is empty.

2. **Recovery.** `bench recovery`'s hot swap and restart-from-checkpoint (every N iterations),
   timed by phase; the failure-free reference is the first `no_ft` run.

Writes (through `plots.py`) OUT/results.md, OUT/iteration_time.png, OUT/recovery_timeline.png, OUT/loss_curve.png
and OUT/results.json (or --json PATH):

    deadpool bench paper --quick --out paper-results
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..faults import parse_fault
from ..jobspec import JobConfig
from . import plots
from . import recovery as rec
from .overhead import base_job
from .report import job_shape, write_json


@dataclasses.dataclass(frozen=True)
class Mode:
    key: str
    label: str
    deadpool: bool = False
    interval: str = ""  # "", "1" or "n"
    worker: str = ""  # "", "async" or "nvrx-local"
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

QUICK = {"iters": 13, "interval": 4, "repeats": 1, "recovery_repeats": 1}
DEFAULT = {"iters": 26, "interval": 5, "repeats": 3, "recovery_repeats": 2}

Runner = Callable[[JobConfig, Path, bool, str], rec.Launch]
"""(job, run_dir, stop_on_failure, worker) -> Launch; worker is a Mode.worker."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML job config (default: configs/cpu-demo.yaml)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"small matrix: {QUICK['iters']} iterations, every-N = {QUICK['interval']}, "
        "1 repeat (a few minutes on an idle CPU machine)",
    )
    parser.add_argument("--out", default="deadpool-paper", help="output directory")
    parser.add_argument("--json", dest="json_path", help="also write all figures here")
    parser.add_argument("--iters", type=int, help="iterations per run")
    parser.add_argument("--interval", type=int, help="N of 'checkpoint every N'")
    parser.add_argument("--repeats", type=int, help="interleaved repeats of the matrix")
    parser.add_argument("--recovery-repeats", type=int, help="repeats of the recovery pair")
    parser.add_argument("--fail", default="2@8", help="the failure for recovery (default 2@8)")
    parser.add_argument(
        "--modes",
        default=",".join(MODE_KEYS),
        help=f"failure-free configurations, comma-separated (default all: {','.join(MODE_KEYS)})",
    )
    parser.add_argument("--no-recovery", action="store_true", help="failure-free part only")
    parser.add_argument(
        "--nvrx-python",
        help="interpreter with nvidia-resiliency-ext for nvrx_local_1 (default: this one if "
        "it has the package, else $DEADPOOL_NVRX_PYTHON)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="limit of one run in s")
    parser.add_argument("--keep", action="store_true", help="keep run logs and checkpoints")


# ---------------------------------------------------------------------- settings
def settings(args: argparse.Namespace) -> dict[str, Any]:
    """Counts from --quick/defaults and explicit flags; validated."""
    base = QUICK if args.quick else DEFAULT
    s = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODE_KEYS))
    if unknown:
        raise ConfigError(
            f"modes: unknown {', '.join(unknown)}; choose from {', '.join(MODE_KEYS)}"
        )
    if "no_ft" not in modes:
        modes.insert(0, "no_ft")  # the baseline of every ratio
    s["modes"] = [k for k in MODE_KEYS if k in modes]
    if s["interval"] < 2:
        raise ConfigError(f"interval: 'every N' needs N >= 2, got {s['interval']}")
    if s["repeats"] < 1 or s["recovery_repeats"] < 1:
        raise ConfigError("repeats: must be >= 1")
    s["warmup"] = s["interval"] + 1  # the first every-N save's start-up stays out of the window
    if s["iters"] < s["warmup"] + 2:
        raise ConfigError(f"iters ({s['iters']}) must be >= interval + 3 to leave a timed window")
    s["fail"] = args.fail
    s["recovery"] = not args.no_recovery
    s["keep"] = args.keep
    return s


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


# ---------------------------------------------------------------------- nvidia-resiliency-ext
def nvrx_python(explicit: str | None) -> tuple[str | None, str]:
    """(interpreter, why not) for the nvidia-resiliency-ext workers."""
    if explicit:
        return explicit, ""
    if importlib.util.find_spec("nvidia_resiliency_ext") is not None:
        return sys.executable, ""
    env = os.environ.get("DEADPOOL_NVRX_PYTHON")
    if env:
        return env, ""
    return None, (
        "nvidia-resiliency-ext is not installed for this interpreter; install it (0.4.1 is "
        "the newest for Python 3.11) or pass --nvrx-python"
    )


def probe_nvrx(python: str, job: JobConfig) -> str:
    """'' when `python` can run the local-checkpoint worker for `job`, else why not."""
    world, jump = job.parallel.world_size, job.ranks_per_node
    if world % (2 * jump):
        return (
            f"replication factor 2 with jump {jump} (ranks per node) needs a world size "
            f"divisible by {2 * jump}, this job has {world}"
        )
    code = (
        "import nvidia_resiliency_ext as n, megatron.core.dist_checkpointing."
        "tensor_aware_state_dict as t, megatron_deadpool.runtime; assert t.HAVE_NVRX; "
        "from importlib.metadata import version; print(version('nvidia-resiliency-ext'))"
    )
    try:
        out = subprocess.run(
            [python, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            env=_worker_env(),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {exc}"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return f"{python} cannot import it: {last[:200]}"
    return ""


def _worker_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""))


# ---------------------------------------------------------------------- launching
def launch(
    job: JobConfig, run_dir: Path, stop: bool, worker: str, *, timeout_s: float, python: str
) -> rec.Launch:
    """`bench recovery`'s timed launch; a `worker` kind runs its processes through `_worker_main`."""
    if not worker:
        return rec.launch(job, run_dir, stop, timeout_s)
    from ..launch import LocalLauncher

    class WorkerLauncher(LocalLauncher):
        """Starts `python -m megatron_deadpool.bench.paper --worker KIND` instead of the worker."""

        def _spawn(self, pid: str, config_path: Path, address: str) -> None:
            env = _worker_env()
            env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
            with open(self.run_dir / f"{pid}.log", "w") as log:
                cmd = [
                    python,
                    "-m",
                    "megatron_deadpool.bench.paper",
                    "--worker",
                    worker,
                    "--config",
                    str(config_path),
                    "--pid",
                    pid,
                    "--deadpool-coordinator",
                    address,
                    "--deadpool-job-token",
                    self.token,
                ]
                self.procs[pid] = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )

    return rec.launch(job, run_dir, stop, timeout_s, WorkerLauncher)


# ---------------------------------------------------------------------- failure-free
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
) -> dict[str, Any]:
    modes = {m.key: m for m in MODES if m.key in s["modes"]}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in modes}
    launches: dict[str, list[rec.Launch]] = {k: [] for k in modes}
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
                    f"{mode.label}: run failed (exit {result.returncode}); logs " f"in {run_dir}"
                )
            fig = run_figures(result.records, s["warmup"], job.train.save_interval)
            fig.update(
                repeat=rep,
                losses=[r["loss"] for r in result.records],
                digest=result.summary.get("final_param_digest"),
                wall_s=result.summary.get("wall_s"),
            )
            runs[key].append(fig)
            launches[key].append(result)
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
    return {"modes": out, "reference_launch": (launches.get("no_ft") or [None])[0]}


# ---------------------------------------------------------------------- recovery
def recovery_part(
    job: JobConfig,
    s: dict[str, Any],
    runner: Runner,
    work_dir: Path,
    reference: rec.Launch | None,
    progress: Callable[[str], None],
) -> tuple[dict[str, Any], rec.Launch | None, rec.Launch | None]:
    """bench recovery's measure, `recovery_repeats` times; medians of totals and phases.

    Returns the result, the reference run and the first hot-swap run (for the loss curve).
    """
    jobs = matrix_jobs(job, s)
    seen: dict[str, rec.Launch] = {}

    def run_one(variant: JobConfig, run_dir: Path, stop: bool) -> rec.Launch:
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
    out = dict(results[0])
    for side in ("deadpool", "restart"):
        out[f"{side}_recovery_s"] = _median([r[f"{side}_recovery_s"] for r in results])
        out[f"{side}_recovery_runs_s"] = [r[f"{side}_recovery_s"] for r in results]
        out[f"{side}_phases_s"] = {
            k: _median([r[f"{side}_phases_s"][k] for r in results])
            for k in results[0][f"{side}_phases_s"]
        }
    out["speedup"] = out["restart_recovery_s"] / out["deadpool_recovery_s"]
    for flag in ("deadpool_matches_reference", "restart_matches_reference"):
        out[flag] = all(r[flag] for r in results)
    out["repeats"] = len(results)
    out["phase_labels"] = dict(rec.PHASE_LABELS)
    return out, seen.get("reference"), seen.get("deadpool")


def loss_data(reference: rec.Launch, hot: rec.Launch, result: dict[str, Any], fail: str) -> dict:
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


def _machine() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{load:.1f} at the start, Python {platform.python_version()}"
    )


def run(args: argparse.Namespace, runner: Runner | None = None) -> int:
    try:
        s = settings(args)
        job = base_job(args.config)
        jobs = matrix_jobs(job, s)
    except ConfigError as exc:
        print(f"deadpool bench paper: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="deadpool-bench-paper-"))
    t_start = time.monotonic()
    unavailable: dict[str, str] = {}
    python, why = nvrx_python(args.nvrx_python)
    if "nvrx_local_1" in s["modes"]:
        why = why or probe_nvrx(python or "", jobs["reference"])
        if why:
            unavailable["nvrx_local_1"] = why
    p = job.parallel
    print(
        f"deadpool bench paper: tp={p.tp} pp={p.pp} dp={p.dp}, {s['iters']} iterations per "
        f"run, N = {s['interval']}, {s['repeats']} repeat(s), configurations "
        f"{', '.join(s['modes'])}; runs in {work_dir}",
        flush=True,
    )
    machine = _machine()
    launch_fn = runner or (
        lambda j, d, stop, worker: launch(
            j,
            d,
            stop,
            worker,
            timeout_s=args.timeout,
            python=python if worker == "nvrx-local" else sys.executable,
        )
    )

    def progress(line: str) -> None:
        print(line, flush=True)

    result: dict[str, Any] = {"settings": {k: v for k, v in s.items()}, "machine": machine}
    result["command"] = _command()
    try:
        ff = failure_free(jobs, s, launch_fn, work_dir, unavailable, progress)
        reference = ff.pop("reference_launch")
        ff["notes"] = _notes(s) + _noise(ff["modes"], s)
        result["failure_free"] = ff
        if s["recovery"]:
            r, ref_launch, hot = recovery_part(job, s, launch_fn, work_dir, reference, progress)
            result["recovery"] = r
            if ref_launch is not None and hot is not None:
                result["loss"] = loss_data(ref_launch, hot, r, s["fail"])
    except (RuntimeError, ConfigError) as exc:
        print(f"deadpool bench paper: {exc}", file=sys.stderr)
        return 1
    hot_job = jobs["deadpool"]
    result["config"] = {
        **job_shape(hot_job),
        "world": p.world_size,
        "spares": hot_job.deadpool.spares,
    }
    result["wall_s"] = time.monotonic() - t_start
    plots.draw(result, out)
    (out / "results.md").write_text(plots.markdown(result))
    write_json(out / "results.json", result)
    if args.json_path:
        write_json(args.json_path, result)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.md'}, {', '.join(result['figures'])}, results.json")
    if not args.keep:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 0 if _consistent(result) else 1


def _command() -> str:
    """The command line as typed, when it was `deadpool bench paper ...`."""
    argv = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv else []
    if argv[:3] == ["deadpool", "bench", "paper"]:
        return " ".join(argv)
    return "deadpool bench paper (called from Python)"


def _noise(modes: dict[str, Any], s: dict[str, Any]) -> list[str]:
    """How much the machine moved the baseline: the no-FT run's gaps, first repeat."""
    runs = modes.get("no_ft", {}).get("runs") or []
    if not runs or not runs[0]["gaps_s"]:
        return []
    gaps = runs[0]["gaps_s"]
    line = (
        f"noise: the no-FT run's per-iteration gaps ranged {min(gaps):.3f}-{max(gaps):.3f} s "
        f"(median {statistics.median(gaps):.3f} s)"
    )
    if s["repeats"] == 1:
        line += (
            "; with one repeat a ratio carries that noise: run without --quick (3 interleaved "
            "repeats) for figures to quote"
        )
    return [line]


def _notes(s: dict[str, Any]) -> list[str]:
    return [
        (
            "async: megatron-core `dist_checkpointing.save(..., async_sharded_save=True)` with its "
            "`AsyncCallsQueue` (forked writer, as Megatron-LM's `--async-save` without the "
            "persistent worker); one save in flight: the next save first waits for the previous "
            "one. Not in checkpoint.py yet: the bench's worker replaces `Runtime._save`."
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


def _consistent(result: dict[str, Any]) -> bool:
    """False when a configuration changed training or a recovery did not reproduce it."""
    ok = all(
        m.get("amortised_s") is None or (m["losses_match_no_ft"] and m["digests_match_no_ft"])
        for m in result["failure_free"]["modes"].values()
    )
    r = result.get("recovery")
    if r:
        ok = ok and r["deadpool_matches_reference"] and r["restart_matches_reference"]
    if not ok:
        print(
            "deadpool bench paper: a configuration or a recovery changed training", file=sys.stderr
        )
    return ok


# ---------------------------------------------------------------------- worker side
def _save_async(runtime: Any, iteration: int) -> None:
    """Megatron-LM's `--async-save` for torch_dist: schedule, finalize before the next one."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from .. import checkpoint as ck

    queue = _WORKER.setdefault("queue", AsyncCallsQueue(persistent=False))
    queue.maybe_finalize_async_calls(blocking=True)  # at most one save in flight
    root = runtime.job.train.save
    path = ck.iteration_dir(root, iteration)
    path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    metadata = ck._metadata()
    state = ck._state_dict(runtime.objs, metadata=metadata, is_loading=False, iteration=iteration)
    request = dist_checkpointing.save(
        state,
        str(path),
        get_default_save_sharded_strategy(ck.CKPT_FORMAT),
        content_metadata=ck._serialisable(metadata),
        async_sharded_save=True,
    )

    def marker() -> None:  # runs after megatron's own finalize (metadata + barrier)
        if dist.get_rank() == 0:
            tracker = Path(root) / ck.TRACKER
            tmp = tracker.with_name(ck.TRACKER + ".tmp")
            tmp.write_text(f"{iteration}\n")
            os.replace(tmp, tracker)

    request.add_finalize_fn(marker)
    queue.schedule_async_request(request)


def _save_nvrx_local(runtime: Any, iteration: int) -> None:
    """Megatron-LM's `--non-persistent-ckpt-type local --replication` save path."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
        LazyCliqueReplicationStrategy,
    )

    from .. import checkpoint as ck

    if "manager" not in _WORKER:
        strategy = LazyCliqueReplicationStrategy(runtime.job.ranks_per_node, 2)
        _WORKER["manager"] = LocalCheckpointManager(runtime.job.train.save, repl_strategy=strategy)
    metadata = ck._metadata()
    state = ck._state_dict(runtime.objs, metadata=metadata, is_loading=False, iteration=iteration)
    tasd, cache = MCoreTensorAwareStateDict.from_state_dict(
        state,
        algo="fully_parallel",
        parallelization_group=ps.get_data_parallel_group(with_context_parallel=True),
        cached_metadata=_WORKER.get("cache"),
    )
    _WORKER["cache"] = cache
    _WORKER["manager"].save(tasd, iteration, is_async=False)


_WORKER: dict[str, Any] = {}


def _worker_main(argv: list[str]) -> int:
    """`python -m megatron_deadpool.bench.paper --worker KIND ARGS`: a worker whose saves are
    KIND (async, nvrx-local) instead of checkpoint.save; ARGS as for megatron_deadpool.worker."""
    from .. import runtime, worker

    kind, rest = argv[1], argv[2:]
    save = {"async": _save_async, "nvrx-local": _save_nvrx_local}[kind]
    finish = runtime.Runtime._finish

    def finish_pending(self: Any) -> None:
        queue = _WORKER.get("queue")
        if queue is not None:  # every async save complete before the groups go away
            queue.maybe_finalize_async_calls(blocking=True)
            queue.close()
        finish(self)

    runtime.Runtime._save = save
    runtime.Runtime._finish = finish_pending
    return worker.main(rest)


if __name__ == "__main__":  # a guard: spawned helpers re-import this module as __mp_main__
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[1:]))
    sys.exit("usage: python -m megatron_deadpool.bench.paper --worker async|nvrx-local ARGS")
