"""`deadpool bench`: one sub-subcommand per benchmark module, listed in `BENCHES`.

Adding a benchmark is one line in `BENCHES`. A benchmark module provides either
`configure(parser)` and `run(args) -> int` (like the `deadpool` subcommands), or only
`main(argv) -> int`, which then receives every argument after the benchmark's name as is
(its own `--help` included). A listed module that is not importable shows up in `--help` and
says so when run, instead of breaking the other benchmarks.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType

from ..hotswap.launch.warm_start import WARM_START_ENV, warm_start_shared

# name -> (module, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "overhead": (
        "megatron_deadpool.bench.overhead",
        "per-iteration time with DeadPool off vs on (interleaved runs, medians)",
    ),
    "pack": (
        "megatron_deadpool.bench.pack_bench",
        "pack + checksum throughput of snapshot buffers",
    ),
    "recovery": (
        "megatron_deadpool.bench.recovery",
        "hot swap vs restart from a persistent checkpoint: recovery time by phase",
    ),
    "goodput": (
        "megatron_deadpool.bench.goodput",
        "a run through a failure trace: in-place respawn vs spares only vs checkpoint restarts",
    ),
    "paper": ("megatron_deadpool.bench.reproduce.paper", "the paper's figures and tables"),
    "start": (
        "megatron_deadpool.bench.start",
        "a new worker's start: forked from a warm fork server vs a fresh interpreter",
    ),
    "control-plane": (
        "megatron_deadpool.bench.scale.control_plane",
        "the coordinator and store protocol against 1,024-16,384 simulated ranks",
    ),
    "plan-wake": (
        "megatron_deadpool.bench.scale.plan_wake",
        "a plan's wake-up of every survivor's plan waiter at 1,024-16,384 ranks",
    ),
    "store-state": (
        "megatron_deadpool.bench.scale.store_state",
        "the coordinator's store over 100,000 iterations: keys and memory, kept vs pruned",
    ),
    "planning": (
        "megatron_deadpool.bench.planning",
        "replica placement and a standby's rebuild at 16,384 ranks (pure, one core)",
    ),
}


def _load(module_name: str) -> ModuleType | str:
    """The module, or why it cannot be imported (only when the module itself is missing)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return f"{module_name} is not available in this installation"
        raise


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(parser))
    for name, (module_name, help_text) in BENCHES.items():
        module = _load(module_name)
        if isinstance(module, str):
            p = sub.add_parser(name, help=f"{help_text} [unavailable]", description=help_text)
            p.set_defaults(_bench_run=_unavailable(name, module))
        elif hasattr(module, "configure") and hasattr(module, "run"):
            p = sub.add_parser(name, help=help_text, description=help_text)
            module.configure(p)
            p.set_defaults(_bench_run=module.run)
        elif hasattr(module, "main"):
            # No options of ours: everything after the name goes to the module's own parser.
            p = sub.add_parser(
                name, help=help_text, description=help_text, prefix_chars="\0", add_help=False
            )
            p.add_argument("bench_argv", nargs=argparse.REMAINDER)
            p.set_defaults(_bench_run=lambda args, main=module.main: main(args.bench_argv))
        else:
            raise TypeError(f"{module_name} provides neither configure/run nor main")


def _unavailable(name: str, why: str):
    def run(args: argparse.Namespace) -> int:
        print(f"deadpool bench {name}: {why}", file=sys.stderr)
        return 2

    return run


def run(args: argparse.Namespace) -> int:
    if warm_start_shared():
        # A bench measures what a user's launcher does: each job imports in fork servers of its
        # own (kept ones would make every job after the first start seconds sooner).
        os.environ[WARM_START_ENV] = "1"
    bench_run = getattr(args, "_bench_run", None)
    if bench_run is None:
        names = ", ".join(BENCHES)
        print(
            f"deadpool bench: name a benchmark: {names} (see deadpool bench --help)",
            file=sys.stderr,
        )
        return 2
    return int(bench_run(args) or 0)
