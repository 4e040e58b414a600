"""The plan watch's decisions on a real store: when it aborts a survivor's groups, and when not.

(`tests/hotswap/test_frozen_peer.py` runs it in a job with a frozen rank.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from megatron_deadpool.hotswap.membership import Membership, host_store
from megatron_deadpool.hotswap.messages import EndReport, Plan, SaveOrder
from megatron_deadpool.hotswap.plan_watch import PlanWatch

PLAN = Plan(generation=1, base=0, world_size=4, dead=(2,), needy=(2,), replaced={2: "s0"})
END = EndReport("lost", 8, (2,), (), SaveOrder(8, {2: 3}, True, ()))


@pytest.fixture
def membership() -> Iterator[Membership]:
    yield Membership(host_store("127.0.0.1", 0), "a1")


def _watch() -> tuple[PlanWatch, list[int]]:
    aborts: list[int] = []
    return PlanWatch(lambda: aborts.append(1)), aborts


@pytest.mark.timeout(30)
def test_a_plan_the_main_thread_does_not_act_on_aborts_the_groups_one_beat_later(
    membership: Membership,
) -> None:
    watch, aborts = _watch()
    watch(membership)  # nothing joined yet: nothing to abort
    watch.joined(0)
    watch(membership)
    assert aborts == [] and watch.fired is None
    membership.publish_plan(PLAN)
    watch(membership)  # first sight: the main thread may be on its way into recovery
    assert aborts == []
    watch(membership)  # still not recovering a beat later: it is blocked
    assert aborts == [1] and "a generation after 0" in (watch.fired or "")
    watch(membership)
    assert aborts == [1]  # once per generation
    watch.recovering()
    watch.joined(1)
    assert watch.fired is None
    watch(membership)
    watch(membership)
    assert aborts == [1]  # generation 1's own plan is not news


@pytest.mark.timeout(30)
def test_a_main_thread_that_enters_recovery_first_is_left_alone(membership: Membership) -> None:
    watch, aborts = _watch()
    watch.joined(0)
    membership.publish_plan(PLAN)
    watch(membership)
    watch.recovering()  # its collective failed: it releases the groups itself
    watch(membership)
    watch.joined(1)
    watch(membership)
    assert aborts == []


@pytest.mark.timeout(30)
def test_after_training_the_end_report_aborts_too(membership: Membership) -> None:
    watch, aborts = _watch()
    watch.joined(0)
    membership.publish_end(END)
    watch(membership)
    watch(membership)
    assert aborts == []  # during training an end report is not the watch's business
    watch.training_completed()
    watch(membership)
    watch(membership)
    assert aborts == [1] and "after training" in (watch.fired or "")
