"""`deadpool agent`: one node's agent on a cluster - starts the node's processes, respawns them.

    deadpool agent --world-size W [--node N] [--config JOB.yaml] [--deadpool-* flags of the job] \\
        -- WORKER COMMAND ...

One per node (`scripts/slurm/deadpool_launch.sh` with DEADPOOL_RESPAWN_LIMIT starts it as one
Slurm task per node): it starts the node's `--deadpool-ranks-per-node` processes of the worker
command - tasks N*R .. N*R+R-1 of the job, actives first, then the `--deadpool-spares` - with
their RANK and LOCAL_RANK, keeps their snapshots and replicas in the node's memory, and carries
out the coordinator's respawn orders (`hotswap/launch/node_agent.py`). Our workers (the embedded job's,
Megatron-LM's script through the runner) are forked from an interpreter that imported them once
(a fork server, `hotswap/launch/warm_start.py`): a respawned process starts without import time. `--node` defaults to Slurm's
SLURM_NODEID. With `--deadpool-join` the agent joins a running job instead: it takes a node
number from the job's store and its processes join as spares (a revived node, or one of another
allocation: DEADPOOL_JOIN with DEADPOOL_RESPAWN_LIMIT in the sbatch scripts). The job's secret
comes from the environment (DEADPOOL_JOB_TOKEN or DEADPOOL_JOB_TOKEN_FILE), as the workers'
does. Exit code 0 once the job is over and the node's processes exited; 4 when no coordinator
of the job answered within --deadpool-connect-timeout.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..config.numbers import number_arg
from ..embedded.launch import WORKER_PRELOAD
from ..errors import ConfigError, CoordinatorUnreachableError, ExitCode
from ..hotswap.launch.forkserver import Preload
from ..hotswap.launch.node_agent import NodeAgent, stop_on_term
from ..hotswap.protocol.seal import SECRET_ENV, SECRET_FILE_ENV, JobSeal, job_binding, job_secret
from ..logs import setup_logging
from ..megatron_lm.launch import runner_preload
from .coordinator import add_job_settings, add_world_size, job_settings


def configure(parser: argparse.ArgumentParser) -> None:
    add_world_size(parser)
    parser.add_argument(
        "--node",
        type=number_arg(integer=True, minimum=0),
        default=None,
        help="this node's number in its allocation (default: SLURM_NODEID); with "
        "--deadpool-join the agent takes a number in the job from the job's store",
    )
    add_job_settings(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the worker command")


def run(args: argparse.Namespace) -> int:
    cfg = job_settings(args)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ConfigError("command: give the worker command after --")
    node = args.node
    if node is None:
        value = os.environ.get("SLURM_NODEID", "")
        if not value.isdigit():
            raise ConfigError("node: give --node N (outside Slurm: SLURM_NODEID is unset)")
        node = int(value)
    if not cfg.coordinators:
        raise ConfigError("deadpool-coordinator: give the job's coordinators' HOST:PORT[,...]")
    if cfg.ranks_per_node is None:
        raise ConfigError("deadpool-ranks-per-node: give the processes per node (GPUs per node)")
    if not cfg.log_dir:
        raise ConfigError("deadpool-log-dir: give the folder of the processes' logs")
    secret = job_secret(cfg.job_token)
    if not secret:
        raise ConfigError(f"the job's secret: set {SECRET_ENV} or {SECRET_FILE_ENV}")
    setup_logging()
    agent = NodeAgent(
        command,
        place=node,
        join=cfg.join,
        preload=worker_preload(command),
        per_node=cfg.ranks_per_node,
        world_size=args.world_size,
        processes=args.world_size + cfg.spares,
        coordinators=cfg.coordinators,
        seal=JobSeal(secret, job_binding()),
        log_dir=Path(cfg.log_dir),
        beat_s=cfg.heartbeat_interval,
        connect_timeout=cfg.connect_timeout,
    )
    stop_on_term(agent)
    try:
        return agent.run()
    except CoordinatorUnreachableError as exc:
        print(f"deadpool agent: error: {exc}", file=sys.stderr)
        return ExitCode.NO_COORDINATOR


def worker_preload(command: list[str]) -> Preload | None:
    """What a worker command of ours imports, for its processes to fork warm: the embedded
    job's worker, or Megatron-LM's script through the runner (None: any other command)."""
    if command[1:3] == ["-m", "megatron_deadpool.embedded.worker"]:
        return WORKER_PRELOAD
    if command[1:3] == ["-m", "megatron_deadpool.megatron_lm"] and len(command) > 3:
        return runner_preload(command[3])
    return None
