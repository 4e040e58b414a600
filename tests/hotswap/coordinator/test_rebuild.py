"""What a standby that took over rebuilds from the survivors' re-registrations (pure)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from megatron_deadpool.hotswap.coordinator.rebuild import rebuild
from megatron_deadpool.hotswap.protocol.messages import LayoutRecord, ProtocolError, Registration
from megatron_deadpool.replication.placement import Layout, RankOrder, place_replicas

LAYOUT = LayoutRecord(tp=2, pp=1, dp=2, ranks_per_node=2, replicas=1)
GEN0 = {0: "a0", 1: "a1", 2: "a2", 3: "a3"}


def active(member: str, rank: int, **kw: object) -> Registration:
    fields = {"generation": 0, "world_size": 4, "slots": GEN0, "layout": LAYOUT}
    return Registration(member=member, rank=rank, **{**fields, **kw})  # type: ignore[arg-type]


def spare(member: str, **kw: object) -> Registration:
    return Registration(member=member, **kw)  # type: ignore[arg-type]


def regs(*records: Registration) -> dict[str, Registration]:
    return {r.member: r for r in records}


@pytest.mark.timeout(10)
def test_primary_node_lost_names_its_ranks_and_keeps_the_spares() -> None:
    state = rebuild(
        regs(
            active("a2", 2, last_completed=8),
            active("a3", 3, last_completed=7),
            spare("s1"),
            spare("s0"),
        ),
        world_size=4,
        spares=["s0", "s1"],
    )
    assert state is not None
    assert state.roster.generation == 0 and state.roster.slots == GEN0
    assert state.missing == {0: "a0", 1: "a1"}
    assert state.spares == ["s0", "s1"]  # in the job's spare order
    assert state.next_generation == 1 and state.progress == 8
    assert state.layout == LAYOUT and state.completed is None and state.done == []


@pytest.mark.timeout(10)
def test_the_newest_roster_wins_and_generations_go_above_every_plan_seen() -> None:
    gen2 = {0: "s0", 1: "a1", 2: "a2", 3: "a3"}
    state = rebuild(
        regs(
            active("a1", 1, generation=2, slots=gen2, restore_iteration=5, plan_seen=3),
            active("a2", 2),  # still on generation 0's roster (stale: it will catch up)
            active("s0", 0, generation=2, slots=gen2, restore_iteration=5, recovering=True),
            spare("s1"),
        ),
        world_size=4,
        spares=["s0", "s1"],
    )
    assert state is not None
    assert state.roster.generation == 2 and state.roster.slots == gen2
    assert state.roster.restore_iteration == 5
    assert state.missing == {3: "a3"}
    assert state.spares == ["s1"]  # s0 holds rank 0 now
    assert state.next_generation == 4  # above plan 3, which a1 may have reported for
    assert state.recovering == ["s0"]


@pytest.mark.timeout(10)
def test_a_finished_job_is_rebuilt_as_finished() -> None:
    state = rebuild(
        regs(
            active("a0", 0, completed=30, done=True, last_completed=30),
            active("a1", 1, completed=30, last_completed=30),
        ),
        world_size=4,
        spares=[],
    )
    assert state is not None
    assert state.completed == 30 and state.finished == {0: 30, 1: 30}
    assert state.done == ["a0"] and state.missing == {2: "a2", 3: "a3"}


@pytest.mark.timeout(10)
def test_nothing_to_rebuild_without_a_process_that_held_a_rank() -> None:
    assert rebuild(regs(spare("s0")), world_size=4, spares=["s0"]) is None
    assert rebuild({}, world_size=4, spares=[]) is None


@pytest.mark.timeout(10)
def test_registration_round_trips_through_json() -> None:
    record = active("a2", 2, last_completed=8, plan_seen=1, recovering=True)
    back = Registration.decode("rejoin/a2", record.encode())
    assert back == record and back.slots == GEN0  # rank keys are ints again
    newer = {**json.loads(spare("s0").encode()), "from_a_newer_version": 1}
    assert Registration.decode("rejoin/s0", json.dumps(newer)) == spare("s0")
    broken = {**json.loads(record.encode()), "last_completed": "eight"}
    with pytest.raises(ProtocolError, match=r"rejoin/a2.*last_completed"):
        Registration.decode("rejoin/a2", json.dumps(broken))


@pytest.mark.timeout(10)
def test_rebuild_scales_to_thousands_of_ranks() -> None:
    world = 16384
    slots = {r: f"a{r}" for r in range(world)}
    records = {
        f"a{r}": Registration(member=f"a{r}", rank=r, generation=0, world_size=world, slots=slots)
        for r in range(world)
        if r // 8 != 3  # node 3 (ranks 24..31) lost
    }
    state = rebuild(records, world_size=world, spares=[])  # time: `deadpool bench planning`
    assert state is not None and sorted(state.missing) == list(range(24, 32))


@pytest.mark.timeout(10)
def test_a_standby_keeps_the_rank_order_and_places_as_the_job_did() -> None:
    """A tp-pp-dp job's layout comes back from the registrations with its order, so the
    standby's placement is the primary's: rank 2's replica on rank 0, its data-parallel peer
    under tp-pp-dp on the other node."""
    layout = Layout(tp=1, pp=2, dp=2, ranks_per_node=2, order=RankOrder.TP_PP_DP)
    record = LayoutRecord.of(layout, 1)
    sent = active("a2", 2, layout=record)
    state = rebuild(
        regs(Registration.decode("rejoin/a2", sent.encode()), active("a3", 3, layout=record)),
        world_size=4,
        spares=[],
    )
    assert state is not None and state.layout == record
    placement = place_replicas(state.layout.layout(), state.layout.replicas)
    assert placement.holders == place_replicas(layout, 1).holders == ((2,), (3,), (0,), (1,))


def test_a_standby_finds_the_spares_that_joined_after_the_start(tmp_path: Any) -> None:
    """A spare that joined the running job (`--deadpool-join`, s2 here, after the job's own
    s0 and s1) re-registers under a name the standby cannot know in advance: it finds it
    among the store's keys, and the rebuilt state counts it as a waiting spare."""
    from stores import SEAL

    from megatron_deadpool.config.deadpool import DeadpoolConfig
    from megatron_deadpool.hotswap.coordinator.events import EventLog
    from megatron_deadpool.hotswap.coordinator.standby import Standby
    from megatron_deadpool.hotswap.protocol.membership import Membership
    from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore

    store = MemoryStore()
    cfg = DeadpoolConfig(coordinator="127.0.0.1:1,127.0.0.1:2", spares=2)
    sb = Standby(cfg, 1, 4, Membership(store, "coordinator", SEAL), EventLog(None), print)
    for r in range(4):
        Membership(store.clone(), f"a{r}", SEAL).register(active(f"a{r}", r))
    Membership(store.clone(), "s2", SEAL).register(spare("s2"))
    sb._read_registrations()
    assert "s2" in sb.registrations and sb.spares == ["s0", "s1", "s2"]
    state = rebuild(sb.registrations, 4, sb.spares)
    assert state is not None and state.spares == ["s2"]  # s0 and s1 never re-registered
