"""What a rank publishes for a repair in place (`group_repair.RepairHandles`) is checked before
use, a later plan abandons a repair under way (from the heartbeat, and at once from the plan
waiter), and `bench recovery` reports how the hot swap's processes reconstruct their groups."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_deadpool.bench.recovery import groups_way
from megatron_deadpool.devices.reconfigure import RepairPlanError
from megatron_deadpool.hotswap.worker.group_repair import RepairHandles


def test_handles_round_trip() -> None:
    sent = RepairHandles(3, {"0": "gloo:1:-1:1:h:5", "7": "gloo:0:3:1:h:5"})
    assert RepairHandles.decode(1, sent.encode().encode()) == sent


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (None, "not the job's"),
        (b"{", "not JSON"),
        (b'{"handles": {}}', "no base generation"),
        (b'{"base": -1, "handles": {}}', "no base generation"),
        (b'{"base": true, "handles": {}}', "no base generation"),
        (b'{"base": 0, "handles": {"0": "nccl:1"}}', "not a gloo handle"),
        (b'{"base": 0, "handles": []}', "not a mapping"),
    ],
)
def test_bad_handles_name_the_rank(raw: bytes | None, why: str) -> None:
    with pytest.raises(RepairPlanError, match=f"rank 2.*{why}"):
        RepairHandles.decode(2, raw)


def test_bench_reports_the_way_the_processes_logged(tmp_path: Path) -> None:
    assert groups_way(tmp_path) == "unknown"
    line = "12:00:00.000 [deadpool] INFO process groups on a recovery: {}\n"
    (tmp_path / "a0.log").write_text(line.format("repair (gloo groups reconfigured in place)"))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a1.log").write_text(
        line.format("repair (gloo groups reconfigured in place)")
    )
    assert groups_way(tmp_path) == "repair (gloo groups reconfigured in place)"
    (tmp_path / "a2.log").write_text(line.format("rebuild (DEADPOOL_GROUP_REPAIR=rebuild)"))
    assert groups_way(tmp_path) == (
        "rebuild (DEADPOOL_GROUP_REPAIR=rebuild); repair (gloo groups reconfigured in place)"
    )


def test_groups_created_ahead_on_another_prefix_than_the_survivors_are_created_again() -> None:
    """A newcomer predicts the prefix the survivors' groups were created on (generation 0); when
    the survivors' handles name another, it does not join with what it created ahead: its caller
    creates them again (`InPlace.join_ahead` is False), and once only."""
    from decisions_job import Job

    from megatron_deadpool.hotswap.worker.group_repair import PREDICTED_BASE, InPlace

    job = Job(spares=1)
    job.decided("a2")  # plan 1 and its roster: s0 takes rank 2
    roster = job.m("s0").roster(1)
    handles = RepairHandles(PREDICTED_BASE + 3, {"0": "gloo:0:-1:0:h:5"})
    job.m("a0").publish_repair_handles(1, 0, handles.encode())
    groups = InPlace("gloo")
    assert not groups.join_ahead(job.m("s0"), roster, 2)  # nothing created ahead
    groups.ahead = PREDICTED_BASE
    assert not groups.join_ahead(job.m("s0"), roster, 2)
    assert groups.ahead is None and groups.base is None


class _Store:
    """What `InPlace` asks of the store its groups rendezvous on (`RepairStore`), recorded."""

    def __init__(self) -> None:
        self.abandoned: list[object] = []

    @contextlib.contextmanager
    def abandonable(self) -> Iterator[None]:
        yield

    def abandon(self, side: object) -> list[str]:
        self.abandoned.append(side)
        return ["0//1//cpu//reconfigure/1/0/2"]


def test_a_repair_is_abandoned_once_a_later_generation_is_planned_and_only_then() -> None:
    """The heartbeat's look (`InPlace.abandon_if_planned`, on a real coordinator's store): no
    repair under way - nothing; a repair of generation 1 while only plan 1 exists - nothing;
    the newcomer lost, plan 2 published - the repair's waits are ended, once, through the
    heartbeat's own connection on the prefix the groups were created on."""
    from decisions_job import Job

    from megatron_deadpool.hotswap.worker.group_repair import InPlace

    job = Job(spares=2)
    job.decided("a2")  # plan 1: s0 takes rank 2
    groups = InPlace("gloo")
    store = _Store()
    groups.store, groups.base = store, 0  # type: ignore[assignment]
    beat = job.m("a0")
    # the prefix store over the in-memory store's connection (a torch store over a real one)
    beat.process_group_store = lambda g: ("side", g)  # type: ignore[method-assign]
    groups.abandon_if_planned(beat)  # no repair under way
    with groups._abandonable(1):
        groups.abandon_if_planned(beat)
        assert store.abandoned == []  # plan 1 is the repair's own
        job.die("s0")  # the newcomer dies in the repair
        for _ in range(3):
            job.tick()
        assert beat.latest_plan() >= 2
        groups.abandon_if_planned(beat)
        groups.abandon_if_planned(beat)
        assert store.abandoned == [("side", 0)]
    groups.abandon_if_planned(beat)
    assert len(store.abandoned) == 1


