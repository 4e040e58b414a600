"""The plan watch's decisions on a real store: when it aborts a survivor's groups, and when not.

(`tests/hotswap/test_frozen_peer.py` runs it in a job with a frozen rank.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from megatron_deadpool.hotswap.membership import Membership, host_store
from megatron_deadpool.hotswap.plan_watch import PlanWatch


@pytest.fixture
def members() -> Iterator[Membership]:
    yield Membership(host_store("127.0.0.1", 0), "a1")


def _watch() -> tuple[PlanWatch, list[int]]:
    aborts: list[int] = []
    return PlanWatch(lambda: aborts.append(1)), aborts


@pytest.mark.timeout(30)
def test_a_plan_the_main_thread_does_not_act_on_aborts_the_groups_one_beat_later(
    members: Membership,
) -> None:
    watch, aborts = _watch()
    watch(members)  # nothing joined yet: nothing to abort
    watch.joined(0)
    watch(members)
    assert aborts == [] and watch.fired is None
    members.publish_plan(1, {"generation": 1, "dead": [2]})
    watch(members)  # first sight: the main thread may be on its way into recovery
    assert aborts == []
    watch(members)  # still not recovering a beat later: it is blocked
    assert aborts == [1] and "generation 1" in (watch.fired or "")
    watch(members)
    assert aborts == [1]  # once per generation
    watch.recovering()
    watch.joined(1)
    assert watch.fired is None
    watch(members)
    watch(members)
    assert aborts == [1]  # generation 1's own plan is not news


@pytest.mark.timeout(30)
def test_a_main_thread_that_enters_recovery_first_is_left_alone(members: Membership) -> None:
    watch, aborts = _watch()
    watch.joined(0)
    members.publish_plan(1, {"generation": 1, "dead": [2]})
    watch(members)
    watch.recovering()  # its collective failed: it releases the groups itself
    watch(members)
    watch.joined(1)
    watch(members)
    assert aborts == []


@pytest.mark.timeout(30)
def test_after_training_the_end_report_aborts_too(members: Membership) -> None:
    watch, aborts = _watch()
    watch.joined(0)
    members.publish_end({"dead_ranks": [2]})
    watch(members)
    watch(members)
    assert aborts == []  # during training an end report is not the watch's business
    watch.training_completed()
    watch(members)
    watch(members)
    assert aborts == [1] and "after training" in (watch.fired or "")
