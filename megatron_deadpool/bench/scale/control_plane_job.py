"""The job `deadpool bench control-plane` simulates, and what it watches of the coordinator.

The layout at a job size, the process exits the coordinator is shown (`SimLiveness`: the
simulated crashes), and `CostLog`, the coordinator's observer (`Coordinator(observer=...)`,
`hotswap.coordinator.coordinator.CoordinatorObserver`) that keeps what every heartbeat sweep and every
decision cost. The coordinator itself is the real one, unchanged: the bench reads it only
through its observer and its public properties.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ...hotswap.coordinator.coordinator import DecisionCost
from ...hotswap.coordinator.detector import SweepCost
from ...hotswap.coordinator.settings import CoordinatorSettings
from ...replication.placement import Layout

SPARES = 8
"""One node of spares."""


def settings_for(ranks: int, heartbeat_timeout: float, timeout: float) -> CoordinatorSettings:
    """The coordinator's settings at `ranks`: `SPARES` spares, no respawn, `timeout` for the
    survivors' reports."""
    return CoordinatorSettings(
        world_size=ranks, spares=SPARES, heartbeat_timeout=heartbeat_timeout, agree_timeout=timeout
    )


def layout_for(ranks: int) -> Layout:
    """tp 8 inside 8-GPU nodes, pp 4, the rest data parallel."""
    if ranks < 64 or ranks % 32:
        raise ValueError(f"ranks: a multiple of 32, at least 64, got {ranks}")
    return Layout(tp=8, pp=4, dp=ranks // 32, ranks_per_node=8)


class SimLiveness:
    """What the local launcher would see: the simulated crashes, as exits with code -9."""

    def __init__(self) -> None:
        self.codes: dict[str, int] = {}

    def exited(self, pid: str) -> int | None:
        return self.codes.get(pid)

    def exits(self) -> dict[str, int]:
        return self.codes

    def kill(self, pid: str) -> bool:
        return False


@dataclass(frozen=True)
class Decided:
    """One decision's cost, with the coordinator thread's and process's CPU clocks read as the
    observer heard of it (right after the roster was published)."""

    cost: DecisionCost
    thread_cpu_s: float
    process_cpu_s: float


class CostLog:
    """The coordinator's observer: every heartbeat sweep's cost and every decision's, in
    order."""

    def __init__(self) -> None:
        self.sweeps: list[SweepCost] = []
        self.decisions: list[Decided] = []

    def swept(self, cost: SweepCost) -> None:
        self.sweeps.append(cost)

    def decided(self, cost: DecisionCost) -> None:
        self.decisions.append(Decided(cost, time.thread_time(), time.process_time()))


def rss_mib(pid: int | str = "self") -> float:
    """Resident memory of process `pid` (default: this one), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")
