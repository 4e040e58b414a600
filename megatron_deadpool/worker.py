"""One process of the embedded job: an active rank, or a spare waiting for a slot.

Run by `deadpool train` (one per active rank and spare, on this machine) or under Slurm as
`python -m megatron_deadpool.worker --config JOB.yaml --deadpool-coordinator HOST:PORT`
(rank from SLURM_PROCID: processes beyond the world size are spares).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .config import parse_host_port
from .errors import ConfigError, CoordinatorUnreachableError
from .jobspec import JobConfig
from .logs import setup_logging
from .membership import Membership

log = logging.getLogger("megatron_deadpool.worker")


def connect_store(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the coordinator's store; a clear error instead of a hang."""
    host, port = parse_host_port(address, "deadpool-coordinator", resolve=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:  # short attempts: torch's own retry back-off can outlast the whole deadline
            attempt = max(0.5, min(10.0, deadline - time.monotonic()))
            store = dist.TCPStore(
                host,
                port,
                is_master=False,
                timeout=datetime.timedelta(seconds=attempt),
                wait_for_workers=False,
            )
            store.set_timeout(datetime.timedelta(seconds=timeout_s))
            return store
        except (RuntimeError, TimeoutError) as exc:
            if time.monotonic() > deadline:
                why = str(exc).splitlines()[0][:160]
                raise CoordinatorUnreachableError(
                    f"coordinator {address} unreachable after {timeout_s:.0f}s ({why}); start "
                    "`deadpool coordinator` first or fix --deadpool-coordinator"
                ) from None
            time.sleep(0.2)


class Heartbeat(threading.Thread):
    """Publishes this process's heartbeat on its own store connection."""

    def __init__(self, address: str, pid: str, interval: float, timeout: float) -> None:
        super().__init__(name="deadpool-heartbeat", daemon=True)
        self.membership = Membership(connect_store(address, timeout), pid)
        self.interval = interval
        self.stopped = threading.Event()
        self.lost: str | None = None  # why the coordinator became unreachable, if it did

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.membership.heartbeat()
            except (RuntimeError, OSError) as exc:  # the coordinator's store is gone
                self.lost = str(exc).splitlines()[0][:200]
                return


def main(argv: Sequence[str] | None = None) -> int:
    from .train_cli import add_job_flags, job_from_args

    parser = argparse.ArgumentParser(prog="python -m megatron_deadpool.worker")
    add_job_flags(parser)
    parser.add_argument("--pid", help="process id a{rank} or s{spare}; default from SLURM_PROCID")
    args = parser.parse_args(argv)
    setup_logging()
    job = job_from_args(args)
    if not job.deadpool.coordinator:
        raise ConfigError("deadpool-coordinator: a worker needs the coordinator's HOST:PORT")
    pid = args.pid or _pid_from_env(job)
    token = job.deadpool.job_token or os.environ.get("DEADPOOL_JOB_TOKEN", "")
    torch.set_num_threads(int(os.environ.get("DEADPOOL_THREADS", "1")))
    from .runtime import Runtime

    runtime = Runtime(job, pid=pid, coordinator=job.deadpool.coordinator, token=token)
    return runtime.run()


def _pid_from_env(job: JobConfig) -> str:
    procid = os.environ.get("SLURM_PROCID", os.environ.get("RANK"))
    if procid is None:
        raise ConfigError("worker: pass --pid or run under Slurm (SLURM_PROCID) / torchrun (RANK)")
    world = job.parallel.world_size
    n = int(procid)
    return f"a{n}" if n < world else f"s{n - world}"


def inject(kind: str) -> None:
    """Fail this process now: SIGKILL (crash) or SIGSTOP (hang)."""
    os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as exc:
        print(f"deadpool worker: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except CoordinatorUnreachableError as exc:
        print(f"deadpool worker: error: {exc}", file=sys.stderr)
        sys.exit(3)
