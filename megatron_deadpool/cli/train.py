"""`deadpool train`: the embedded default job (megatron-core GPT on mock data) on this machine.

Flags: the job's layout and schedule, plus every `--deadpool-*` flag generated from
`DeadpoolConfig`. A `--config` YAML provides defaults; flags given on the command line win.
"""

from __future__ import annotations

import argparse

from ..config.job import JobConfig
from ..config.job_args import add_job_flags, job_from_args
from ..config.numbers import number_arg
from ..config.paths import check_writable_dir, check_writable_file


def configure(parser: argparse.ArgumentParser) -> None:
    add_job_flags(parser)
    parser.add_argument("--json-log", help="write one JSON object per iteration, then a summary")
    parser.add_argument("--run-dir", help="directory for per-process logs (default: a temp dir)")
    parser.add_argument(
        "--timeout",
        type=number_arg(above=0, unit="seconds"),
        default=900.0,
        help="wall-clock limit (s)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument(
        "--node-agents",
        action="store_true",
        help="one `deadpool agent` per simulated node starts and respawns its processes, as on "
        "a cluster (default: this launcher is every node's agent)",
    )


def run(args: argparse.Namespace) -> int:
    import os

    from ..config.faults import check_faults, parse_fault
    from ..config.torchrun import refuse_torchrun

    refuse_torchrun(os.environ, "train")
    job = job_from_args(args)
    check_faults(
        [parse_fault(s) for s in job.deadpool.fail],
        job.parallel.world_size,
        job.ranks_per_node,
        job.train.iters,
        job.deadpool.spares,
    )
    check_paths(job, args)
    from ..devices import gloo

    gloo.check_settings()  # what every process would refuse, refused once here
    # Imports megatron-core: only once the input is valid.
    from ..embedded.launch import LocalLauncher

    result = LocalLauncher(
        job,
        json_log=args.json_log,
        run_dir=args.run_dir,
        timeout_s=args.timeout,
        quiet=args.quiet,
        node_agents=args.node_agents,
    ).run()
    return result.returncode


def check_paths(job: JobConfig, args: argparse.Namespace) -> None:
    """Every directory and file the run will write or read, refused before any process
    starts (`config.paths`, `replication.save_dir.check_load`)."""
    from ..replication.save_dir import check_load

    for path, flag in ((args.run_dir, "--run-dir"), (job.deadpool.log_dir, "--deadpool-log-dir")):
        if path:
            check_writable_dir(path, flag)
    if args.json_log:
        check_writable_file(args.json_log, "--json-log")
    if job.deadpool.metrics_file:
        check_writable_file(job.deadpool.metrics_file, "--deadpool-metrics-file")
    if job.train.save:
        check_writable_dir(job.train.save, "--save")
    if job.train.load:
        check_load(job.train.load, save=job.train.save, world_size=job.parallel.world_size)
