"""The coordinator's decisions without a store (`decide.py`): plain values in, actions out.

A job of four ranks, one to a node (tp 1 x pp 1 x dp 4: rank r's replica on its data-parallel
peer on another node), members a0..a3, spares s0...: the cases of the decision table
(`test_decisions.py`, which drives the whole coordinator on a store) at the decision level.
"""

from __future__ import annotations

import dataclasses

from megatron_deadpool.hotswap.coordinator.actions import (
    Agree,
    Condemn,
    EndAfterTraining,
    EndJobError,
    EndOutOfRedundancy,
    GiveUpSlot,
    MoveSlotOn,
    OrderRespawn,
    PendingRecovery,
    PublishPlan,
    RefuseRespawn,
    TakeSpare,
)
from megatron_deadpool.hotswap.coordinator.decide import (
    Deaths,
    NodeState,
    Respawning,
    RespawnOutcome,
    decide_agreement,
    decide_deaths,
    late_newcomers,
)
from megatron_deadpool.hotswap.protocol.messages import ErrorReport, HoldingsReport, Phase, Roster
from megatron_deadpool.replication.placement import Layout, place_replicas

PLACEMENT = place_replicas(Layout(tp=1, pp=1, dp=4, ranks_per_node=1), 1)
ROSTER = Roster(0, 4, {r: f"a{r}" for r in range(4)})


def deaths(*dead: int, **facts: object) -> Deaths:
    """Ranks `dead` died in generation 0's roster, two spares waiting (both beat)."""
    known: dict[str, object] = {
        "dead": frozenset(dead),
        "world_size": 4,
        "roster": ROSTER,
        "recovery": None,
        "next_generation": 1,
        "spares": ("s0", "s1"),
        "beaten": frozenset({"s0", "s1"}),
        "placement": PLACEMENT,
        "failure": (100.0, "injected fault stamp"),
        "now": 101.0,
        "monotonic": 7.0,
        "progress": 5,
    }
    known.update(facts)
    return Deaths(**known)  # type: ignore[arg-type]


def planned(*dead: int, slots: dict[int, str], decided: bool, generation: int = 1) -> Deaths:
    """The recovery of generation `generation` of ranks `dead` is under way (`decided`: its
    roster is out, its newcomers not all joined); no further spare but s1."""
    rec = PendingRecovery(
        generation=generation,
        dead=set(dead),
        slots={**ROSTER.slots, **slots},
        needy=set(dead),
        t_failure=90.0,
        failure_evidence="last heartbeat (failure at or after it)",
        t_detect=91.0,
        t_plan=91.0,
        planned_at=1.0,
        t_agreed=92.0 if decided else None,
        agreed_at=2.0 if decided else None,
        restore_iteration=4 if decided else None,
    )
    roster = Roster(generation, 4, rec.slots, restore_iteration=4) if decided else ROSTER
    return deaths(roster=roster, recovery=rec, next_generation=generation + 1, spares=("s1",))


def only_plan(actions: list) -> PublishPlan:
    plan = actions[-1]
    assert isinstance(plan, PublishPlan)
    return plan


def respawning(limit: int = 2, *, lost: set[int] = frozenset(), recent: int = 0) -> Respawning:
    """Every active member on node = its rank; nodes in `lost` have no agent left."""
    return Respawning(
        limit=limit,
        window=600.0,
        node_of={f"a{r}": r for r in range(4)},
        nodes={n: NodeState(alive=n not in lost, recent=recent) for n in range(4)},
    )


def test_one_death_takes_a_spare() -> None:
    actions = decide_deaths(deaths(2))
    assert actions[:-1] == [TakeSpare(2, "s0", "a2")]
    publish = only_plan(actions)
    plan, rec = publish.plan, publish.recovery
    assert (plan.generation, plan.base, plan.dead, plan.needy) == (1, 0, (2,), (2,))
    assert plan.replaced == {2: "s0"} and rec.slots == {0: "a0", 1: "a1", 2: "s0", 3: "a3"}
    assert publish.supersedes is None and publish.expect_reports == 3
    assert (rec.t_failure, rec.failure_evidence, rec.t_detect, rec.planned_at) == (
        100.0,
        "injected fault stamp",
        101.0,
        7.0,
    )
    assert rec.prev_last_iteration == 5 and rec.no_spare == ""


def test_a_spare_that_beat_is_taken_before_one_still_starting_up() -> None:
    actions = decide_deaths(deaths(1, 3, spares=("s0", "s1", "s2"), beaten=frozenset({"s2"})))
    assert actions[:-1] == [TakeSpare(1, "s2", "a1"), TakeSpare(3, "s0", "a3")]


