"""A launcher's wake-up when one of its processes ends, instead of its next tick finding it.

The local launcher's loop (`supervisor.Supervisor`) ticks every `TICK_S` (50 ms) and learns of an
exit by polling its processes then: up to a tick after the process ended, unless a survivor's
failure report woke the coordinator first (in `bench recovery` the dead rank's tensor-parallel peer
usually does, so its detect phase - mostly the kernel tearing the killed process down, ~20 ms and
more on 2 cores - did not measurably change; with DeadPool off nothing woke it). `ExitWatch` ends
such a pause - the wait on the coordinator's inbox of a launcher that hosts the coordinator, a node
agent's between its beats (`node_agent.NodeAgent._pause`, which then wakes the coordinator at once):
a thread polls one pidfd per process (`warm_start.exit_fd`: a forked process's or a fresh one's)
and, once one is readable and its exit code known (a forked process's comes from its fork server,
which reaps it), calls `on_exit()` - the launcher ends its pause, and its tick reads the code like
any other.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import threading
from collections.abc import Callable

from ...devices.threads import start_thread
from .warm_start import EXIT_CODE_S, ForkedProcess, exit_fd


class ExitWatch:
    """Calls `on_exit()` (on its own thread) each time a watched process ended."""

    def __init__(self, on_exit: Callable[[], None]) -> None:
        self.on_exit = on_exit
        # Reentrant: a SIGTERM handler that stops the watch (`node_agent.stop_on_term`) may run
        # on the main thread while it holds the lock in `watch`.
        self._lock = threading.RLock()
        self._procs: dict[int, ForkedProcess | subprocess.Popen] = {}  # pidfd -> its process
        self._new: list[int] = []  # pidfds the thread has not registered yet
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        self._thread = start_thread(self._run, name="deadpool-exit-watch")

    def watch(self, proc: ForkedProcess | subprocess.Popen) -> None:
        """Watch `proc` from now on (one that cannot be watched is found by the ticks)."""
        fd = exit_fd(proc)
        if fd is None:
            return
        with self._lock:  # the pipe is closed under it (`stop`)
            if self._stopping:
                os.close(fd)
                return
            self._procs[fd] = proc
            self._new.append(fd)
            os.write(self._wake_w, b"w")

    def watching(self) -> int:
        """How many processes it watches (each holds a descriptor until it ends, or `stop`)."""
        with self._lock:
            return len(self._procs)

    def _run(self) -> None:
        poller = select.poll()  # not select: a large job's descriptors pass 1,024
        poller.register(self._wake_r, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                poller.unregister(fd)
                with self._lock:
                    proc = self._procs.pop(fd)
                os.close(fd)
                with contextlib.suppress(subprocess.TimeoutExpired):  # then: at a later tick
                    proc.wait(timeout=EXIT_CODE_S)
                self.on_exit()
            with self._lock:
                if self._stopping:
                    return
                new, self._new = self._new, []
            for fd in new:
                poller.register(fd, select.POLLIN)

    def stop(self) -> None:
        """End the thread and close every descriptor it held (once)."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            os.write(self._wake_w, b"s")
        self._thread.join(EXIT_CODE_S + 5.0)
        with self._lock:
            for fd in self._procs:
                os.close(fd)
            self._procs.clear()
            self._new.clear()
            os.close(self._wake_r)
            os.close(self._wake_w)
