"""A newcomer's claim of its slot (`newcomer_claim.claim`, `Driver.take_slot`'s first step once
its objects are built), against an in-memory store: claimed; given up first by the coordinator
(an error: it took this process for lost); moved on - the generation will not be joined, a newer
plan came first - it waits for the next generation's roster and claims its slot there, or leaves
with exit code 0 when the job ended meanwhile. And a survivor that the plan counts as a newcomer
(it restored as one too late for the plan to see) claims its slot as it agrees
(`Recovery.agree`). (The coordinator's side: `test_decisions.py`.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from stores import SEAL, TEST_SECRET

from megatron_deadpool.config.deadpool import DeadpoolConfig
from megatron_deadpool.devices.base import Device
from megatron_deadpool.errors import DeadpoolRuntimeError
from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.hotswap.protocol.messages import Decision, Plan, Roster
from megatron_deadpool.hotswap.worker.driver import Driver
from megatron_deadpool.hotswap.worker.injection import FaultInjector
from megatron_deadpool.hotswap.worker.recovery import Recovery

FIRST = Roster(1, 4, {0: "a0", 1: "s0", 2: "a2", 3: "s1"}, restore_iteration=4)


def _newcomer() -> tuple[Driver, Membership]:
    """Spare s0, given rank 1 by generation 1's roster; and the coordinator's side."""
    store = MemoryStore()
    coordinator = Membership(store.clone(), "coordinator", SEAL)
    coordinator.publish_roster(FIRST)
    driver = Driver(
        DeadpoolConfig(), Device("cpu", "gloo"), coordinator="-", token=TEST_SECRET, member="s0"
    )
    driver._membership = membership = Membership(store.clone(), "s0", SEAL)  # as `connect`
    driver._faults = FaultInjector([], membership)
    driver._take(FIRST)
    return driver, coordinator


def _soon(action: Callable[[], None]) -> None:
    """The coordinator acts while the newcomer waits (its wait holds the main thread: SIGTERM)."""
    threading.Timer(0.3, action).start()


@pytest.mark.timeout(30)
def test_a_claim_before_the_coordinator_settles_the_slot_joins_that_generation() -> None:
    driver, coordinator = _newcomer()
    assert driver._claim(FIRST) == FIRST
    coordinator.give_up_slot(1, 1)  # too late: the claim stands
    assert coordinator.wait_newcomers(1, [1], 0.0) is True


@pytest.mark.timeout(30)
def test_a_slot_given_up_first_is_an_error_naming_it() -> None:
    driver, coordinator = _newcomer()
    coordinator.give_up_slot(1, 1)
    with pytest.raises(DeadpoolRuntimeError, match="gave up rank 1 of generation 1"):
        driver._claim(FIRST)


@pytest.mark.timeout(30)
def test_a_slot_moved_on_is_claimed_in_the_next_generation() -> None:
    driver, coordinator = _newcomer()
    coordinator.move_slot_on(1, 1)  # s1 was lost: generation 2 replaces it, s0 keeps rank 1
    second = Roster(2, 4, {0: "a0", 1: "s0", 2: "a2", 3: "s2"}, restore_iteration=4)
    _soon(lambda: coordinator.publish_roster(second))
    assert driver._claim(FIRST) == second
    assert driver.generation == 2 and driver.rank == 1
    assert coordinator.wait_newcomers(2, [1], 0.0) is True


@pytest.mark.timeout(30)
def test_a_slot_moved_on_when_the_job_ends_leaves_with_code_0() -> None:
    driver, coordinator = _newcomer()
    coordinator.move_slot_on(1, 1)
    _soon(coordinator.request_shutdown)  # out of redundancy: the job ends
    with pytest.raises(SystemExit) as left:
        driver._claim(FIRST)
    assert left.value.code == 0


@pytest.mark.timeout(30)
def test_a_next_generation_at_another_iteration_is_an_error() -> None:
    """Its objects were built for the restore iteration of generation 1 (Megatron-LM's newcomer
    aims at the step the survivors resume at): another one is refused, not trained from."""
    driver, coordinator = _newcomer()
    coordinator.move_slot_on(1, 1)
    second = Roster(2, 4, {0: "a0", 1: "s0", 2: "a2", 3: "s2"}, restore_iteration=3)
    _soon(lambda: coordinator.publish_roster(second))
    with pytest.raises(DeadpoolRuntimeError, match="rank 1 at iteration 3, not rank 1 at 4"):
        driver._claim(FIRST)


def _survivor_counted_as_newcomer(coordinator: Membership) -> tuple[Recovery, Plan]:
    """s0 restored as generation 1's newcomer for rank 1 just after the coordinator read the
    stamps for plan 2 (a3 died): plan 2 still counts rank 1 as a newcomer; s0 met the failure
    in training, as a survivor."""
    steps = Recovery(Membership(coordinator.store.clone(), "s0", SEAL), "s0", 1, FIRST, None)
    plan = Plan(generation=2, base=1, world_size=4, dead=(3,), needy=(1, 3), replaced={3: "s2"})
    coordinator.publish_plan(plan)
    return steps, plan


def _agree(steps: Recovery) -> Roster:
    return steps.agree(
        {},
        last_completed=4,
        deadline=time.time() + 20,
        cause=RuntimeError("peer died"),
        salvage_target=lambda t: (None, None),
    )


@pytest.mark.timeout(30)
def test_a_survivor_the_plan_counts_as_a_newcomer_claims_its_slot_and_restores_from_a_holder() -> (
    None
):
    """Without its claim the other survivors would wait for it in `wait_newcomers` for ever
    (as in CI: a death right after a recovery's newcomer restored)."""
    coordinator = Membership(MemoryStore(), "coordinator", SEAL)
    steps, plan = _survivor_counted_as_newcomer(coordinator)
    coordinator.decide(2, Decision.roster(4))
    Membership(coordinator.store.clone(), "s2", SEAL).claim_slot(2, 3)
    roster = _agree(steps)
    assert roster.generation == 2 and roster.rank_of("s0") == 1
    assert steps.needy  # `Driver.recover` restores its shard from the holder
    assert coordinator.wait_newcomers(2, plan.needy, 0.0) is True


@pytest.mark.timeout(30)
def test_a_survivor_counted_as_a_newcomer_whose_slot_moved_on_claims_it_in_the_next_plan() -> None:
    coordinator = Membership(MemoryStore(), "coordinator", SEAL)
    steps, _ = _survivor_counted_as_newcomer(coordinator)
    coordinator.decide(2, Decision.roster(4))
    coordinator.move_slot_on(2, 1)  # s2 lost before its claim: plan 3 replaces it with s3
    coordinator.give_up_slot(2, 3)
    third = Plan(generation=3, base=1, world_size=4, dead=(3,), needy=(1, 3), replaced={3: "s3"})
    coordinator.publish_plan(third)
    coordinator.decide(3, Decision.roster(4))
    Membership(coordinator.store.clone(), "s3", SEAL).claim_slot(3, 3)
    roster = _agree(steps)
    assert roster.generation == 3 and roster.slots == {0: "a0", 1: "s0", 2: "a2", 3: "s3"}
    assert steps.needy and coordinator.wait_newcomers(3, [1, 3], 0.0) is True


ZERO = Roster(0, 4, {0: "a0", 1: "a1", 2: "a2", 3: "a3"}, restore_iteration=None)
PLAN = Plan(generation=1, base=0, world_size=4, dead=(1,), needy=(1,), replaced={1: "s0"})


def _spare(store: MemoryStore) -> Driver:
    """Spare s0's driver, connected to `store`."""
    driver = Driver(
        DeadpoolConfig(), Device("cpu", "gloo"), coordinator="-", token=TEST_SECRET, member="s0"
    )
    driver._membership = membership = Membership(store.clone(), "s0", SEAL)  # as `connect`
    driver._faults = FaultInjector([], membership)
    return driver


def _planned() -> tuple[Driver, Membership]:
    """Spare s0 waiting, generation 0's roster out, plan 1 naming it for rank 1 (a1 died): the
    survivors have not agreed yet."""
    store = MemoryStore()
    coordinator = Membership(store.clone(), "coordinator", SEAL)
    coordinator.publish_roster(ZERO)
    coordinator.publish_plan(PLAN)
    return _spare(store), coordinator


@pytest.mark.timeout(30)
def test_a_spare_whose_job_builds_its_own_objects_starts_at_the_plan_and_joins_the_agreed_roster() -> (
    None
):
    """`Driver.start` with `owns_start_up`: the wait for a slot ends at the plan (its start-up runs
    while the survivors agree); `agreed_slot`, where the start-up first needs the restore
    iteration, waits for the roster the survivors agreed on. A spare of a job the driver builds
    waits for the roster itself (its head start builds beside the wait)."""
    driver, coordinator = _planned()
    planned = driver.wait_for_slot(planned=True)
    assert planned is not None and planned.restore_iteration is None
    assert (planned.generation, driver.rank, driver.generation) == (1, 1, 1)
    agreed = Roster(1, 4, {0: "a0", 1: "s0", 2: "a2", 3: "a3"}, restore_iteration=4)
    _soon(lambda: coordinator.publish_roster(agreed))
    t0 = time.monotonic()
    assert driver.agreed_slot(planned) == agreed == driver.roster
    assert time.monotonic() - t0 > 0.2  # it waited for the agreement
    assert driver.agreed_slot(agreed) == agreed  # agreed already: at once
    driver, coordinator = _planned()
    _soon(lambda: coordinator.publish_roster(agreed))
    t0 = time.monotonic()
    assert driver.wait_for_slot() == agreed and time.monotonic() - t0 > 0.2


@pytest.mark.timeout(30)
def test_a_plan_superseded_before_the_agreement_joins_the_later_roster_at_the_same_rank() -> None:
    """a3 died too before the survivors agreed: plan 2 keeps s0 on rank 1 (a plan keeps the
    slots it gave), and the start-up begun for plan 1 joins generation 2."""
    driver, coordinator = _planned()
    planned = driver.wait_for_slot(planned=True)
    assert planned is not None
    second = Roster(2, 4, {0: "a0", 1: "s0", 2: "a2", 3: "s1"}, restore_iteration=4)
    _soon(lambda: coordinator.publish_roster(second))
    assert driver.agreed_slot(planned) == second and driver.generation == 2


@pytest.mark.timeout(30)
def test_a_later_roster_with_another_rank_is_an_error_and_the_end_of_the_job_leaves_with_0() -> (
    None
):
    driver, coordinator = _planned()
    planned = driver.wait_for_slot(planned=True)
    assert planned is not None
    moved = Roster(2, 4, {0: "a0", 1: "a1", 2: "a2", 3: "s0"}, restore_iteration=4)
    _soon(lambda: coordinator.publish_roster(moved))
    with pytest.raises(DeadpoolRuntimeError, match="rank 3 at iteration 4, not rank 1"):
        driver.agreed_slot(planned)
    driver, coordinator = _planned()
    planned = driver.wait_for_slot(planned=True)
    assert planned is not None
    _soon(coordinator.request_shutdown)  # out of redundancy before the agreement
    with pytest.raises(SystemExit) as left:
        driver.agreed_slot(planned)
    assert left.value.code == 0


@pytest.mark.timeout(30)
def test_a_newcomer_a_later_plan_names_no_more_before_the_agreement_stops_with_an_error() -> None:
    """Its heartbeat was late (a CPU-bound start-up): the coordinator took it for lost and plan 2
    gives rank 1 to s1. It must not wait for a roster that never names it, holding its build."""
    driver, coordinator = _planned()
    planned = driver.wait_for_slot(planned=True)
    assert planned is not None
    second = Plan(generation=2, base=0, world_size=4, dead=(1,), needy=(1,), replaced={1: "s1"})
    _soon(lambda: coordinator.publish_plan(second))
    with pytest.raises(DeadpoolRuntimeError, match="plan 2 gave rank 1 to another process"):
        driver.agreed_slot(planned)
