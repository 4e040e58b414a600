"""`abort_groups`: make every collective of this process with a dead or hung peer return now.

Called by a survivor as soon as a failure is known - from the thread that caught a failed
collective, or from a watcher thread while the main thread is still blocked in one - and
before anything waits on a transfer or reads a received buffer (`Replicator.abandon`). It
never waits for a peer:

1. gloo: shut down the connections of every gloo group (`devices.gloo`): a collective blocked
   on a dead or SIGSTOPped peer raises at once instead of at the group's timeout;
2. NCCL (and every other group): abort all groups together (`devices.nccl.abort_all`), never
   a graceful destroy; kernels stuck on a dead peer return, the next collective on an
   aborted group raises `DistBackendError`.

Afterwards torch knows no process group; handles still held by Megatron's objects are swapped
for placeholders by `hotswap.rebind.release` and the next generation is created from scratch.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from . import gloo, nccl

log = logging.getLogger(__name__)
_LOCK = threading.Lock()


@dataclass(frozen=True)
class AbortReport:
    """What `abort_groups` did."""

    gloo_connections: int
    """gloo connections shut down."""
    aborted: bool
    """Process groups existed and were aborted."""
    seconds: float


def abort_groups() -> AbortReport:
    """Abort every process group of this process (gloo connections first, then all groups
    together); safe to call twice and from any thread."""
    t0 = time.perf_counter()
    with _LOCK:
        shut = gloo.shutdown_connections()
        aborted = nccl.abort_all()
    report = AbortReport(shut, aborted, time.perf_counter() - t0)
    log.info(
        "aborted process groups in %.3fs (%d gloo connections shut down)",
        report.seconds,
        report.gloo_connections,
    )
    return report
