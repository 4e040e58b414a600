"""`deadpool selftest`: check this machine's DeadPool set-up, one pass/fail row per check.

    deadpool selftest --nproc N [--spares S] [--json FILE] [--timeout SECONDS]

On one node: communication settings, replication on N ranks, a SIGKILLed and a SIGSTOPped
peer replaced by a spare (bitwise equal to the failure-free run), and on CUDA the replica
memory and the pack kernel (`selftest.suite`). Exit code 0 when every check that ran passed,
1 when one failed, 2 for bad input.
"""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, required=True, help="active ranks (>= 2)")
    parser.add_argument(
        "--spares", type=int, default=1, help="spare processes of the hot-swap runs (default 1)"
    )
    parser.add_argument("--json", dest="json_path", metavar="FILE", help="write the report here")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="wall-clock limit of all checks in seconds (default 600)",
    )
    parser.add_argument("--run-dir", help="directory for the runs' logs (default: a temp dir)")


def run(args: argparse.Namespace) -> int:
    from ..selftest.suite import Options, Suite

    options = Options(
        nproc=args.nproc,
        spares=args.spares,
        timeout_s=args.timeout,
        json_path=args.json_path,
        run_dir=args.run_dir,
    )
    return Suite(options).run()
