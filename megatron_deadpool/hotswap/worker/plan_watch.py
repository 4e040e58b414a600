"""Aborting a survivor's groups as soon as the coordinator plans a recovery.

A survivor blocked in a collective with a frozen peer (SIGSTOP, a hung GPU, a node that stops
answering without closing its sockets) would otherwise wait for the process group's timeout
(`--deadpool-pg-timeout`): no error reaches it, so it never enters recovery, and the
coordinator's plan waits for its report until the agreement timeout presumes it dead too. The
coordinator names the frozen rank dead after the heartbeat timeout and publishes the plan of the
next generation; `PlanWatch`, run on the heartbeat thread after each beat (one read of the
latest planned generation per beat), sees it while this rank is still in the old generation and
not recovering yet, and - if the main thread has still not entered recovery one beat later (it
is blocked: a main thread that is not would have met the failed collective by then and recovered
by itself) -
calls `devices.abort_groups`: the blocked collective raises at once, the main thread enters
recovery, and the driver takes any error of that step for the failure it recovers from
(`Driver.is_peer_failure`). Waiting that beat keeps the abort from landing on a main thread
that is between collectives, in code that would not expect torch's groups to vanish. After
training completed the same holds for the coordinator's end report (a peer lost in the job's
final work: its last barrier, the final save).

A survivor that is not blocked is stopped sooner on NCCL: its plan waiter (`plan_waiter.py`)
wakes the moment the plan appears and calls the watch `at_once`, which aborts without that beat -
a crash's survivors that share no collective with the dead rank before the gradient sync would
otherwise compute on to it (on gloo the waiter stops them before their next collective call
instead, `plan_waiter.PlanStop`). Every code path of the main thread already meets an abort
wherever it lands (the beat makes that less likely, not impossible): any error after it is
taken for the failure (`Driver.is_peer_failure`), between steps too
(`megatron_lm.hooks.wrap_between_steps`).
The heartbeat's look stays: it catches a plan the waiter missed (its store connection lost).

On NCCL a collective that failed or timed out does not raise either (blocking wait is off): its
backend only records the error (`devices.nccl.backend_errors`, polled here through `errors`),
and the main thread waits behind the failed kernel. That is the second reason to abort: the main
thread then raises and recovers like any survivor whose collective failed.

The abort is only started here (`devices.abort.start_abort`): it runs on a thread of its own,
bounded by `--deadpool-abort-timeout`, and the heartbeat thread that called the watch goes on
beating meanwhile - a slow abort does not get the survivor named dead, and a hung one ends the
process (exit code 7) instead of turning it into a zombie.

A main thread that has still not entered recovery `STUCK_S` seconds after the abort is stuck
where aborting its groups did not reach (seen once in CI: a survivor whose log ends with its
groups aborted; seen again: its main thread in a tensor-parallel all-reduce of Megatron's
backward, no gloo connection left to shut down - a send under way, which gloo neither completes
nor fails; in CPU mode a collective's wait now ends anyway, `devices.gloo.interruptible_waits`):
the watch then writes the process's open TCP connections and every thread's stack to standard
error, once, so that the rank's log says where it waits and on what.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Protocol

from ...devices.gloo import connections
from ..protocol.worker_view import WorkerView

log = logging.getLogger(__name__)

STUCK_S = 30.0
"""Seconds after the abort within which the main thread should have entered recovery (a
collective of an aborted group raises at once; a slow host may take some seconds); past
them every thread's stack goes to the log."""


class Waiter(Protocol):
    """What wakes the watch as the next generation's plan appears (`plan_waiter.PlanWaiter`)."""

    def watch(self, generation: int) -> None: ...


