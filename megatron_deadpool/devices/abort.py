"""`abort_groups`: make every collective of this process with a dead or hung peer return now.

Called by a survivor as soon as a failure is known - from the thread that caught a failed
collective, or from a watcher thread while the main thread is still blocked in one - and
before anything waits on a transfer or reads a received buffer (`Replicator.abandon`). It
never waits for a peer:

1. NCCL (and every other group): abort all groups together (`devices.nccl.abort_all`), never
   a graceful destroy; kernels stuck on a dead peer return, the next collective on an
   aborted group raises `DistBackendError`. First, so that NCCL's own sockets (recorded with a
   ``cpu:gloo,cuda:nccl`` group's gloo connections) are closed by NCCL, not cut under it;
2. gloo: shut down the connections of every gloo group (`devices.gloo`): a collective blocked
   on a dead or SIGSTOPped peer raises at once instead of at the group's timeout (gloo's
   `abort()`, called in step 1, does nothing).

Afterwards torch knows no process group; handles still held by Megatron's objects are swapped
for placeholders by `hotswap.rebind.release` and the next generation is created from scratch.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

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
    world_id: int | None
    """`id()` of the default group that was aborted: torch forgets it, but objects still hold
    it until `hotswap.rebind.release` swaps it for a placeholder named WORLD."""


_LAST: list[AbortReport] = []


def last_abort() -> AbortReport | None:
    """The latest `abort_groups` report of this process, if any."""
    return _LAST[-1] if _LAST else None


def abort_groups() -> AbortReport:
    """Abort every process group of this process (all groups together, then the gloo
    connections); safe to call twice and from any thread."""
    t0 = time.perf_counter()
    with _LOCK:
        world = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        previous = last_abort()
        world_id = id(world) if world is not None else (previous.world_id if previous else None)
        del world
        aborted = nccl.abort_all()
        shut = gloo.shutdown_connections()
        report = AbortReport(shut, aborted, time.perf_counter() - t0, world_id)
        _LAST[:] = [report]
    log.info(
        "aborted process groups in %.3fs (%d gloo connections shut down)",
        report.seconds,
        report.gloo_connections,
    )
    return report
