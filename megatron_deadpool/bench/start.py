"""Benchmark of a new worker's start: forked from a warm fork server against a fresh interpreter.

What is timed is what a job waits for when it starts a process (a rank, a spare, a replacement):
from the launcher's request to the first line of the worker's own code, i.e. once the worker's
imports are done (`python -c "import MODULES; print(time.time())"`, MODULES being what the
embedded job's worker imports, `embedded.launch.WORKER_PRELOAD`). Two cases, each repeated and
interleaved (cold, warm, cold, ...) so that load from elsewhere hits both alike:

* ``one``: a single process started alone (a spare added later, a replacement);
* ``job``: ``--nproc`` processes started together, until the last one runs (a job's start: on
  2 cores, fresh interpreters share the cores while importing).

The fork server is started once before the repeats (its own start, reported apart, is what the
first process of a job waits for in addition). The medians with a 95% interval (`stats`) are
printed, and with ``--json FILE`` written. Used as ``deadpool bench start``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..config.numbers import number_arg
from ..embedded.launch import WORKER_PRELOAD
from ..hotswap.launch.warm_start import WarmStart
from .report import write_json
from .stats import median_ci

_CODE = "import time; {imports}; print(repr(time.time()), flush=True)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--repeats",
        type=number_arg(integer=True, minimum=1),
        default=6,
        help="pairs of starts (default 6)",
    )
    parser.add_argument(
        "--nproc",
        type=number_arg(integer=True, minimum=2),
        default=5,
        help="processes of the `job` case (default 5: 4 + spare)",
    )
    parser.add_argument("--json", help="write the figures to this file")


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")


def _argv() -> list[str]:
    imports = "; ".join(f"import {name}" for name in WORKER_PRELOAD.modules)
    return [sys.executable, "-c", _CODE.format(imports=imports)]


def _start_all(starter: WarmStart, n: int, warm: bool) -> float:
    """Seconds from the request of `n` processes to the last one's first line."""
    env = _env()
    t0 = time.time()
    procs = [
        starter.start(_argv(), env, subprocess.PIPE, preload=WORKER_PRELOAD if warm else None)
        for _ in range(n)
    ]
    try:
        firsts = [float(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
    finally:
        for p in procs:
            p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a worker failed: {[p.returncode for p in procs]}")
    return max(firsts) - t0


def _summary(values: Sequence[float]) -> dict[str, Any]:
    ci = median_ci(values)
    return {
        "median_s": statistics.median(values),
        "ci95_s": list(ci) if ci else None,
        "min_s": min(values),
        "max_s": max(values),
        "samples_s": list(values),
    }


def measure(repeats: int, nproc: int) -> dict[str, Any]:
    """Every figure of the benchmark (see the module docstring)."""
    lines: list[str] = []
    starter = WarmStart(log=lines.append, enabled=True)
    try:
        t0 = time.monotonic()
        _start_all(starter, 1, warm=True)  # starts the server
        server_s = time.monotonic() - t0
        if lines:
            raise RuntimeError(f"warm start unavailable here: {lines[0]}")
        server = starter.servers[WORKER_PRELOAD]
        out: dict[str, Any] = {
            "server_start_s": server_s,
            "server_import_s": server.import_s if server else None,
            "nproc": nproc,
            "repeats": repeats,
        }
        for case, n in (("one", 1), ("job", nproc)):
            cold, warm = [], []
            for _ in range(repeats):
                cold.append(_start_all(starter, n, warm=False))
                warm.append(_start_all(starter, n, warm=True))
            out[case] = {"cold": _summary(cold), "warm": _summary(warm)}
            out[case]["speedup_median"] = statistics.median(cold) / statistics.median(warm)
    finally:
        starter.close()
    return out


def _row(name: str, figures: dict[str, Any]) -> str:
    ci = figures["ci95_s"]
    interval = f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "(too few repeats)"
    return f"  {name:<5} median {figures['median_s']:8.3f} s  95% CI {interval}"


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.nproc < 1:
        print("deadpool bench start: --repeats and --nproc must be >= 1", file=sys.stderr)
        return 2
    print(
        f"deadpool bench start: request -> first line of the worker's own code, "
        f"{args.repeats} x (cold, warm); job case: {args.nproc} processes at once",
        flush=True,
    )
    result = measure(args.repeats, args.nproc)
    print(
        f"fork server: ready {result['server_start_s']:.2f} s after its request "
        f"(imports {result['server_import_s']:.2f} s)"
    )
    for case, label in (("one", "one process"), ("job", f"{args.nproc} processes at once")):
        print(f"{label}:")
        print(_row("cold", result[case]["cold"]))
        print(_row("warm", result[case]["warm"]))
        print(f"  speedup (median cold / median warm): {result[case]['speedup_median']:.1f}x")
    if args.json:
        write_json(args.json, result)
    return 0
