"""A waiting spare's head start (`newcomer_build.HeadStart`): it builds for the slot the newest plan
names it for, before the roster; once per plan and rank; dropped when a later plan moves its slot
or gives it none. The plans are a real coordinator's, on the in-memory store."""

from __future__ import annotations

import pytest
from decisions_job import Job

from megatron_deadpool.hotswap.protocol.messages import Roster
from megatron_deadpool.hotswap.worker.newcomer_build import HeadStart, planned_roster


class Builds:
    """What the head start asked for: ('build', generation, rank, restore iteration) / 'drop'."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[object] = []
        self.fail = fail

    def build(self, roster: Roster) -> None:
        self.calls.append(
            ("build", roster.generation, roster.rank_of("s0"), roster.restore_iteration)
        )
        if self.fail:
            raise RuntimeError("the job's build failed")

    def drop(self) -> None:
        self.calls.append("drop")


def test_a_spare_builds_for_the_rank_a_plan_names_it_for_once() -> None:
    job = Job(spares=2)
    builds = Builds()
    head = HeadStart(builds.build, builds.drop)
    head.on_plan(job.m("s0"), "s0")  # no plan yet
    assert builds.calls == [] and head.built_for is None
    job.die("a2")
    job.tick()  # plan 1: s0 takes rank 2, before the survivors reported
    assert job.decision(1) is None
    head.on_plan(job.m("s0"), "s0")
    head.on_plan(job.m("s0"), "s0")  # the same plan: nothing more
    assert builds.calls == [("build", 1, 2, None)] and head.built_for == 2
    other = HeadStart(builds.build, builds.drop)
    other.on_plan(job.m("s1"), "s1")  # named by no plan
    assert other.built_for is None and len(builds.calls) == 1
    job.report(1, [0, 1, 3])
    job.tick()  # the roster: what the spare built is what it needs
    roster = job.m("s0").roster(1)
    assert not head.build(roster, "s0") and builds.calls == [("build", 1, 2, None)]


def test_a_later_plan_that_moves_or_takes_its_slot_drops_what_it_built() -> None:
    job = Job(spares=2)
    builds = Builds()
    head = HeadStart(builds.build, builds.drop)
    job.die("a2")
    job.tick()
    head.on_plan(job.m("s0"), "s0")
    assert head.built_for == 2
    moved = Roster(1, 4, {0: "a0", 1: "s0", 2: "a2", 3: "a3"})
    assert head.build(moved, "s0")  # another rank: dropped, built again
    assert builds.calls[1:] == ["drop", ("build", 1, 1, None)] and head.built_for == 1
    job.die("s0")  # presumed lost before it claimed: the next plan gives rank 2 to s1
    job.tick()
    job.tick()
    assert planned_roster(job.m("s1"), "s1") is not None
    assert planned_roster(job.m("s0"), "s0") is None
    head.on_plan(job.m("s0"), "s0")  # had it lived: what it built goes
    assert builds.calls[-1] == "drop" and head.built_for is None


def test_a_failed_build_is_dropped_and_raised() -> None:
    job = Job(spares=1)
    job.die("a1")
    job.tick()
    builds = Builds(fail=True)
    head = HeadStart(builds.build, builds.drop)
    with pytest.raises(RuntimeError, match="build failed"):
        head.on_plan(job.m("s0"), "s0")
    assert builds.calls == [("build", 1, 1, None), "drop"] and head.built_for is None
