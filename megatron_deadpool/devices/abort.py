"""`abort_groups`: make every collective of this process with a dead or hung peer return now.

Called by a survivor as soon as a failure is known - from the thread that caught a failed
collective, or (`start_abort`) from the heartbeat thread's plan watch while the main thread is
still blocked in one - and before anything waits on a transfer or reads a received buffer
(`Replicator.abandon`). It never waits for a peer:

1. NCCL (and every other group): abort all groups together (`devices.nccl.abort_all`), never
   a graceful destroy; kernels stuck on a dead peer return, the next collective on an
   aborted group raises `DistBackendError`. First, so that NCCL's own sockets are closed by
   NCCL, not cut under it;
2. gloo: shut down the connections of every gloo group (`devices.gloo`): a collective blocked
   on a dead or SIGSTOPped peer raises at once instead of at the group's timeout (gloo's
   `abort()`, called in step 1, does nothing); in CPU mode a wait on a collective the
   shutdown cannot end (a send under way) raises within `gloo.WAIT_SLICE`.

Afterwards torch knows no process group; handles still held by Megatron's objects are swapped
for placeholders by `hotswap.worker.rebind.release` and the next generation is created from scratch -
unless the groups are repaired in place (`keep_groups(True)`, set by the driver where
`devices.reconfigure` chose the repair, gloo on torch >= 2.14): then step 1 is skipped, the
groups stay known to torch with their connections shut down, and `devices.reconfigure.repair`
reconnects them.

**Off the caller's thread, bounded in time.** The abort always runs on a thread of its own
(``deadpool-abort``): torch aborts an NCCL group on a `std::async` thread that it waits for up
to the group's timeout, and an NCCL abort can hang for good (NVIDIA/nccl#1777, #829). The
heartbeat thread must keep beating meanwhile (`start_abort` returns at once; the plan watch
uses it), and a survivor whose abort hangs must not live on as a process that neither beats
out nor reports: once `bound_aborts(seconds)` is set, an abort still running after that long
ends the process with `ExitCode.ABORT_HUNG` (7) - the launcher sees the exit at once, a
cluster coordinator the heartbeat's silence - and a spare takes the slot. `abort_groups`
starts the abort (or joins the one running) and waits for it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import ExitCode
from . import gloo, nccl
from .threads import start_thread

log = logging.getLogger(__name__)
_LOCK = threading.Lock()  # one abort's work at a time
_START = threading.Lock()  # which run is current


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
    it until `hotswap.worker.rebind.release` swaps it for a placeholder named WORLD."""


_LAST: list[AbortReport] = []


def last_abort() -> AbortReport | None:
    """The latest `abort_groups` report of this process, if any."""
    return _LAST[-1] if _LAST else None


class AbortRun:
    """One abort on the abort thread: `done` is set when it returned (or raised)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.report: AbortReport | None = None
        self.error: BaseException | None = None
        self.started = time.monotonic()

    def result(self) -> AbortReport:
        """Wait for the abort; its report, or its exception re-raised."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.report is not None
        return self.report


_BOUND_S: list[float] = []  # empty: aborts are not bounded (tools, tests)
_CURRENT: list[AbortRun] = []
_COUNT = [0]


def bound_aborts(seconds: float | None) -> None:
    """From now on an abort still running `seconds` after it started ends the process with
    `ExitCode.ABORT_HUNG`; None: unbounded again."""
    _BOUND_S[:] = [] if seconds is None else [float(seconds)]


_KEEP: list[bool] = []  # set: the groups are repaired in place (`devices.reconfigure`)


def keep_groups(keep: bool) -> None:
    """From now on an abort keeps torch's groups (gloo: their connections are shut down, the
    groups stay for `devices.reconfigure.repair`), or (False) forgets them as before."""
    _KEEP[:] = [True] if keep else []


def abort_count() -> int:
    """How many aborts this process started: a caller that posted work on a group compares it
    before and after to learn whether the group was aborted meanwhile."""
    return _COUNT[0]


def start_abort() -> AbortRun:
    """Start an abort of every group on the abort thread, or join the one running; returns at
    once (safe from any thread, the heartbeat's included)."""
    with _START:
        if _CURRENT and not _CURRENT[-1].done.is_set():
            return _CURRENT[-1]
        run = AbortRun()
        _CURRENT[:] = [run]
        _COUNT[0] += 1
        start_thread(_run, run, name="deadpool-abort")
        if _BOUND_S:
            start_thread(_watch, run, _BOUND_S[0], name="deadpool-abort-bound")
        return run


def abort_groups() -> AbortReport:
    """Abort every process group of this process (all groups together, then the gloo
    connections) and wait for it; safe to call twice and from any thread."""
    return start_abort().result()


def _abort_now() -> AbortReport:
    """The abort's work (on the abort thread)."""
    t0 = time.perf_counter()
    with _LOCK:
        world = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        previous = last_abort()
        world_id = id(world) if world is not None else (previous.world_id if previous else None)
        del world
        aborted = bool(_KEEP) and dist.is_initialized()
        if not _KEEP:
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


def _run(run: AbortRun) -> None:
    try:
        run.report = _abort_now()
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the run
        run.error = exc
        log.error("aborting the process groups failed: %s", str(exc).splitlines()[0][:200])
    finally:
        run.done.set()


def _watch(run: AbortRun, bound_s: float) -> None:
    if not run.done.wait(bound_s):
        end_process(
            ExitCode.ABORT_HUNG,
            f"the abort of this process's groups has not returned after {bound_s:g}s "
            "(--deadpool-abort-timeout): ending the process so that a spare takes its slot",
        )


def end_process(code: int, why: str, exit_now: Callable[[int], object] = os._exit) -> None:
    """End this process at once with `code` after saying why (from any thread; no clean-up
    runs: a thread stuck in the CUDA driver or NCCL would hold it up)."""
    try:
        log.critical("%s (exit code %d)", why, code)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        sys.stderr.flush()
    finally:
        exit_now(code)
