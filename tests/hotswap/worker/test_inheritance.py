"""`Inheritance.report`: a process respawned in place reports what its node's segment files
hold for each plan that names it for a slot it restores - also a later plan that keeps the slot
an earlier one gave it (a death before it restored), where the plan lists it as needy, not as a
replacement. (The coordinator counts it among the reporters: without the report the agreement
waited its whole timeout and took the live process for dead.) The store in memory."""

from __future__ import annotations

from pathlib import Path

from stores import SEAL

from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.hotswap.protocol.messages import Plan, Roster
from megatron_deadpool.hotswap.worker.inheritance import Inheritance

FIRST = Roster(1, 4, {0: "a0", 1: "s1", 2: "a2", 3: "a3"}, restore_iteration=None)
"""Generation 1 (decided): rank 1 died, its node respawned it as s1, which has not restored."""


def test_a_respawned_process_reports_for_a_later_plan_that_keeps_its_slot(tmp_path: Path) -> None:
    coordinator = Membership(MemoryStore(), "coordinator", SEAL)
    coordinator.publish_roster(FIRST)
    s1 = Membership(coordinator.store.clone(), "s1", SEAL)
    inherited = Inheritance(tmp_path)  # its node's segment files (none written here)
    second = Plan(generation=2, base=1, world_size=4, dead=(3,), needy=(1, 3), replaced={3: "s2"})
    coordinator.publish_plan(second)
    inherited.report(s1, "s1")
    report = coordinator.holdings(2, 1)
    assert report is not None and report.member == "s1" and report.holds == {"local": ()}
    assert inherited.holdings is None  # an empty folder (a spare's): nothing to restore from
    third = Plan(generation=3, base=1, world_size=4, dead=(0, 3), needy=(0, 3), replaced={})
    coordinator.publish_plan(third)  # a plan in which rank 1 restores no more: nothing
    inherited.report(s1, "s1")
    assert coordinator.holdings(3, 1) is None


def test_a_respawned_process_whose_join_failed_restores_from_its_files_unless_a_holder_is_named(
    tmp_path: Path,
) -> None:
    """A respawned process whose join of generation 1 failed recovers with the survivors
    (`Driver.recover`): its segment files are what it reports, and once the roster is agreed
    (`Recovery.inherit`) they restore it - it is no longer needy - unless the coordinator named
    a holder for it (its own snapshot of T missing), which then restores it."""
    from megatron_deadpool.hotswap.protocol.messages import Sources
    from megatron_deadpool.hotswap.worker.recovery import Recovery
    from megatron_deadpool.replication.segments import SegmentHoldings

    coordinator = Membership(MemoryStore(), "coordinator", SEAL)
    s1 = Membership(coordinator.store.clone(), "s1", SEAL)
    roster = Roster(2, 4, {0: "s2", 1: "s1", 2: "a2", 3: "a3"}, restore_iteration=5)
    for sources, restores_itself in (({0: 2}, True), ({0: 2, 1: 3}, False)):
        inherited = Inheritance(tmp_path)
        inherited.holdings = files = SegmentHoldings(tmp_path, 1)
        coordinator.publish_sources(2, Sources(sources))
        rec = Recovery(s1, "s1", 1, roster, files, needy=True)
        rec.inherit(inherited.take)
        assert rec.needy is not restores_itself
        assert rec.replicator is files  # reported, and (restoring itself) what it restores from
        # Kept for a recovery that starts before the restore (a holder lost in the exchange)...
        assert inherited.holdings is files
        inherited.restored()  # ... until the restore made its replicator
        assert inherited.holdings is None
