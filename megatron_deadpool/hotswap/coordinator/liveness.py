"""What a coordinator knows of a process besides its heartbeat: whether it exited, and killing it.

A launcher on the same machine sees its children exit and can kill a hung one
(`ProcessLiveness`); a coordinator on a cluster sees no processes (`HeartbeatOnly`), unless its
nodes run `deadpool agent`, which report the exits of the processes they started through the
store (`AgentExits`: a crash is known within an agent's beat, not after its peers' failure
reports and a silence). A hung process is killed by its agent when the coordinator orders its
respawn, never by the coordinator.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable
from typing import Protocol

import psutil

from ..protocol.coordinator_view import CoordinatorView


class Liveness(Protocol):
    """What the coordinator can learn about (and do to) a process beyond its heartbeat."""

    def exited(self, pid: str) -> int | None: ...

    def exits(self) -> dict[str, int]:
        """Every process seen to exit so far, with its exit code (read once per tick)."""

    def kill(self, pid: str) -> bool: ...


class ProcessLiveness:
    """A launcher on the same machine sees its children exit and can kill a hung one."""

    def __init__(self, procs: dict[str, subprocess.Popen]) -> None:
        self.procs = procs

    def exited(self, pid: str) -> int | None:
        proc = self.procs.get(pid)
        return None if proc is None else proc.poll()

    def exits(self) -> dict[str, int]:
        codes = {pid: proc.poll() for pid, proc in self.procs.items()}
        return {pid: code for pid, code in codes.items() if code is not None}

    def kill(self, pid: str) -> bool:
        proc = self.procs.get(pid)
        if proc is None or proc.poll() is not None:
            return False
        os.killpg(proc.pid, signal.SIGKILL)
        return True


def kill_groups(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILL every child's whole process group, exited or not, and reap the children.

    A child that ended may have left helpers behind (data-loader workers, megatron-core's
    checkpoint writer and its resource tracker); they share its group.
    """
    procs = list(procs)
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail
            pass


class HeartbeatOnly:
    """A coordinator on a cluster sees no processes: heartbeats are everything."""

    def exited(self, pid: str) -> int | None:
        return None

    def exits(self) -> dict[str, int]:
        return {}

    def kill(self, pid: str) -> bool:
        return False


class AgentExits:
    """A coordinator whose nodes run `deadpool agent`: the exits the agents report
    (`CoordinatorView.process_exits`, one store request per look when none is new)."""

    def __init__(self, membership: CoordinatorView) -> None:
        self.membership = membership
        self.seen = 0
        self.codes: dict[str, int] = {}
        self.nodes: dict[str, int] = {}  # the node each exited process ran on

    def exited(self, pid: str) -> int | None:
        return self.codes.get(pid)

    def exits(self) -> dict[str, int]:
        self.seen, new = self.membership.process_exits(self.seen)
        for exit in new:
            self.codes[exit.member] = exit.code
            self.nodes[exit.member] = exit.node
        return dict(self.codes)

    def kill(self, pid: str) -> bool:
        return False


def kill_tree(pid: int, grace_s: float = 0.0) -> None:
    """SIGKILL process `pid` and every process descended from it, whatever session each is in
    (the descendants are found first: once their parent dies they belong to init). `grace_s`:
    SIGTERM them first and give them that long to exit (a launcher and a node agent delete their
    shared memory on SIGTERM, which SIGKILL leaves behind)."""
    if grace_s > 0:
        terminated = _tree(pid)
        for proc in terminated:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        psutil.wait_procs(terminated, timeout=grace_s)
    for proc in _tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def _tree(pid: int) -> list[psutil.Process]:
    """Process `pid` and its descendants, the descendants first; none once it is gone."""
    try:
        root = psutil.Process(pid)
        return [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return []
