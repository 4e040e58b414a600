"""The plan waiter on a real store: a plan's wake-up reaches a survivor's plan watch within a
store round trip and aborts its groups at once; a wake-up of another member does not; `stop`
ends a waiter blocked in the store without waking anyone else's; and the coordinator wakes the
members of its roster as it plans (`tests/hotswap/coordinator/test_decisions.py` drives it).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from decisions_job import Job
from stores import SEAL, TEST_SECRET

from megatron_deadpool.config.deadpool import DeadpoolConfig
from megatron_deadpool.devices.base import Device
from megatron_deadpool.hotswap.protocol.membership import Membership, host_store
from megatron_deadpool.hotswap.protocol.messages import Keys, Plan
from megatron_deadpool.hotswap.worker.driver import Driver
from megatron_deadpool.hotswap.worker.plan_waiter import ROUND_SETTLE_S, PlanStop, PlanWaiter
from megatron_deadpool.hotswap.worker.plan_watch import PlanWatch

PLAN = Plan(generation=1, base=0, world_size=4, dead=(2,), needy=(2,), replaced={2: "s0"})


@pytest.fixture
def coordinator() -> Iterator[Membership]:
    yield Membership(host_store("127.0.0.1", 0), "coordinator", SEAL)


def _member(coordinator: Membership, member: str) -> Membership:
    return coordinator.sibling(coordinator.core.store.clone(), member)


def _until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def _watched(member: Membership) -> tuple[PlanWatch, PlanWaiter, list[float]]:
    """A survivor's plan watch woken by its plan waiter, joined to generation 0."""
    aborts: list[float] = []
    watch = PlanWatch(lambda: aborts.append(time.monotonic()))
    waiter = PlanWaiter(member, functools.partial(watch, at_once=True))
    watch.waiter = waiter
    waiter.start()
    watch.joined(0)
    return watch, waiter, aborts


@pytest.mark.timeout(30)
def test_a_plans_wake_up_aborts_the_groups_at_once(coordinator: Membership) -> None:
    watch, waiter, aborts = _watched(_member(coordinator, "a1"))
    try:
        time.sleep(0.2)  # blocked in the store by now
        t0 = time.monotonic()
        coordinator.publish_plan(PLAN)
        coordinator.wake_plan_waiters([1], ["a0", "a1", "a3"])
        assert _until(lambda: bool(aborts), 5.0), "the wake-up did not reach the plan watch"
        assert aborts[0] - t0 < 1.0 and "a generation after 0" in (watch.fired or "")
        watch.recovering()
        watch.joined(1)  # the waiter now waits for plan 2's wake-up
        time.sleep(0.2)
        assert len(aborts) == 1 and waiter.is_alive()
    finally:
        t0 = time.monotonic()
        waiter.stop()
    assert not waiter.is_alive() and time.monotonic() - t0 < 2.0


@pytest.mark.timeout(30)
def test_a_main_thread_already_recovering_is_left_alone(coordinator: Membership) -> None:
    watch, waiter, aborts = _watched(_member(coordinator, "a1"))
    try:
        watch.recovering()  # it met the failure first
        coordinator.publish_plan(PLAN)
        coordinator.wake_plan_waiters([1], ["a1"])
        time.sleep(0.5)
        assert aborts == [] and watch.fired is None
    finally:
        waiter.stop()


@pytest.mark.timeout(30)
def test_stop_ends_a_blocked_waiter_and_wakes_no_other(coordinator: Membership) -> None:
    _, other, other_aborts = _watched(_member(coordinator, "a0"))
    _, waiter, aborts = _watched(_member(coordinator, "a1"))
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        waiter.stop()
        assert not waiter.is_alive() and time.monotonic() - t0 < 2.0
        coordinator.publish_plan(PLAN)
        coordinator.wake_plan_waiters([1], ["a1"])  # not a0's
        time.sleep(0.3)
        assert other_aborts == [] and other.is_alive() and aborts == []
        assert coordinator.core.present(Keys.PLAN_WAKE.format(g=1, member="a1"))
        assert not coordinator.core.present(Keys.PLAN_WAKE.format(g=1, member="a0"))
    finally:
        other.stop()
    assert not other.is_alive()


@pytest.mark.timeout(30)
def test_a_waiter_stopped_before_it_watched_anything_ends(coordinator: Membership) -> None:
    waiter = PlanWaiter(_member(coordinator, "s0"), lambda m: None)
    waiter.start()
    waiter.stop()
    assert not waiter.is_alive()


def test_the_coordinator_wakes_every_member_of_its_roster_as_it_plans() -> None:
    job = Job(spares=2)
    job.die("a2")
    job.tick()
    assert job.m().plan(1) is not None
    woken = [
        m
        for m in ("a0", "a1", "a2", "a3", "s0", "s1")
        if job.m().core.present(Keys.PLAN_WAKE.format(g=1, member=m))
    ]
    assert woken == ["a0", "a1", "a2", "a3"]  # the roster's members; the spares wait otherwise


