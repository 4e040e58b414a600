"""A job as deadpool_launch.sh starts it with DEADPOOL_RESPAWN_LIMIT, on loopback:
`deadpool coordinator` and one `deadpool agent` per node - nodes 0 and 1 hold ranks 0-3 (two
per node), node 2 the two spares - each starting its node's workers, and a standby coordinator
when asked; more nodes can join (`AgentsJob.join`). Every process runs in a session of its own
and is killed by PID when the job's `with` block ends, whatever happened (the agents' workers by
their agents, or here).

Used by `hotswap/coordinator/test_node_agents.py` (the embedded job) and
`megatron_lm/test_node_agents_mlm.py` (Megatron-LM's pretrain_gpt.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from conftest import deadpool_command
from procs import free_port, kill_sessions, spawn_logged

TIMING = [
    "--deadpool-heartbeat-interval", "0.5", "--deadpool-heartbeat-timeout", "4",
    "--deadpool-agree-timeout", "60", "--deadpool-pg-timeout", "150",
]  # fmt: skip


@dataclass
class AgentsJob:
    """The processes of a job started by `agents_job` (coordinator, agents 0-2, joined
    agents), and how to add a node to it."""

    procs: list[subprocess.Popen]
    agent: list[str]
    worker: list[str]
    env: dict[str, str]
    address: str

    def join(self, logs: Path) -> subprocess.Popen:
        """A node of another allocation whose agent joins the running job (its logs in `logs`,
        its processes spares that take their names from the store)."""
        logs.mkdir()
        cmd = [*self.agent, "--deadpool-join", "--deadpool-log-dir", str(logs), "--node", "0",
               "--", *self.worker, "--deadpool-join"]  # fmt: skip
        self.procs.append(spawn_logged(cmd, logs / "agent.out", self.env))
        return self.procs[-1]


@contextmanager
def agents_job(
    logs: Path,
    worker: list[str],
    settings: list[str],
    env: dict[str, str] | None = None,
    *,
    standby: bool = False,
    respawn_limit: int = 2,
) -> Iterator[AgentsJob]:
    """The coordinator (logs/coordinator.out, events.jsonl) and the agents of nodes 0-2
    (logs/agent{n}.out; the workers' logs/task-{t}.log), world size 4 and 2 spares; with
    `standby`, a standby coordinator too (logs/standby.out, logs/standby/events.jsonl).
    `worker`: the worker command, to which the coordinators' addresses and `TIMING` are
    appended; `settings`: more of the job's settings (the coordinators' and the agents')."""
    address = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2 if standby else 1))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEADPOOL_JOB_TOKEN": "agents-test", **(env or {})}
    settings = [
        *settings, "--deadpool-coordinator", address, "--deadpool-spares", "2",
        "--deadpool-ranks-per-node", "2", "--deadpool-respawn-limit", str(respawn_limit), *TIMING,
    ]  # fmt: skip
    worker = [*worker, "--deadpool-coordinator", address, *TIMING]
    logs.mkdir()
    agent = [*deadpool_command(), "agent", "--world-size", "4", *settings]
    job = AgentsJob([], agent, worker, env, address)
    coordinator = [*deadpool_command(), "coordinator", "--world-size", "4", *settings,
                   "--deadpool-log-dir", str(logs), "--max-wait", "400"]  # fmt: skip
    try:
        job.procs.append(spawn_logged(coordinator, logs / "coordinator.out", env))
        if standby:
            cmd = [*coordinator, "--standby", "--deadpool-log-dir", str(logs / "standby")]
            job.procs.append(spawn_logged(cmd, logs / "standby.out", env))
        for node in range(3):
            cmd = [*agent, "--deadpool-log-dir", str(logs), "--node", str(node), "--", *worker]
            job.procs.append(spawn_logged(cmd, logs / f"agent{node}.out", env))
        yield job
    finally:
        workers = [c for p in job.procs if psutil.pid_exists(p.pid) for c in children(p.pid)]
        kill_sessions(job.procs)
        for pid in workers:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        remove_node_memory(logs.parent)


def remove_node_memory(folder: Path) -> None:
    """Delete the memory folders the agents whose logs are under `folder` named ("processes'
    memory in ..."): an agent killed with its node (here: a process) leaves its folder behind,
    where a real node's memory would be gone with it."""
    for log in [*folder.rglob("agent*.out"), *folder.rglob("agent-*.log")]:
        for path in re.findall(r"processes' memory in (\S+)", log.read_text(errors="replace")):
            if Path(path).name.startswith("deadpool-node-"):
                shutil.rmtree(path, ignore_errors=True)


def children(pid: int) -> list[int]:
    """The PIDs of process `pid`'s descendants (an agent's fork server and the workers it
    forked, each in a session of its own)."""
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def started_pid(agent_log: str, task: int) -> int:
    """The PID of the last process an agent started as task `task` (its log says so; a forked
    process's /proc environ and command line are its fork server's)."""
    found = re.findall(rf"\(task {task}, GPU \d+, pid (\d+)\)", agent_log)
    assert found, agent_log
    return int(found[-1])


def kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its processes together: its node is lost."""
    for pid in [agent.pid, *children(agent.pid)]:
        os.killpg(pid, signal.SIGKILL)


def log_of(folder: Path, name: str) -> str:
    path = folder / name
    return path.read_text(errors="replace") if path.exists() else ""


def events(logs: Path) -> list[dict[str, Any]]:
    """The coordinator's events so far (complete lines: it may be writing the next one)."""
    return [json.loads(line) for line in log_of(logs, "events.jsonl").split("\n")[:-1] if line]


def describe(*folders: Path) -> str:
    """What a failed test shows: the end of every log of the job."""
    return "\n".join(
        f"--- {p}\n{p.read_text(errors='replace')[-2500:]}"
        for folder in folders
        for p in sorted(folder.glob("*.out")) + sorted(folder.glob("task-*.log"))
    )