@pytest.mark.timeout(30)
def test_a_later_plan_abandons_a_repair_through_the_plan_waiter_at_once() -> None:
    """On a real store: a repair of generation 1 under way arms the plan waiter for plan 2
    (`InPlace.on_repair`, as the driver wires it); plan 2's wake-up abandons the repair from
    the waiter's thread - no heartbeat - once, and nothing else is stopped; the wake-up of the
    repair's own plan abandons nothing."""
    import time

    from stores import SEAL

    from megatron_deadpool.hotswap.protocol.membership import Membership, host_store
    from megatron_deadpool.hotswap.protocol.messages import Plan
    from megatron_deadpool.hotswap.worker.group_repair import InPlace
    from megatron_deadpool.hotswap.worker.plan_waiter import PlanWaiter

    coordinator = Membership(host_store("127.0.0.1", 0), "coordinator", SEAL)
    member = coordinator.sibling(coordinator.core.store.clone(), "a1")
    groups = InPlace("gloo")
    store = _Store()
    groups.store, groups.base = store, 0  # type: ignore[assignment]
    stops: list[int] = []

    def on_plan(m: Membership) -> None:  # `Driver._on_plan_wake`'s first part
        if not groups.abandon_if_planned(m, by="plan waiter"):
            stops.append(m.latest_plan())

    waiter = PlanWaiter(member, on_plan)
    groups.on_repair = waiter.watch
    waiter.start()
    plan = Plan(generation=1, base=0, world_size=4, dead=(2,), needy=(2,), replaced={2: "s0"})
    try:
        coordinator.publish_plan(plan)
        with groups._abandonable(1):
            coordinator.wake_plan_waiters([1], ["a1"])  # the repair's own plan: not waited for
            time.sleep(0.3)
            assert store.abandoned == []
            coordinator.publish_plan(Plan(2, 1, 4, (2,), (2,), {2: "s1"}))
            coordinator.wake_plan_waiters([2], ["a1"])
            deadline = time.monotonic() + 5.0
            while not store.abandoned and time.monotonic() < deadline:
                time.sleep(0.005)
            assert len(store.abandoned) == 1, "plan 2's wake-up did not abandon the repair"
        time.sleep(0.2)
        assert len(store.abandoned) == 1 and stops == []
    finally:
        waiter.stop()
    assert not waiter.is_alive()


