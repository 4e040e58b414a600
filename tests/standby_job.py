"""A job as a cluster runs it, on loopback: a primary and a standby `deadpool coordinator` and
the job's worker processes, each in its own session; every process is killed by PID at the end.

Used by the failover tests of both jobs (`hotswap/coordinator/test_failover.py`,
`megatron_lm/test_megatron_lm_failover.py`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import deadpool_command
from procs import free_port

Worker = Callable[[str, int, str], tuple[list[str], dict[str, str]]]
"""(member, task index, the coordinators' addresses) -> the process's command line and extra env."""


class StandbyJob:
    """Two coordinators and `world_size + spares` workers; `close()` kills them all."""

    def __init__(
        self,
        folder: Path,
        *,
        world_size: int,
        spares: int,
        settings: list[str],
        timeout_s: float,
        joining: int = 0,
    ) -> None:
        """`settings`: the job's --deadpool-* flags (and --config), given to both
        coordinators (the workers get their own from `Worker`). `joining`: the last of the
        `spares` are not the job's own but join it (`--deadpool-join`, the `Worker`'s part),
        so the coordinators start with the others only."""
        self.folder = folder
        self.world_size = world_size
        self.spares = spares
        self.joining = joining
        self.settings = settings
        self.timeout_s = timeout_s
        self.addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
        self.token = "failover-test"
        self.procs: dict[str, subprocess.Popen] = {}
        self.started = time.time()

    @property
    def members(self) -> list[str]:
        return [f"a{r}" for r in range(self.world_size)] + [f"s{i}" for i in range(self.spares)]

    @property
    def joiners(self) -> list[str]:
        """The spares that join the running job, with the names they will get."""
        return [f"s{i}" for i in range(self.spares - self.joining, self.spares)]

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        with open(self.folder / f"{name}.log", "w") as out:
            self.procs[name] = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    "OMP_NUM_THREADS": "1",
                    "DEADPOOL_JOB_TOKEN": self.token,
                    **env,
                },
                start_new_session=True,
            )

    def start(self, worker: Worker) -> None:
        coordinators = ",".join(self.addresses)
        for name, extra in (("primary", []), ("standby", ["--standby"])):
            cmd = [
                *deadpool_command(),
                "coordinator",
                "--world-size",
                str(self.world_size),
                "--deadpool-coordinator",
                coordinators,
                "--deadpool-spares",
                str(self.spares - self.joining),
                "--deadpool-log-dir",
                str(self.folder / name),
                *self.settings,
                "--max-wait",
                str(self.timeout_s),
                *extra,
            ]
            self._spawn(name, cmd, {})
        for task, member in enumerate(self.members):
            cmd, env = worker(member, task, coordinators)
            self._spawn(member, cmd, env)

    # ------------------------------------------------------------------ observing
    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def events(self, name: str) -> list[dict[str, Any]]:
        path = self.folder / name / "events.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def event(self, name: str, kind: str) -> dict[str, Any] | None:
        return next((e for e in self.events(name) if e["event"] == kind), None)

    def wait_for_line(self, name: str, text: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while text not in self.log(name):
            assert self.procs[name].poll() is None, self.describe()
            assert time.monotonic() < deadline, self.describe()
            time.sleep(0.1)

    def timeline(self, t0: float) -> dict[str, float]:
        """Seconds from `t0` to each step of the standby's takeover and the recovery after."""
        marks: dict[str, float] = {}
        for e in self.events("standby"):
            if e["event"] in ("coordinator_lost", "taking_over", "rebuilt", "plan", "agreed"):
                marks.setdefault(e["event"], e["t"] - t0)
            if e["event"] == "rejoined":
                marks.setdefault("first_rejoined", e["t"] - t0)
                marks["last_rejoined"] = e["t"] - t0
        return {k: round(v, 3) for k, v in marks.items()}

    def describe(self) -> str:
        return "\n".join(
            f"--- {name} (exit {proc.poll()})\n{self.log(name)[-1500:]}"
            for name, proc in self.procs.items()
        )

    # ------------------------------------------------------------------ acting
    def kill(self, *names: str, sig: signal.Signals = signal.SIGKILL) -> float:
        """Signal every process of `names` (their whole sessions); the time it happened."""
        t = time.time()
        for name in names:
            os.killpg(self.procs[name].pid, sig)
        return t

    def wait(self, names: list[str]) -> dict[str, int]:
        deadline = time.monotonic() + self.timeout_s
        for name in names:
            try:
                self.procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} still running after {self.timeout_s:.0f}s\n{self.describe()}")
        return {name: self.procs[name].returncode for name in names}

    def close(self) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self.procs.values():
            proc.wait(timeout=30)
