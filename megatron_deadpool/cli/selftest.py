"""`deadpool selftest`: check this machine's DeadPool set-up, one pass/fail row per check.

    deadpool selftest --nproc N [--spares S] [--json FILE] [--timeout SECONDS] [--run-dir D]
    deadpool selftest --slurm [--nproc-per-node G] [--spare-nodes S] [--json FILE] ...

On one node: communication settings, replication on N ranks, a SIGKILLed and a SIGSTOPped
peer replaced by a spare (bitwise equal to the failure-free run), and on CUDA the replica
memory and the pack kernel (`selftest.suite`). With `--slurm`, inside an allocation, the runs
span its nodes instead: one `srun` task per GPU, the last node(s) spare (`selftest.slurm`).
Exit code 0 when every check that ran passed, 1 when one failed, 2 for bad input, 10 when
nothing failed but no cross-rank check ran (`--nproc 1`: the verdict says INCOMPLETE and names
them; `selftest.table.EXIT_INCOMPLETE`). On CUDA, a GPU that packs replicas with the torch
fallback instead of the fused kernel fails the pack-kernel row, naming the fix.
"""

from __future__ import annotations

import argparse

from ..config.numbers import number_arg


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc",
        type=number_arg(integer=True, minimum=1),
        help="active ranks on this machine (>= 2 for the training checks)",
    )
    parser.add_argument(
        "--spares",
        "--spare-ranks",
        type=number_arg(integer=True, minimum=0),
        default=1,
        help="spare ranks (processes) of the hot-swap runs (default 1)",
    )
    slurm = parser.add_argument_group("across the nodes of a Slurm allocation")
    slurm.add_argument(
        "--slurm",
        action="store_true",
        help="run every check's ranks as srun tasks over the allocation's nodes",
    )
    slurm.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        type=number_arg(integer=True, minimum=1),
        help="tasks (= GPUs) per node (default: SLURM_NTASKS_PER_NODE, else 1)",
    )
    slurm.add_argument(
        "--spare-nodes",
        type=number_arg(integer=True, minimum=0),
        default=1,
        help="the last nodes, spares (default 1)",
    )
    parser.add_argument("--json", dest="json_path", metavar="FILE", help="write the report here")
    parser.add_argument(
        "--timeout",
        type=number_arg(above=0, unit="seconds"),
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
        slurm=args.slurm,
        nproc_per_node=args.nproc_per_node,
        spare_nodes=args.spare_nodes,
    )
    return Suite(options).run()
