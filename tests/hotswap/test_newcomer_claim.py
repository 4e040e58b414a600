"""A newcomer's claim of its slot (`newcomer_claim.claim`, `Driver.take_slot`'s first step once
its objects are built), against an in-memory store: claimed; given up first by the coordinator
(an error: it took this process for lost); moved on - the generation will not be joined, a newer
plan came first - it waits for the next generation's roster and claims its slot there, or leaves
with exit code 0 when the job ended meanwhile. (The survivors' side: `test_decisions.py`.)"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from stores import SEAL, TEST_SECRET

from megatron_deadpool.config.deadpool import DeadpoolConfig
from megatron_deadpool.devices.base import Device
from megatron_deadpool.errors import DeadpoolRuntimeError
from megatron_deadpool.hotswap.driver import Driver
from megatron_deadpool.hotswap.injection import FaultInjector
from megatron_deadpool.hotswap.membership import Membership
from megatron_deadpool.hotswap.memory_store import MemoryStore
from megatron_deadpool.hotswap.messages import Roster

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
