"""A survivor stopped the moment the coordinator plans a recovery, not at its next collective
with the dead rank.

After a crash only the ranks that share a collective with the dead one meet the failure at once;
a survivor with none to share before the data-parallel gradient sync computes on to it - most of
an iteration (seconds at scale), with the CPU or GPU a newcomer's build could use - and the
agreement waits for its report. The heartbeat's plan watch (`plan_watch.py`) would stop it only
two beats after the plan. `PlanWaiter` is a thread on a store connection of its own that blocks
on this member's wake-up key of the generation after the one it joined (`Keys.PLAN_WAKE`, which
the coordinator sets for every member of that roster right after it publishes a plan); when the
key appears it calls the driver (`Driver._on_plan_wake`), which - the main thread in a step's
compute (`PlanStop`) - on NCCL runs the plan watch at once (`PlanWatch.__call__(...,
at_once=True)`): it aborts this rank's groups unless the main thread entered recovery first; on
gloo the main thread raises at its next collective call (`devices.collective_gate`). Between
steps the stop waits for the next step's start: a survivor behind the dead rank may still
complete the step whose optimizer step it has done (its replication round: the replicas of that
iteration), which an abort would cost it - one more iteration recomputed by everyone.
`deadpool bench plan-wake` measures the wake-up at 1,024-16,384 ranks.

One wait per generation joined: `watch(generation)` (the driver, as it joins) names the next key;
after a wake-up the thread waits for the next `watch`. A repair of the groups in place for
generation g calls `watch(g)` too (`group_repair.InPlace.on_repair`): plan g+1 - a member lost
during the repair - then abandons the repair at once instead of a beat later. `stop()` sets the
key it blocks on itself (no other process waits there), so that it never returns from torch
while the interpreter shuts down. A lost store connection (the coordinator's host gone: its
standby takes over) ends the thread; the heartbeat's plan watch still sees plans, a beat later.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from ...devices.collective_gate import CollectiveGate
from ...devices.threads import DeviceThread, select_rank_device
from ..protocol.connection import STORE_ERRORS
from ..protocol.wakeup import BLOCK_S, own_connection
from ..protocol.worker_view import WorkerView
from .plan_watch import PlanWatch

log = logging.getLogger(__name__)

ROUND_SETTLE_S = 1.0
"""Longest wait, after a plan woke a survivor in a step's compute, for its in-flight round's
transfers to end before its groups are aborted (a transfer with a dead peer fails at once on
gloo; on NCCL it ends only with the abort)."""


class InFlight(Protocol):
    """A replication round that may be in flight (`replication.replicator.Replicator`)."""

    def wait_in_flight(self, timeout_s: float) -> bool: ...


class PlanStop:
    """Where a plan that woke the plan waiter stops the main thread: in a step's compute (`woke`
    says so), at once - by the abort where the device's abort ends a collective under way cleanly
    (NCCL: `ncclCommAbort` ends the kernels of every operation under way, the plan watch's abort
    of a hung peer's survivors relies on it), else before its next collective call
    (`stop_at_collective`, gloo: an abort in the middle of a collective with live peers can leave
    a send under way that gloo neither completes nor fails, `devices/gloo.py`); between steps, at
    the next step's start (`step_begins`: the driver raises a peer failure there, before any
    collective of the step, and the recovery aborts the groups) - a survivor behind the dead rank
    may still complete the step whose optimizer step it has done. The driver marks the steps
    (`step_begins`, `step_ends`).

    Measured on gloo (`deadpool bench recovery`, 12 runs a side): a crash's survivors that
    share no collective with the dead rank before the gradient sync computed on to it, and the
    agreement waited for them (median 63 ms); stopped before their next tensor-parallel
    collective, they report within milliseconds of the plan (agreement 25 ms). The hot swap as a
    whole was not shorter there (inside its spread): the survivors then wait for the newcomer's
    build instead (`newcomers_claimed_s` of the recovery's record)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._computing: int | None = None  # the thread in a step's compute
        self._steps = 0  # the steps' computes begun: a stop is for the one its plan woke in
        self._woke_in: int | None = None
        self._at_next_step = False
        self._gate = CollectiveGate()

    def woke(self, at_once: bool) -> bool:
        """(The waiter's thread) a plan appeared: whether the main thread is in a step's compute,
        where it is stopped at once - by the abort (`at_once`) or, after `settle`, at its next
        collective (`stop_at_collective`) -, else at the next step's start."""
        with self._lock:
            self._at_next_step = not (self._computing is not None and at_once)
            self._woke_in = self._steps if self._computing is not None else None
            return self._computing is not None

    def settle(self, replicator: InFlight | None) -> None:
        """Before stopping now: wait until the in-flight round's transfers ended (at most
        `ROUND_SETTLE_S`), so that `abandon` keeps the replicas that arrived."""
        if replicator is not None and not replicator.wait_in_flight(ROUND_SETTLE_S):
            log.info("the in-flight round did not end within %gs of the plan", ROUND_SETTLE_S)

    def stop(
        self, at_once: bool, replicator: InFlight | None, watch: PlanWatch, membership: WorkerView
    ) -> None:
        """(The waiter's thread) a plan appeared: in a step's compute (`woke`), once the
        in-flight round's transfers ended (`settle`: the replicas that arrived are kept), on
        NCCL (`at_once`) the plan watch at once (it aborts the groups), on gloo a peer failure
        at the main thread's next collective (`stop_at_collective`, while the plan stands);
        else at the next step's start."""
        if not self.woke(at_once):
            return
        self.settle(replicator)
        if at_once:
            watch(membership, at_once=True)
        elif watch.planned_after(membership):
            self.stop_at_collective("a recovery was planned during this step")

    def stop_at_collective(self, why: str) -> None:
        """(The waiter's thread) the main thread, if still in the compute of the step the plan
        woke it in (`woke`: not a later step's - the plan's recovery may be over by now), raises
        a peer failure (`why`) at its next collective call instead of starting it
        (`CollectiveGate`)."""
        with self._lock:
            if self._computing is not None and self._woke_in == self._steps:
                self._gate.close(self._computing, why)

    def step_begins(self) -> bool:
        """(The main thread) a step's compute begins: whether a plan woke the waiter since the
        last step's compute ended (stop now)."""
        with self._lock:
            planned, self._at_next_step = self._at_next_step, False
            self._computing = threading.get_ident()
            self._steps += 1
            return planned

    def step_ends(self) -> None:
        """(The main thread) the step's compute ended (or failed)."""
        with self._lock:
            self._computing = None
            if self._gate.closed:
                self._gate.open()


class PlanWaiter(DeviceThread):
    """Calls `on_plan(membership)` (on its own connection) each time the plan of the generation
    after the one named by `watch` appears."""

    def __init__(self, membership: WorkerView, on_plan: Callable[[WorkerView], None]) -> None:
        """`membership`: this member's view (the thread blocks on a connection of its own;
        `stop` sets the key through `membership`'s)."""
        super().__init__(name="deadpool-plan-waiter", daemon=True)
        self._waker = membership
        self.membership = own_connection(membership)
        self.on_plan = on_plan
        self._cond = threading.Condition()
        self._next: int | None = None  # the generation whose wake-up to wait for next
        self._blocked_on: int | None = None
        self._stopping = False
        self.lost: str | None = None  # why the store connection failed, if it did

    def watch(self, generation: int) -> None:
        """This process joined `generation`, or repairs its groups for it: wait for the next
        one's plan (once: not again while already waiting for it)."""
        with self._cond:
            if self._blocked_on != generation + 1:
                self._next = generation + 1
                self._cond.notify()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread: set the key it blocks on, and wait for it."""
        with self._cond:
            self._stopping = True
            blocked_on = self._blocked_on
            self._cond.notify()
        if blocked_on is not None and self.lost is None:
            try:
                self._waker.wake_plan_waiter(blocked_on)
            except STORE_ERRORS:  # the store is gone: the blocked call fails on its own
                pass
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout_s)

    def run(self) -> None:
        while True:
            with self._cond:
                while self._next is None and not self._stopping:
                    self._cond.wait()
                if self._stopping or self._next is None:
                    return
                generation, self._next = self._next, None
                self._blocked_on = generation
            try:
                woke = self.membership.wait_plan_wake(generation, BLOCK_S)
            except STORE_ERRORS as exc:  # the store is gone
                self.lost = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                log.info("the plan waiter lost its store connection (%s)", self.lost)
                return
            with self._cond:
                self._blocked_on = None
                if self._stopping:
                    return
                if not woke and self._next is None:
                    self._next = generation  # a day without a plan: wait again
            if woke:
                self._on_plan()

    def _on_plan(self) -> None:
        """Run `on_plan`; an error is logged (the heartbeat's plan watch still looks)."""
        select_rank_device()  # known by now, if not when the thread started
        try:
            self.on_plan(self.membership)
        except Exception as exc:  # noqa: BLE001 - the heartbeat's watch is the fallback
            log.error("after a plan's wake-up: %s", str(exc).splitlines()[0][:200])
