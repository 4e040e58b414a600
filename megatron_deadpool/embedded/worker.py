"""One process of the embedded job: an active rank, or a spare waiting for a slot.

Run by `deadpool train` (one per active rank and spare, on this machine) or under Slurm as
`python -m megatron_deadpool.embedded.worker --config JOB.yaml --deadpool-coordinator HOST:PORT`
(rank from SLURM_PROCID: processes beyond the world size are spares).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ..config.job import JobConfig
from ..config.job_args import add_job_flags, job_from_args
from ..errors import ConfigError, CoordinatorUnreachableError, ExitCode
from ..hotswap.protocol.messages import member_of
from ..hotswap.protocol.seal import job_secret
from ..logs import setup_logging


def main(argv: Sequence[str] | None = None, **hooks: Any) -> int:
    """Run one process of the embedded job; `hooks` go to `EmbeddedJob` (saver, on_finish)."""
    parser = argparse.ArgumentParser(prog="python -m megatron_deadpool.embedded.worker")
    add_job_flags(parser)
    parser.add_argument(
        "--member", help="this process's member name a{rank} or s{spare}; default from SLURM_PROCID"
    )
    args = parser.parse_args(argv)
    setup_logging()
    job = job_from_args(args)
    if not job.deadpool.coordinator:
        raise ConfigError("deadpool-coordinator: a worker needs the coordinator's HOST:PORT")
    if job.deadpool.join and args.member:
        raise ConfigError(
            "deadpool-join: a joining process takes its name from the coordinator; " "drop --member"
        )
    member = None if job.deadpool.join else args.member or _member_from_env(job)
    token = (
        job_secret(job.deadpool.job_token) or ""
    )  # the environment's (`hotswap/protocol/seal.py`)
    torch.set_num_threads(int(os.environ.get("DEADPOOL_THREADS", "1")))
    from .job import EmbeddedJob  # imports megatron-core: only once the input is valid

    return EmbeddedJob(
        job, member=member, coordinator=job.deadpool.coordinator, token=token, **hooks
    ).run()


def _member_from_env(job: JobConfig) -> str:
    procid = os.environ.get("SLURM_PROCID", os.environ.get("RANK"))
    if procid is None:
        raise ConfigError(
            "worker: pass --member or run under Slurm (SLURM_PROCID) / torchrun (RANK)"
        )
    if not procid.isdigit():
        raise ConfigError(f"SLURM_PROCID/RANK: expected a task index (0, 1, ...), got {procid!r}")
    return member_of(int(procid), job.parallel.world_size)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as exc:
        print(f"deadpool worker: error: {exc}", file=sys.stderr)
        sys.exit(ExitCode.BAD_INPUT)
    except CoordinatorUnreachableError as exc:
        print(f"deadpool worker: error: {exc}", file=sys.stderr)
        sys.exit(ExitCode.NO_COORDINATOR)