def test_a_crash_on_a_live_node_is_respawned_there_once_the_order_came_to_a_member() -> None:
    seen = deaths(2, respawning=respawning())
    assert decide_deaths(seen) == [OrderRespawn(2, 2, "a2")]  # the order's outcome is needed
    actions = decide_deaths(seen, {2: RespawnOutcome("s2")})
    assert actions[:1] == [OrderRespawn(2, 2, "a2")]  # the same prefix: not ordered twice
    publish = only_plan(actions)
    assert actions[1:-1] == [] and publish.plan.replaced == {2: "s2"}
    assert publish.recovery.respawned == {2: 2}
    assert publish.expect_reports == 4  # the respawned process reports too


def test_past_the_respawn_limit_a_node_takes_a_spare() -> None:
    actions = decide_deaths(deaths(2, respawning=respawning(limit=1, recent=1)))
    assert actions[:-1] == [
        RefuseRespawn(2, 2, "respawn limit reached", used=1),
        TakeSpare(2, "s0", "a2"),
    ]


def test_a_nodes_respawns_in_one_plan_count_against_its_limit() -> None:
    both_on_node_0 = dataclasses.replace(respawning(limit=1), node_of={"a1": 0, "a2": 0})
    seen = deaths(1, 2, respawning=both_on_node_0)
    actions = decide_deaths(seen, {1: RespawnOutcome("s2")})
    assert actions[:-1] == [
        OrderRespawn(1, 0, "a1"),
        RefuseRespawn(2, 0, "respawn limit reached", used=1),
        TakeSpare(2, "s0", "a2"),
    ]


def test_a_lost_node_takes_a_spare_and_a_node_that_cannot_start_one_too() -> None:
    seen = deaths(1, 2, respawning=respawning(lost={1}))
    why = "[Errno 24] Too many open files"
    actions = decide_deaths(seen, {2: RespawnOutcome(None, why)})
    assert actions[:-1] == [
        RefuseRespawn(1, 1, "node lost"),
        TakeSpare(1, "s0", "a1"),
        OrderRespawn(2, 2, "a2"),
        RefuseRespawn(2, 2, f"cannot start one: {why}"),
        TakeSpare(2, "s1", "a2"),
    ]
    assert only_plan(actions).plan.replaced == {1: "s0", 2: "s1"}


def test_more_crashes_than_spares_are_all_respawned() -> None:
    seen = deaths(0, 1, 3, spares=(), respawning=respawning())
    outcomes = {0: RespawnOutcome("s5"), 1: RespawnOutcome("s6"), 3: RespawnOutcome("s7")}
    publish = only_plan(decide_deaths(seen, outcomes))
    assert publish.plan.replaced == {0: "s5", 1: "s6", 3: "s7"}
    assert publish.recovery.no_spare == ""


def test_no_spare_left_plans_anyway_to_save_what_survives() -> None:
    actions = decide_deaths(deaths(2, spares=()))
    publish = only_plan(actions)
    assert actions[:-1] == [] and publish.plan.replaced == {}
    assert publish.recovery.no_spare == "no spare left to replace rank(s) [2]"
    holdings = {r: report(r) for r in (0, 1, 3)}
    end = decide_agreement(publish.recovery, holdings, PLACEMENT, 4, 2)
    assert isinstance(end, EndOutOfRedundancy) and end.generations == (2, 1)
    assert end.report.reason == "no spare left to replace rank(s) [2]"
    assert end.report.save is not None and end.report.save.complete
    assert end.report.save.sources == {2: PLACEMENT.holders[2][0]}


def test_a_death_during_agreement_supersedes_the_plan() -> None:
    seen = planned(2, slots={2: "s0"}, decided=False)
    actions = decide_deaths(dataclasses.replace(seen, dead=frozenset({0})))
    assert actions[:-1] == [TakeSpare(0, "s1", "a0")]  # nothing to settle: not decided yet
    publish = only_plan(actions)
    assert publish.supersedes == 1 and publish.plan.generation == 2 and publish.plan.base == 0
    assert (publish.plan.dead, publish.plan.needy) == ((0, 2), (0, 2))
    assert publish.plan.replaced == {0: "s1", 2: "s0"}
    assert (publish.recovery.t_failure, publish.recovery.t_detect) == (90.0, 91.0)  # the first


def test_a_newcomer_lost_before_its_claim_gives_its_slot_up() -> None:
    seen = planned(2, slots={2: "s0"}, decided=True)
    actions = decide_deaths(dataclasses.replace(seen, dead=frozenset({2})))
    assert actions[:-1] == [GiveUpSlot(1, 2), TakeSpare(2, "s1", "s0")]
    publish = only_plan(actions)
    assert publish.plan.base == 1 and publish.plan.replaced == {2: "s1"}