@pytest.mark.timeout(60)
def test_a_rank_lost_before_publishing_its_handles_ends_the_wait_for_them_at_the_next_plan() -> (
    None
):
    """Generation 1's newcomer is lost before it published its reconfigure handles: a survivor
    waiting for them (`group_repair.read`, a 30 s bound) waits while generation 1 stands, and
    stops with a peer failure naming the rank as the coordinator plans generation 2 (it marks
    the handles `REPAIR_ABANDONED`), not at the bound; the handles a survivor published stay."""
    import threading
    import time

    import torch.distributed as dist
    from decisions_job import Job

    from megatron_deadpool.hotswap.worker.group_repair import read

    job = Job(spares=2)
    job.decided("a2")  # plan 1 and its roster: s0 takes rank 2
    job.m("a0").publish_repair_handles(1, 0, RepairHandles(0, {}).encode())
    failed: list[str] = []

    def survivor() -> None:
        try:
            read(job.m("a1"), 1, [0, 2], 30.0)
        except dist.DistBackendError as exc:
            failed.append(str(exc))

    waiter = threading.Thread(target=survivor, daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and not failed  # waiting for rank 2's handles
    job.die("s0")
    for _ in range(3):
        job.tick()
    assert job.m().latest_plan() == 2
    waiter.join(10.0)
    assert not waiter.is_alive(), "the survivor still waits for the lost rank's handles"
    assert failed and "rank(s) [2] lost before publishing" in failed[0], failed
    assert read(job.m("a3"), 1, [0], 1.0)[0].base == 0


@pytest.mark.timeout(60)
def test_a_rank_taken_for_lost_finds_the_mark_when_it_publishes_after_it() -> None:
    """The coordinator's mark and a rank's handles are set by compare-and-set, first writer
    wins: generation 1's newcomer that publishes after the coordinator took it for lost (plan 2)
    finds the mark and fails its repair with a peer failure - it does not replace the mark the
    survivors stopped waiting at - while the handles a survivor published before are kept."""
    import torch.distributed as dist
    from decisions_job import Job

    from megatron_deadpool.hotswap.protocol.messages import REPAIR_ABANDONED
    from megatron_deadpool.hotswap.worker.group_repair import publish, read

    job = Job(spares=2)
    job.decided("a2")  # plan 1 and its roster: s0 takes rank 2
    publish(job.m("a0"), 1, 0, 0)
    job.die("s0")
    for _ in range(3):
        job.tick()
    assert job.m().latest_plan() == 2
    with pytest.raises(dist.DistBackendError, match="rank 2 was taken for lost before it"):
        publish(job.m("s0"), 1, 2, 0)
    assert job.m("a1").repair_handles(1, [2], 1.0) == [REPAIR_ABANDONED.encode()]
    assert read(job.m("a3"), 1, [0], 1.0)[0].base == 0


@pytest.mark.timeout(60)
def test_a_newcomer_whose_join_loses_the_survivor_it_reads_keeps_its_groups_to_repair() -> None:
    """Generation 1's survivor whose handles a newcomer reads for the survivors' prefix (its
    first rank that is no newcomer, rank 0) is lost before it published them: the newcomer's
    join fails with a peer failure as the coordinator plans generation 2 - and the groups it
    created ahead stay the base of the recovery's repair (`InPlace.repairs`), so that it repairs
    them with the survivors instead of creating a world of its own that nobody joins."""
    import torch.distributed as dist
    from decisions_job import Job

    from megatron_deadpool.devices.reconfigure import Choice
    from megatron_deadpool.hotswap.worker.group_repair import PREDICTED_BASE, InPlace

    job = Job(spares=2)
    job.decided("a2")  # plan 1 and its roster: s0 takes rank 2
    roster = job.m("s0").roster(1)
    job.die("a0")
    for _ in range(3):
        job.tick()
    assert job.m().latest_plan() == 2
    groups = InPlace("gloo")
    groups.choice = Choice(repair=True, reason="a test's")
    groups.ahead = PREDICTED_BASE
    with pytest.raises(dist.DistBackendError, match=r"rank\(s\) \[0\] lost before publishing"):
        groups.join_ahead(job.m("s0"), roster, 2)
    assert groups.base == PREDICTED_BASE and groups.ahead is None
    assert groups.repairs()
