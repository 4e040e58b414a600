"""CPU time by process role during a local run: the ranks, the spares, the launcher.

On a machine with fewer cores than processes every CPU second spent outside the ranks' training
is taken from them, so this is where a failure-free overhead comes from when there is one. A
sampler thread reads each child's CPU time (utime + stime in /proc/PID/stat) and the launcher
process's own (its store server, coordinator and monitor loop) every `interval` seconds; the
CPU each role used between two wall-clock instants (e.g. the ends of the warm-up and of the last
iteration) is then the difference of the samples nearest to them. Linux only (/proc).
"""

from __future__ import annotations

import bisect
import os
import subprocess
import threading
import time
from pathlib import Path

from ..devices.threads import DeviceThread

_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of process `pid` in seconds (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


class CpuSampler(DeviceThread):
    """Samples the CPU time of `procs` (pid name -> process) and of this process."""

    def __init__(self, procs: dict[str, subprocess.Popen], interval: float = 0.2) -> None:
        super().__init__(name="deadpool-cpu-sampler", daemon=True)
        self.procs = procs
        self.interval = interval
        self.samples: dict[str, list[tuple[float, float]]] = {"launcher": []}
        self._done = threading.Event()

    def run(self) -> None:
        own = 0.0  # this thread's CPU, not the launcher's
        while True:
            t0 = time.thread_time()
            now = time.time()
            for name, proc in list(self.procs.items()):
                cpu = _proc_cpu_s(proc.pid)
                if cpu is not None:
                    self.samples.setdefault(name, []).append((now, cpu))
            own += time.thread_time() - t0
            self.samples["launcher"].append((now, time.process_time() - own))
            if self._done.wait(self.interval):
                return

    def stop(self) -> None:
        self._done.set()
        self.join()

    def window(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds by role between wall times `start` and `end`: "ranks" (all actives),
        "spares", "launcher"."""
        out = {"ranks": 0.0, "spares": 0.0, "launcher": 0.0}
        for name, series in self.samples.items():
            role = "launcher" if name == "launcher" else "spares" if name[0] == "s" else "ranks"
            out[role] += _at(series, end) - _at(series, start)
        return out


def _at(series: list[tuple[float, float]], t: float) -> float:
    """The CPU reading of the sample nearest to time `t` (0 before the first)."""
    if not series:
        return 0.0
    i = bisect.bisect_left([s[0] for s in series], t)
    if i == 0:
        return series[0][1] if series[0][0] - t < 0.5 else 0.0
    if i == len(series):
        return series[-1][1]
    before, after = series[i - 1], series[i]
    return before[1] if t - before[0] <= after[0] - t else after[1]