def test_a_plan_stops_a_step_in_compute_at_once_and_between_steps_at_the_next_one() -> None:
    stop = PlanStop()
    assert stop.woke(at_once=True) is False  # no step yet (not started, or between steps)
    assert stop.step_begins() is True  # so the next step's start stops it
    assert stop.woke(at_once=True) is True  # in the compute (NCCL): at once, by the abort
    stop.step_ends()
    assert stop.step_begins() is False  # nothing woke it between these steps
    assert stop.woke(at_once=False) is True  # in the compute on gloo: at its next collective
    stop.stop_at_collective("planned")
    assert stop._gate.closed
    stop.step_ends()  # the step ended without another collective: the gate opens ...
    assert not stop._gate.closed
    assert stop.step_begins() is True  # ... and the next step's start stops it
    stop.step_ends()
    stop.stop_at_collective("planned")  # between steps: no gate
    assert not stop._gate.closed
    assert stop.woke(at_once=True) is False and stop.step_begins() is True


def test_a_stop_is_for_the_step_its_plan_woke_in_only() -> None:
    """The waiter's thread may close the gate late - after settling the in-flight round, up to
    `ROUND_SETTLE_S` - when the main thread has recovered and computes a later step: that step's
    collectives must not raise for a plan its recovery already took."""
    stop = PlanStop()
    stop.step_begins()
    assert stop.woke(at_once=False)
    stop.step_ends()  # the step failed (a lost peer's collective): the recovery, then ...
    stop.step_begins()  # ... the next step
    stop.stop_at_collective("planned")
    assert not stop._gate.closed
    stop.step_ends()


def test_a_step_whose_start_raises_leaves_no_compute_behind(coordinator: Membership) -> None:
    """A plan that woke the waiter between steps stops the next step at its start
    (`Driver._begin_step` raises); the step's compute is over then, so a later plan's stop - in
    the recovery, between steps - closes no gate onto the recovery's own collectives."""
    driver = Driver(
        DeadpoolConfig(), Device("cpu", "gloo"), coordinator="-", token=TEST_SECRET, member="a0"
    )
    driver._membership = Membership(coordinator.store.clone(), "a0", SEAL)
    driver.plan_watch.joined(0)
    coordinator.publish_plan(PLAN)
    # torch's TCPStore answers no set: a read on the same connection is answered once the plan is
    # in, before which the driver's connection could still read no plan (a machine under load).
    assert coordinator.latest_plan() == PLAN.generation
    assert driver._plan_stop.woke(at_once=False) is False  # between steps
    planned = pytest.raises(dist.DistBackendError, match="a recovery was planned before step 3")
    with planned, driver.step(3):
        pass
    assert driver._plan_stop.woke(at_once=False) is False  # not in a step's compute
    driver._plan_stop.stop_at_collective("planned")
    assert not driver._plan_stop._gate.closed


def test_a_plan_in_a_gloo_steps_compute_stops_it_before_its_next_collective() -> None:
    """The main thread in a step's compute on gloo: `stop_at_collective` (the waiter's thread)
    makes its next collective raise the error of a lost peer's, before anything is started."""
    stop = PlanStop()
    stop.step_begins()
    assert stop.woke(at_once=False)
    waiter = threading.Thread(target=stop.stop_at_collective, args=("a recovery was planned",))
    waiter.start()
    waiter.join(60)
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(dist.DistBackendError, match="a recovery was planned: stopped before"):
            dist.all_reduce(torch.ones(1))
        dist.all_reduce(torch.ones(1))  # once
    finally:
        stop.step_ends()
        if ours:
            dist.destroy_process_group()


def test_stop_aborts_on_nccl_and_gates_the_next_collective_on_gloo_while_the_plan_stands(
    coordinator: Membership,
) -> None:
    """What the driver calls as the plan waiter wakes (`Driver._on_plan_wake`), in a step's
    compute: the plan watch's abort at once on NCCL; on gloo the gate, unless no plan after the
    joined generation stands (the main thread recovering already, say)."""
    aborts: list[int] = []
    watch = PlanWatch(lambda: aborts.append(1))
    watch.joined(0)
    stop = PlanStop()
    stop.step_begins()
    stop.stop(False, None, watch, coordinator)  # no plan yet: nothing
    assert not stop._gate.closed and aborts == []
    coordinator.publish_plan(PLAN)
    stop.stop(False, None, watch, coordinator)  # gloo
    assert stop._gate.closed and aborts == []
    stop.step_ends()
    stop.step_begins()
    stop.stop(True, None, watch, coordinator)  # NCCL
    assert aborts == [1] and not stop._gate.closed
    stop.step_ends()


def test_settle_waits_for_the_round_in_flight_at_most_its_bound() -> None:
    waits: list[float] = []

    class Round:
        def wait_in_flight(self, timeout_s: float) -> bool:
            waits.append(timeout_s)
            return False

    PlanStop().settle(Round())
    PlanStop().settle(None)
    assert waits == [ROUND_SETTLE_S]


def test_planned_after_is_a_plan_past_the_joined_generation(coordinator: Membership) -> None:
    """What the driver reads at a step's start before it raises (`Driver._begin_step`)."""
    watch = PlanWatch(lambda: None)
    assert not watch.planned_after(coordinator)  # nothing joined
    watch.joined(0)
    assert not watch.planned_after(coordinator)
    coordinator.publish_plan(PLAN)
    assert watch.planned_after(coordinator)
    watch.recovering()
    assert not watch.planned_after(coordinator)
    watch.joined(1)
    assert not watch.planned_after(coordinator)
