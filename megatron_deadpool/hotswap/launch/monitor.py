"""The monitor both jobs' launchers run over their local job (`deadpool train`'s,
`embedded/launch.py`, and `deadpool megatron-lm`'s, `megatron_lm/launch.py`).

It is the supervision loop (`supervisor.py`) within the launcher's time limit, saying what it
says on the launcher's own output, and the watch of the job's checkpoints that could not be
written: rank 0 publishes each one's line (`embedded/job.py`, `megatron_lm/save.py`), the
monitor says each once and keeps them for the run's summary. What differs between the
launchers - how progress is shown, what a failed process or the end means - is theirs, passed
in as the loop's callbacks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..protocol.membership import Membership
from ..protocol.messages import JobError
from .supervisor import TICK_S, Supervised, Supervisor


@dataclass
class Monitor:
    """One launcher's watch over its job."""

    say: Callable[[str], None]
    """A line on the launcher's own output."""
    watch_unsaved: bool
    """Whether the job may publish checkpoints not saved (a save folder and interval; DeadPool
    on, whose ranks publish them)."""
    unsaved: dict[int, str] = field(default_factory=dict)
    """Each checkpoint not saved so far: iteration -> its line (the run's summary lists them)."""

    def show_unsaved(self, membership: Membership) -> None:
        """Say each checkpoint not saved that was not said yet."""
        if not self.watch_unsaved:
            return
        failures = membership.checkpoint_failures()
        for iteration, line in sorted(failures.lines.items()) if failures else ():
            if iteration not in self.unsaved:
                self.unsaved[iteration] = line
                self.say(line)

    def run(
        self,
        job: Supervised,
        *,
        deadline: float,
        finished: Callable[[], int],
        on_failed: Callable[[dict[str, int]], int],
        on_job_error: Callable[[JobError], int],
        on_tick: Callable[[], bool],
        checks: Sequence[Callable[[], int | None]] = (),
        interval_s: float = TICK_S,
        preempt: Callable[[], str | None] = lambda: None,
    ) -> int:
        """Supervise `job` until it ends, or until `deadline` (`time.monotonic()`: exit code
        124); its exit code. The callbacks are `Supervisor`'s."""
        return Supervisor(
            job,
            limit_s=deadline - time.monotonic(),
            say=self.say,
            finished=finished,
            on_failed=on_failed,
            on_job_error=on_job_error,
            on_tick=on_tick,
            checks=checks,
            interval_s=interval_s,
            preempt=preempt,
        ).run()
