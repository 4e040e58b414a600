"""A job as a Slurm allocation starts it, on loopback: `deadpool coordinator` and five embedded
workers (the CPU demo, 4 ranks and a spare, with the tasks' SLURM_PROCID), each in a session of
its own and killed by PID when the job's `with` block ends, whatever happened.

Used by the cluster-coordinator tests that need no standby (`hotswap/worker/test_frozen_peer.py`,
`hotswap/coordinator/test_job_error.py`; with a standby: `standby_job.py`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import REPO_ROOT, deadpool_command
from procs import free_port, kill_sessions, spawn_logged

CONFIG = str(REPO_ROOT / "configs" / "cpu-demo.yaml")


@contextmanager
def coordinated_job(
    logs: Path, token: str, iters: str, fail: str, timing: list[str], max_wait: str
) -> Iterator[list[subprocess.Popen]]:
    """Start the coordinator (output in logs/coordinator.out, events in logs/events.jsonl) and
    tasks 0-4 (logs/task{i}.out) with `--deadpool-fail FAIL`; yields [coordinator, task 0, ..., task 4] (task 4: the spare).
    """
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEADPOOL_JOB_TOKEN": token}
    address = f"127.0.0.1:{port}"
    logs.mkdir()
    procs: list[subprocess.Popen] = []
    try:
        coordinator = spawn_logged(
            [
                *deadpool_command(), "coordinator", "--world-size", "4", "--config", CONFIG,
                "--deadpool-coordinator", address, "--deadpool-log-dir", str(logs),
                "--max-wait", max_wait, *timing,
            ],
            logs / "coordinator.out",
            env,
        )  # fmt: skip
        procs.append(coordinator)
        for task in range(5):
            worker = [
                sys.executable, "-m", "megatron_deadpool.embedded.worker", "--config", CONFIG,
                "--iters", iters, "--deadpool-coordinator", address, "--deadpool-fail", fail,
                *timing,
            ]  # fmt: skip
            procs.append(
                spawn_logged(worker, logs / f"task{task}.out", {**env, "SLURM_PROCID": str(task)})
            )
        yield procs
    finally:
        kill_sessions(procs)
