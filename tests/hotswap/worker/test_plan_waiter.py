"""The plan waiter on a real store: a plan's wake-up reaches a survivor's plan watch within a
store round trip and aborts its groups at once; a wake-up of another member does not; `stop`
ends a waiter blocked in the store without waking anyone else's; and the coordinator wakes the
members of its roster as it plans (`tests/hotswap/coordinator/test_decisions.py` drives it).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator

import pytest
from decisions_job import Job
from stores import SEAL

from megatron_deadpool.hotswap.protocol.membership import Membership, host_store
from megatron_deadpool.hotswap.protocol.messages import Keys, Plan
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
    assert stop.woke(at_once=True) is True  # in the compute (NCCL): at once
    stop.step_ends()
    assert stop.step_begins() is False  # nothing woke it between these steps
    assert stop.woke(at_once=False) is False  # in the compute on gloo: not at once
    stop.step_ends()
    assert stop.step_begins() is True  # but at the next step's start
    stop.step_ends()
    assert stop.woke(at_once=True) is False and stop.step_begins() is True


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