class PlanWatch:
    """Calls `abort` once when a plan for a generation after this rank's appears while this
    rank is not recovering (or, after training completed, when the end report appears; or
    when `errors` reports a failed collective of this rank), one beat after it first saw it.

    The driver brackets its own recovery with `recovering()` / `joined(generation)`; the
    checks and the abort hold one lock with them, so that no abort can hit the groups of a
    generation the main thread already joined."""

    def __init__(
        self,
        abort: Callable[[], object],
        errors: Callable[[], list[str]] | None = None,
        stuck_s: float = STUCK_S,
    ) -> None:
        """`abort()` starts the abort and returns at once (`devices.abort.start_abort`);
        `errors()` lists this rank's failed collectives nothing raised (NCCL); `stuck_s`:
        `STUCK_S`."""
        self._abort = abort
        self._errors = errors
        self._stuck_s = stuck_s
        self._fired_at = 0.0
        self._stacks_shown = False
        self._lock = threading.Lock()
        self._generation: int | None = None  # None: no groups to abort (not joined, recovering)
        self._after_training = False
        self._noticed: str | None = None  # seen one beat ago, not acted on yet
        self.fired: str | None = None  # why the groups were aborted in this generation
        self.waiter: Waiter | None = None  # wakes the watch as a plan appears (`plan_waiter`)

    def joined(self, generation: int) -> None:
        """The main thread joined `generation`: watch for the next one's plan."""
        with self._lock:
            self._generation, self._noticed, self.fired = generation, None, None
            self._stacks_shown = False
        if self.waiter is not None:
            self.waiter.watch(generation)

    def planned_after(self, membership: WorkerView) -> bool:
        """Whether a generation after the one the main thread joined is planned (one read)."""
        g = self._generation
        return g is not None and membership.latest_plan() > g

    def recovering(self) -> None:
        """The main thread releases the groups itself: nothing to watch until it joins."""
        with self._lock:
            self._generation = None

    def training_completed(self) -> None:
        """From now on a lost peer ends the job's final work: watch for the end report."""
        with self._lock:
            self._after_training = True

    def __call__(self, membership: WorkerView, at_once: bool = False) -> None:
        """One look (on the heartbeat thread, or with `at_once` on the plan waiter's: a plan
        aborts without the beat's grace; each with its own store connection)."""
        g, after_training = self._generation, self._after_training
        if g is None:
            return
        if self.fired is not None:
            self._show_stacks_if_stuck()
            return
        why, kind = None, None
        if membership.latest_plan() > g:
            why, kind = f"the coordinator planned a generation after {g} (a peer failed)", "plan"
        elif after_training and membership.end() is not None:
            why, kind = "the coordinator reported a peer lost after training completed", "end"
        elif self._errors is not None and (failed := self._errors()):
            why, kind = f"a collective of this rank failed ({', '.join(failed[:3])})", "error"
        if kind is None or (kind != self._noticed and not (at_once and kind == "plan")):
            self._noticed = kind  # the main thread gets one beat to get there first
            return
        with self._lock:
            if self._generation != g or self.fired is not None:
                return  # the main thread got there first
            self.fired, self._fired_at = why, time.monotonic()
            log.warning("%s: aborting this rank's process groups", why)
            self._abort()

    def _show_stacks_if_stuck(self) -> None:
        """Once per generation: every thread's stack on standard error, if the main thread has
        not entered recovery `stuck_s` seconds after the abort."""
        if self._stacks_shown or time.monotonic() - self._fired_at < self._stuck_s:
            return
        self._stacks_shown = True
        open_now = connections()
        log.error(
            "the main thread has not entered recovery %.0fs after this rank's process groups "
            "were aborted; its TCP connections still open (local port -> peer), the store's "
            "included: %s; every thread's stack follows",
            time.monotonic() - self._fired_at,
            ", ".join(open_now) or "none",
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        # The main thread's first: faulthandler writes at most 100 threads, newest first, so in
        # a process with more (data loaders, pools) the oldest - the main thread - is cut off.
        main = sys._current_frames().get(threading.main_thread().ident or -1)
        if main is not None:
            stack = "".join(traceback.format_stack(main))
            sys.stderr.write(f"Main thread (most recent call last):\n{stack}\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