def test_a_newcomer_lost_beside_one_alive_moves_the_live_ones_slot_on() -> None:
    seen = planned(1, 3, slots={1: "s0", 3: "s1"}, decided=True)
    actions = decide_deaths(dataclasses.replace(seen, dead=frozenset({3}), spares=()))
    assert actions[:-1] == [MoveSlotOn(1, 1), GiveUpSlot(1, 3)]
    publish = only_plan(actions)
    assert publish.plan.needy == (1, 3) and publish.plan.replaced == {}
    assert publish.recovery.no_spare != ""


def test_a_newcomer_that_restored_survives_into_the_next_plan() -> None:
    seen = planned(2, slots={2: "s0"}, decided=True)
    seen = dataclasses.replace(seen, dead=frozenset({1}), restored=frozenset({2}))
    actions = decide_deaths(seen)
    assert actions[:-1] == [TakeSpare(1, "s1", "a1")]  # no slot of rank 2's to settle
    publish = only_plan(actions)
    assert publish.plan.needy == (1,) and publish.recovery.restored_earlier == {2: None}
    assert publish.expect_reports == 3  # s0 reports as rank 2's survivor


def test_a_failure_in_start_up_is_the_jobs_error_and_spends_no_spare() -> None:
    error = ErrorReport(1, "a2", 2, 0, Phase.START_UP, "AssertionError", "no data", 50.0)
    actions = decide_deaths(deaths(2, errors={"a2": error}))
    assert len(actions) == 1 and isinstance(actions[0], EndJobError)
    assert actions[0].verdict.dead_ranks == (2,) and actions[0].verdict.report == error


def test_a_loss_after_training_completed_costs_no_recovery() -> None:
    (end,) = decide_deaths(deaths(3, completed=8))
    assert isinstance(end, EndAfterTraining)
    assert end.members == ("a3",) and end.fresh == (3,)
    assert end.report.save.sources == {3: PLACEMENT.holders[3][0]} and end.report.lost_ranks == ()


def report(rank: int, iterations: tuple[int, ...] = (3, 4), last: int = 5) -> HoldingsReport:
    """What rank `rank` holds: its own snapshots, and its owners' replicas."""
    owners = [o for o in range(4) if rank in PLACEMENT.holders[o]]
    holds = {"local": iterations, **{str(o): iterations for o in owners}}
    return HoldingsReport(f"a{rank}", last, holds)


def test_every_report_in_agrees_on_the_newest_common_iteration() -> None:
    rec = only_plan(decide_deaths(deaths(2))).recovery
    agree = decide_agreement(rec, {r: report(r) for r in (0, 1, 3)}, PLACEMENT, 4, 2)
    assert isinstance(agree, Agree) and agree.last_completed == 5
    assert agree.roster == Roster(1, 4, rec.slots, restore_iteration=4)
    assert agree.sources == {2: PLACEMENT.holders[2][0]}


def test_an_owner_and_its_holder_lost_together_lose_the_shard() -> None:
    holder = PLACEMENT.holders[2][0]
    rec = only_plan(decide_deaths(deaths(2, holder))).recovery
    survivors = {r: report(r) for r in range(4) if r not in (2, holder)}
    end = decide_agreement(rec, survivors, PLACEMENT, 4, 2)
    assert isinstance(end, EndOutOfRedundancy) and 2 in end.report.lost_ranks
    assert end.report.lost_shards_holders[2] == (holder,)


def test_a_failure_before_the_layout_arrived_is_out_of_redundancy() -> None:
    rec = only_plan(decide_deaths(deaths(2, placement=None))).recovery
    end = decide_agreement(rec, {r: report(r) for r in (0, 1, 3)}, None, 4, 2)
    assert isinstance(end, EndOutOfRedundancy) and end.report.lost_ranks == (2,)
    assert "before replication started" in end.report.reason


def test_a_newcomer_that_does_not_claim_within_the_join_timeout_is_condemned() -> None:
    rec = planned(1, 3, slots={1: "s0", 3: "s1"}, decided=True).recovery
    assert rec is not None
    claimed = frozenset({1})
    assert late_newcomers(rec, 60.0, 60.0, frozenset(), claimed) == []  # not past it yet
    (late,) = late_newcomers(rec, 61.0, 60.0, frozenset(), claimed)
    assert isinstance(late, Condemn) and late.member == "s1"
    assert late.why == (
        "did not take rank 3's slot within 60s of the decision (deadpool-join-timeout)"
    )
    # One already dead is the detector's; the one that claimed is not touched.
    assert [c.member for c in late_newcomers(rec, 61.0, 60.0, frozenset({"s1"}), claimed)] == []
    assert [c.member for c in late_newcomers(rec, 61.0, 60.0, frozenset(), frozenset())] == [
        "s0",
        "s1",
    ]
