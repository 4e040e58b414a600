"""`deadpool bench paper`: the paper's experiment matrix at the scale this machine has.

Two claims, measured on one job (the CPU demo unless --config names another):

1. **Failure-free cost of fault tolerance** (`paper_matrix.py`): the same job in each
   configuration, interleaved over repeats:

   - `no_ft`        no fault tolerance (DeadPool off, no checkpoint);
   - `deadpool`     DeadPool on (per-iteration replication of optimizer shards, spares waiting);
   - `ckpt_1`       Megatron persistent checkpoint (torch_dist) after every iteration;
   - `ckpt_n`       the same every N iterations (`--interval`);
   - `async_1`      megatron-core `dist_checkpointing` asynchronous save after every iteration;
   - `nvrx_local_1` nvidia-resiliency-ext local checkpoint with replication after every
                    iteration (Megatron-LM's `--non-persistent-ckpt-type local --replication`).

   `async_1` and `nvrx_local_1` are not in `checkpoint.py`: their workers run with
   a saver of their own (`paper_workers.py`). The nvidia-resiliency-ext workers run under an
   interpreter that has the package (`--nvrx-python`); without one, the table says why the row
   is empty.

2. **Recovery** (`paper_recovery.py`): `bench recovery`'s hot swap and restart-from-checkpoint
   (every N iterations), timed by phase; the failure-free reference is the first `no_ft` run.

This module reads the command line, runs both parts and writes (through `plots.py`)
OUT/results.md, OUT/iteration_time.png, OUT/recovery_timeline.png, OUT/loss_curve.png and
OUT/results.json (or --json PATH):

    deadpool bench paper --quick --out paper-results
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ...config.numbers import number_arg
from ...errors import ConfigError
from .. import plots
from ..job_options import CONFIG_HELP, add_run_limit, base_job
from ..report import job_shape, write_json
from .paper_matrix import MODE_KEYS, failure_free, matrix_jobs
from .paper_recovery import loss_data, recovery_part
from .paper_workers import Runner, launch, nvrx_python, probe_nvrx

QUICK = {"iters": 13, "interval": 4, "repeats": 1, "recovery_repeats": 1}
DEFAULT = {"iters": 26, "interval": 5, "repeats": 6, "recovery_repeats": 6}
"""6 repeats: the fewest for which a ratio's median has a 95% interval (`stats.min_repeats`)."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help=CONFIG_HELP)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"small matrix: {QUICK['iters']} iterations, every-N = {QUICK['interval']}, "
        "1 repeat (a few minutes on an idle CPU machine; a smoke test: one repeat measures no "
        "ratio)",
    )
    parser.add_argument("--out", default="deadpool-paper", help="output directory")
    parser.add_argument("--json", dest="json_path", help="also write all figures here")
    parser.add_argument(
        "--iters", type=number_arg(integer=True, minimum=1), help="iterations per run"
    )
    parser.add_argument(
        "--interval", type=number_arg(integer=True, minimum=1), help="N of 'checkpoint every N'"
    )
    parser.add_argument(
        "--repeats",
        type=number_arg(integer=True, minimum=1),
        help="interleaved repeats of the matrix",
    )
    parser.add_argument(
        "--recovery-repeats",
        type=number_arg(integer=True, minimum=1),
        help="repeats of the recovery pair",
    )
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
    add_run_limit(parser, timeout=600.0)


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
            python=python if worker == "nvrx-local" and python else sys.executable,
        )
    )

    def progress(line: str) -> None:
        print(line, flush=True)

    result: dict[str, Any] = {"settings": {k: v for k, v in s.items()}, "machine": machine}
    result["command"] = _command()
    try:
        ff, reference = failure_free(jobs, s, launch_fn, work_dir, unavailable, progress)
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
