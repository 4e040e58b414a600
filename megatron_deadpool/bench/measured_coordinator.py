"""The coordinator as `deadpool bench control-plane` runs it: the job layout at a size, the
process exits it is shown, and a coordinator that times its own sweeps and decisions."""

from __future__ import annotations

import time
from pathlib import Path

from ..hotswap.coordinator import Coordinator
from ..replication.placement import Layout

SPARES = 8
"""One node of spares."""


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


class MeasuredCoordinator(Coordinator):
    """The coordinator, timing each heartbeat sweep and the call that decides a recovery."""

    sweeps: list[dict[str, float]]
    decisions: list[dict[str, float]]

    def _try_agree(self, now: float) -> None:
        cpu0, t0 = time.thread_time(), time.time()
        super()._try_agree(now)
        if self.recovery is not None and self.recovery.t_agreed is not None:
            self.decisions.append(
                {"t_start": t0, "cpu_s": time.thread_time() - cpu0, "wall_s": time.time() - t0}
            )

    def _sweep(self, now: float) -> None:
        cpu0, proc0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
        super()._sweep(now)
        self.sweeps.append(
            {
                "keys": len(self._live_pids()),
                "cpu_s": time.thread_time() - cpu0,
                "process_cpu_s": time.process_time() - proc0,  # with the store server's part
                "wall_s": time.perf_counter() - t0,
            }
        )


def rss_mib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")
