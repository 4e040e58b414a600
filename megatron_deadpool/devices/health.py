"""Whether this process's GPU still completes work: what a heartbeat alone cannot tell.

A heartbeat proves that a Python thread lives. A hung GPU (an Xid), or kernels spinning on a
broken NVLink or InfiniBand link, kills no process: the heartbeat thread goes on beating while
the main thread waits for ever in the next `.item()`. Two signals cover it, polled by the
heartbeat thread after each beat (CUDA only; the thread selects the rank's GPU first,
`devices.threads`):

- **the NCCL backends' error state** (`devices.nccl.backend_errors`, read by
  `hotswap.worker.plan_watch`): a collective of this rank timed out or failed. The plan watch aborts
  this rank's groups, so that its main thread raises and recovers like a survivor whose
  collective failed (its recovery reports the failure to the coordinator).
- **the step's event** (`DeviceWatch`): after every step the main thread records a CUDA event
  on its stream (`step_done`); one still not completed `stall_after` seconds after it was
  recorded means this GPU has not finished work the host gave it that long ago. `stall_after`
  is the process-group timeout plus the heartbeat timeout: a survivor whose step waits for a
  hung peer's collective sees that collective time out after the process-group timeout
  (watchdog, `get_error()` TIMEOUT), the plan watch aborts its groups within two beats and its
  kernels return - its event completes well inside the extra heartbeat timeout - while a GPU
  that completes nothing stays behind. That process then ends with `ExitCode.DEVICE_FAULT` (8):
  the launcher sees the exit, a cluster coordinator the heartbeat's silence, and a spare takes
  the slot. A CUDA error raised by the query (a failed context: ECC, the GPU fell off the bus)
  ends it the same way at once.

What stays unverified without a GPU: that a real Xid or link fault shows up this way (the
events and the watchdog's TIMEOUT are torch's documented behaviour; the first-contact suite
times a stalled event and the exit on one GPU).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import ExitCode
from .abort import end_process

log = logging.getLogger(__name__)


class DeviceWatch:
    """The step's event check of one process (module docstring)."""

    def __init__(
        self,
        stall_after_s: float,
        *,
        new_event: Callable[[], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        end: Callable[[int, str], object] = end_process,
    ) -> None:
        """`new_event()` returns an event recorded on the current stream now (default: a
        `torch.cuda.Event` recorded); `end(code, why)` ends the process."""
        self.stall_after_s = stall_after_s
        self._new_event = new_event or _recorded_cuda_event
        self._clock = clock
        self._end = end
        self._lock = threading.Lock()
        self._last: tuple[Any, float, int] | None = None  # (event, recorded at, step)

    def step_done(self, step: int) -> None:
        """Main thread, after step `step`: record the event the heartbeat thread checks."""
        event = self._new_event()
        with self._lock:
            self._last = (event, self._clock(), step)

    def check(self) -> str | None:
        """Why this GPU is considered hung or failed, or None (heartbeat thread)."""
        with self._lock:
            last = self._last
        if last is None:
            return None
        event, recorded, step = last
        try:
            done = bool(event.query())
        except RuntimeError as exc:  # a CUDA error: the context failed
            return f"the GPU failed: {str(exc).splitlines()[0][:160]}"
        if done:
            with self._lock:
                if self._last is last:
                    self._last = None  # nothing to watch until the next step
            return None
        age = self._clock() - recorded
        if age > self.stall_after_s:
            return (
                f"step {step}'s work has not completed on the GPU {age:.0f}s after it was "
                f"queued (bound {self.stall_after_s:g}s: process-group timeout + heartbeat "
                "timeout)"
            )
        return None

    def __call__(self, membership: object = None) -> None:
        """After a beat: end the process when `check` finds the GPU hung or failed."""
        why = self.check()
        if why is not None:
            self._end(ExitCode.DEVICE_FAULT, why + ": ending the process so a spare takes its slot")


def _recorded_cuda_event() -> Any:
    import torch

    event = torch.cuda.Event()
    event.record()
    return event
