"""The `deadpool` command: one subcommand per module, loaded lazily.

Each subcommand module provides `configure(parser)` (adds its flags) and `run(args) -> int`.
Bad input anywhere (`ConfigError`, i.e. a `ValueError` subclass from our validation) becomes
one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

from ..errors import ConfigError, ExitCode
from .needs import missing_requirement
from .version import VersionAction

# name -> (module, one-line help); `bench` has its own sub-subcommands.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megatron_deadpool.cli.train", "train the embedded GPT job with actives + spares"),
    "bench": ("megatron_deadpool.cli.bench", "benchmarks: overhead, recovery, pack, paper"),
    "plan": ("megatron_deadpool.cli.plan", "capacity planner: memory, traffic, recovery, coverage"),
    "chaos": (
        "megatron_deadpool.cli.chaos",
        "soak: the CPU demo under random kills, hangs and node failures, checked bitwise",
    ),
    "megatron-lm": (
        "megatron_deadpool.cli.megatron_lm",
        "run a Megatron-LM training script on this machine with spares and hot swap",
    ),
    "selftest": (
        "megatron_deadpool.cli.selftest",
        "check this machine: settings, replication, a killed and a frozen peer replaced",
    ),
    "coordinator": (
        "megatron_deadpool.cli.coordinator",
        "run the coordinator (store host, heartbeat monitor, spare assignment) on a cluster",
    ),
    "agent": (
        "megatron_deadpool.cli.agent",
        "run one node's agent on a cluster: start its processes, respawn them in place",
    ),
    "slurm-script": (
        "megatron_deadpool.cli.slurm_script",
        "print a site's sbatch script (perlmutter, vista): deadpool slurm-script SITE > job.sbatch",
    ),
    "files": (
        "megatron_deadpool.cli.files",
        "list, print or copy the Slurm scripts, job configs and Megatron-LM patches",
    ),
    "report": (
        "megatron_deadpool.cli.report",
        "a run's timeline: failures, recoveries and their phases, spares (table and PNG)",
    ),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(ExitCode.BAD_INPUT, f"{self.prog}: error: {message}\n")


def build_parser(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, ModuleType | None]:
    parser = _Parser(prog="deadpool", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, (mod_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            module = importlib.import_module(mod_name)
            module.configure(p)
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    # megatron-core warns at import that TE/apex are absent: expected without a GPU.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, module = build_parser(argv)
    try:
        args = parser.parse_args(argv)
        if module is None:
            parser.print_help()
            return ExitCode.BAD_INPUT
        if (missing := missing_requirement(args.command)) is not None:
            raise ConfigError(missing)
        return int(module.run(args) or 0)
    except ConfigError as exc:
        print(f"deadpool: error: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except KeyboardInterrupt:
        print("deadpool: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
