"""The one supervision loop of every launcher: tick the coordinator until the job ends, and how.

`deadpool train`'s launcher, `deadpool megatron-lm`'s and `deadpool coordinator` (on a
cluster's batch host) all run this loop over what they host (`Supervised`: the local job with
its processes, `local_job.LocalJob` and its srun form, or the coordinator alone,
`CoordinatorOnly`). Each turn: preemption asked for (SIGTERM to the launcher) is passed on, the
coordinator ticks, the launcher's own work is done (`on_tick`: progress lines, new spares; True
when it made progress, which skips the pause), then the first of these ends the loop:
  - a launcher's own check (`checks`: a configuration error, a standby that took over);
  - the job's own error (a rank's exception before replication started, a spare failing as the
    rank it replaced did: `job_error.py`) -> the launcher's verdict (`on_job_error`: it shows
    the end of that rank's log) -> exit code 9;
  - out of redundancy: the survivors get their time to save what survives -> exit code 3;
  - with DeadPool off, a failed process -> the launcher's verdict (`on_failed`);
  - every rank finished -> the launcher's verdict (`finished`: 0, 143 after a preemption, the
    job's own code);
  - the time limit -> 124 (`deadpool coordinator`: 6, its `--max-wait`), after a line on what
    has not finished (`Supervised.unfinished`: each process not exited and its log's end);
and otherwise it waits for the next event (the coordinator wakes early on the last report of
a recovery).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ...errors import ExitCode
from ..coordinator.coordinator import Coordinator
from ..protocol.coordinator_view import CoordinatorView
from ..protocol.messages import JobError


class Supervised(Protocol):
    """A job as the supervision loop sees it."""

    @property
    def coordinator(self) -> Coordinator: ...

    @property
    def deadpool(self) -> bool:
        """DeadPool on: the coordinator decides what a failure means."""

    @property
    def membership(self) -> CoordinatorView: ...

    def tick(self) -> None: ...

    def wait(self, timeout_s: float) -> None: ...

    def finished(self) -> bool:
        """Every rank finished (and no recovery is under way)."""

    def failed(self) -> dict[str, int]:
        """Members that exited with an error no recovery accounts for (member -> code)."""

    def await_salvage(self) -> None:
        """Out of redundancy: give the survivors their time to save what survives."""

    def unfinished(self) -> str:
        """What keeps the job from having finished, for the time limit's line ("" where
        nothing more is known)."""


TICK_S = 0.05
"""How often `deadpool coordinator` looks at the job when nothing wakes it (a survivor's last
report wakes it at once: `Coordinator.wait`)."""


@dataclass
class Supervisor:
    """Runs the loop over `job` until it ends; `run()` returns the exit code."""

    job: Supervised
    limit_s: float
    say: Callable[[str], None]
    finished: Callable[[], int] = lambda: ExitCode.OK
    """The exit code once every rank finished."""
    on_failed: Callable[[dict[str, int]], int] = lambda failed: ExitCode.FAILED
    """With DeadPool off: the exit code when members failed (member -> code)."""
    on_job_error: Callable[[JobError], int] = lambda verdict: ExitCode.JOB_ERROR
    """The job's own error ended the job: say what the user needs to fix it; the exit code."""
    on_tick: Callable[[], bool] = lambda: False
    checks: Sequence[Callable[[], int | None]] = ()
    on_timeout: ExitCode = ExitCode.TIMEOUT
    interval_s: float = TICK_S
    preempt: Callable[[], str | None] = lambda: None
    """Once the launcher got SIGTERM, what to say: every rank then stops after the current
    iteration (the store's `preempt`)."""
    _preempt_sent: bool = field(default=False, init=False)

    def run(self) -> int:
        deadline = time.monotonic() + self.limit_s
        while True:
            if not self._preempt_sent:
                why = self.preempt()
                if why is not None:
                    self.job.membership.request_preempt()
                    self._preempt_sent = True
                    self.say(why)
            self.job.tick()
            if self.on_tick():
                continue
            code = self._verdict()
            if code is not None:
                return code
            if time.monotonic() > deadline:
                detail = self.job.unfinished()
                self.say(
                    f"the job exceeded its {self.limit_s:.0f}s limit; stopping"
                    + (f"; not finished:\n{detail}" if detail else "")
                )
                return self.on_timeout
            self.job.wait(self.interval_s)

    def _verdict(self) -> int | None:
        for check in self.checks:
            code = check()
            if code is not None:
                return code
        if self.job.deadpool and self.job.coordinator.job_error is not None:
            return self.on_job_error(self.job.coordinator.job_error)
        if self.job.deadpool and self.job.coordinator.out_of_redundancy is not None:
            self.job.await_salvage()
            return ExitCode.OUT_OF_REDUNDANCY
        if not self.job.deadpool:
            failed = self.job.failed()
            if failed:
                return self.on_failed(failed)
        if self.job.finished():
            return self.finished()
        return None


class CoordinatorOnly:
    """The job as `deadpool coordinator` hosts it: its coordinator and store, no processes (on
    a cluster the ranks are seen only through the store)."""

    def __init__(
        self, coordinator: Coordinator, each_tick: Callable[[], None], deadline: float
    ) -> None:
        """`deadline`: on the monotonic clock, when the coordinator gives up (`--max-wait`)."""
        self._coordinator = coordinator
        self.each_tick = each_tick
        self.deadline = deadline

    @property
    def coordinator(self) -> Coordinator:
        return self._coordinator

    @property
    def deadpool(self) -> bool:
        return True

    @property
    def membership(self) -> CoordinatorView:
        return self._coordinator.membership

    def tick(self) -> None:
        self._coordinator.tick()
        self.each_tick()

    def wait(self, timeout_s: float) -> None:
        self._coordinator.wait(timeout_s)

    def finished(self) -> bool:
        return self._coordinator.training_done()

    def failed(self) -> dict[str, int]:
        return {}  # no process exit is seen: a dead rank is one the coordinator names

    def unfinished(self) -> str:
        return ""  # the processes are the cluster's: their logs are where srun put them

    def await_salvage(self) -> None:
        """Waiting spares leave; the surviving ranks save through this store: serve it until
        each saved, or fell silent (however long a large save takes)."""
        self.membership.request_shutdown()
        while time.monotonic() < self.deadline and self._coordinator.salvage_outstanding():
            time.sleep(0.2)
