"""A launcher wakes when one of its processes ends (`hotswap/launch/exit_watch.py`), and an exit
code read by one thread is not lost to another (`warm_start.ForkedProcess`).

Real processes throughout: forked by a fork server that imports nothing heavy, and fresh ones.
The bounds are generous (seconds): what is checked is that a pause ends at an exit at all - before
the watch, a launcher's pause ran its whole length and the next tick found the exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_deadpool.hotswap.launch.exit_watch import ExitWatch
from megatron_deadpool.hotswap.launch.forkserver import Preload
from megatron_deadpool.hotswap.launch.warm_start import ForkedProcess, ForkServer

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
LIGHT = Preload(("json",))
PY = sys.executable
ENDS_WITH_3 = [PY, "-c", "import sys, time; time.sleep(0.3); sys.exit(3)"]
PAUSE_S = 30.0
"""A pause far longer than any exit below takes to be seen."""

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("own_servers")]


def _open_fds() -> set[str]:
    """This process's descriptors (not the one the listing itself opened)."""
    return {fd for fd in os.listdir("/proc/self/fd") if os.path.lexists(f"/proc/self/fd/{fd}")}


@pytest.mark.parametrize("how", ["forked", "fresh"])
def test_an_exit_wakes_the_watch_with_its_code_known(
    how: str, server: ForkServer, started: list
) -> None:
    """A process that exits with 3: `on_exit` is called once, and by then its code is there for
    the launcher's next look (`poll`); a process still running calls nothing; `stop` closes every
    descriptor the watch opened."""
    before = _open_fds()
    seen: list[int | None] = []
    woke = threading.Event()
    ends = (
        server.spawn(ENDS_WITH_3, env=ENV)
        if how == "forked"
        else subprocess.Popen(ENDS_WITH_3, env=ENV, start_new_session=True)
    )
    runs = server.spawn([PY, "-c", "import time; time.sleep(300)"], env=ENV)
    started.extend([ends, runs])

    def on_exit() -> None:
        seen.append(ends.poll())
        woke.set()

    watch = ExitWatch(on_exit)
    try:
        watch.watch(ends)
        watch.watch(runs)
        assert woke.wait(PAUSE_S), "the exit was not seen"
        time.sleep(0.2)  # nothing more comes
        assert seen == [3]
        assert ends.poll() == 3 and runs.poll() is None
    finally:
        watch.stop()
    assert not (_open_fds() - before) - _server_fds(server)  # nothing left open by the watch


def _server_fds(server: ForkServer) -> set[str]:
    """The descriptors the fork server's launcher side holds (its socket, the pidfds of its
    children not reaped yet): not the watch's."""
    return {str(server.sock.fileno()), *(str(fd) for fd in server._pidfds.values())}


def test_a_watch_stopped_takes_no_more_processes(server: ForkServer, started: list) -> None:
    """After `stop`, `watch` opens nothing and calls nothing."""
    before = _open_fds()
    calls: list[float] = []
    watch = ExitWatch(lambda: calls.append(time.monotonic()))
    watch.stop()
    proc = server.spawn(ENDS_WITH_3, env=ENV)
    started.append(proc)
    watch.watch(proc)
    assert proc.wait(30) == 3
    time.sleep(0.2)
    assert calls == []
    assert not (_open_fds() - before) - _server_fds(server)


def test_an_exit_code_is_read_by_each_thread_that_asks(server: ForkServer, started: list) -> None:
    """The fork server's report of an exit stays: a second reader (the launcher's loop, after
    its `ExitWatch` waited for the same process) gets the code too, not None forever."""
    proc = server.spawn(ENDS_WITH_3, env=ENV)
    started.append(proc)
    rid = proc._id
    assert server.exit_code(rid, 30) == 3
    assert server.exit_code(rid, 0) == 3


class _Racing:
    """A fork server whose answer crosses another thread's: while `poll` asks, that thread reads
    the code and sets it on the process; this ask then finds nothing new."""

    def __init__(self) -> None:
        self.proc: ForkedProcess | None = None

    def exit_code(self, rid: int, timeout: float | None) -> int | None:
        assert self.proc is not None
        self.proc.returncode = 3  # the other thread's `wait`, done meanwhile
        return None


def test_a_code_another_thread_read_is_not_overwritten_by_none() -> None:
    server = _Racing()
    proc = ForkedProcess(server, 1, 12345, [PY], None)  # type: ignore[arg-type]
    server.proc = proc
    assert proc.poll() == 3
    proc.returncode = None
    assert proc.wait(0.0) == 3


@pytest.mark.parametrize("enabled", [False, True], ids=["deadpool-off", "deadpool-on"])
def test_a_launchers_pause_ends_when_one_of_its_processes_ends(
    enabled: bool, tmp_path: Path, started: list
) -> None:
    """`LocalJob.wait` (the pause between the launcher's ticks): a process that exits ends it
    long before its length, DeadPool on (the coordinator's wait) and off, and the tick right
    after reads the exit code."""
    from megatron_deadpool.config.deadpool import DeadpoolConfig
    from megatron_deadpool.hotswap.launch.local_job import LocalJob

    job = LocalJob(DeadpoolConfig(enabled=enabled), world_size=1, token="t", run_dir=tmp_path)
    try:
        job.wait(0.01)  # the coordinator's waiter is started by its first wait
        with open(tmp_path / "a0.log", "w") as log:
            job.spawn("a0", ENDS_WITH_3, ENV, log, preload=LIGHT)
        started.extend(job.procs.values())
        t0 = time.monotonic()
        job.wait(PAUSE_S)
        waited = time.monotonic() - t0
        assert waited < PAUSE_S / 2, f"the pause ran {waited:.1f}s: the exit did not end it"
        assert job.exit_codes(["a0"]) == {"a0": 3}
    finally:
        job.close(grace_s=0)
