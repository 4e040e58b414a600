"""Shared by tests that start processes or wait on other threads: a free loopback port, a
process started with its output in a file, waiting on a condition with a deadline (instead of
sleeping "long enough"), and a process's state.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now and that this process has not
    handed out before: the kernel may give the port it just released to the next bind, so two
    calls in a row could name the same port for two servers (seen: a primary and a standby
    coordinator on one port)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def spawn_logged(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start `cmd` in a session of its own (kill it with its helpers: `os.killpg`), its output
    and errors to `log`."""
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def wait_until(
    condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.01
) -> None:
    """Return as soon as `condition()` is true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting for {what}"
        time.sleep(poll_s)


def process_state(pid: int) -> str | None:
    """A process's state letter (R running, S sleeping, T stopped, ...); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def wait_stopped(pid: int, timeout_s: float = 30.0) -> None:
    """Until process `pid` is stopped (SIGSTOP took effect)."""
    wait_until(lambda: process_state(pid) == "T", timeout_s, f"process {pid} to be stopped")


def kill_sessions(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each process's session (`spawn_logged` starts one per process) and reap it."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
