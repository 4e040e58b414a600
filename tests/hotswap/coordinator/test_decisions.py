"""The coordinator's decision table, on the in-memory store and a clock moved by hand.

Each case builds the real `Coordinator` (failure detection and decisions) on a `MemoryStore`
(held to TCPStore's behaviour by `test_store_conformance.py`), plays the members' side of the
protocol through their own `Membership` - beats, exits a launcher sees, holdings reports,
claims - and checks what the coordinator published: plans, decisions, rosters, sources, the
out-of-redundancy and end reports. No process, no sleep: the whole table runs in well under a
second.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from decisions_job import AGREE_TIMEOUT, HEARTBEAT_TIMEOUT, Job
from stores import SEAL

from megatron_deadpool.hotswap.coordinator.coordinator import Coordinator
from megatron_deadpool.hotswap.coordinator.liveness import HeartbeatOnly
from megatron_deadpool.hotswap.coordinator.rebuild import rebuild
from megatron_deadpool.hotswap.coordinator.respawn import RespawnBudget
from megatron_deadpool.hotswap.protocol import joining
from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.hotswap.protocol.messages import (
    CLAIMED,
    GIVEN_UP,
    MOVED_ON,
    Decision,
    ErrorReport,
    FailureReport,
    Keys,
    LayoutRecord,
    Phase,
    Registration,
    RespawnHistory,
    Roster,
    Verdict,
)
from megatron_deadpool.hotswap.worker.recovery import Recovery
from megatron_deadpool.replication.placement import Layout, RankOrder


def test_one_death_takes_a_spare_and_agrees_on_the_newest_common_iteration() -> None:
    job = Job(spares=2)
    job.die("a2")
    job.tick()
    plan = job.m().plan(1)
    assert plan is not None and (plan.dead, plan.needy) == ((2,), (2,))
    assert plan.replaced == {2: "s0"} and plan.base == 0
    assert job.coord.spares == ("s1",) and job.coord.recovering
    assert job.decision(1) is None  # waiting for the survivors' reports
    job.report(1, [0, 1])
    job.tick()
    assert job.decision(1) is None  # one report is still missing
    job.report(1, [3])
    job.tick()
    assert job.decision(1) == Decision.roster(4)
    assert job.m().sources(1).holders == {2: job.holder(2)}
    roster = job.m().roster(1)
    assert roster.slots == {0: "a0", 1: "a1", 2: "s0", 3: "a3"} and roster.restore_iteration == 4
    assert job.coord.roster == roster and job.coord.out_of_redundancy is None


def test_a_learnt_tp_pp_dp_layout_takes_the_shard_from_the_data_parallel_peer() -> None:
    """TP1 x PP2 x DP2 on nodes of 2 in Megatron's tp-pp-dp order, learnt from rank 0's
    record: rank 2's shard comes from rank 0, its data-parallel peer under that order on the
    other node (under the default order ranks 2 and 3 would be peers, in one node)."""
    layout = Layout(tp=1, pp=2, dp=2, ranks_per_node=2, order=RankOrder.TP_PP_DP)
    job = Job(world=4, per_node=2, spares=2, layout=layout, learn_layout=True)
    job.m("a0").publish_layout(LayoutRecord.of(layout, 1))
    job.die("a2")
    job.tick()
    plan = job.m().plan(1)
    assert plan is not None and plan.dead == (2,) and plan.replaced == {2: "s0"}
    job.report(1, [0, 1, 3])
    job.tick()
    assert job.decision(1) == Decision.roster(4)
    assert job.m().sources(1).holders == {2: 0}
    learnt = job.coord.placement()
    assert learnt is not None and learnt.layout == layout and learnt.holders[2] == (0,)
    assert "shards from rank 0 -> rank 2" in " ".join(job.said)


def test_a_hung_member_is_killed_after_the_heartbeat_timeout() -> None:
    job = Job()
    job.tick()
    job.silent.add("a1")
    job.tick(HEARTBEAT_TIMEOUT - 1)
    assert job.m().plan(1) is None and job.launcher.killed == []
    job.tick(2.0)
    assert job.launcher.killed == ["a1"]
    plan = job.m().plan(1)
    assert plan is not None and plan.dead == (1,)
    assert any("silent for" in line and "killed" in line for line in job.said)


def test_a_lost_node_is_one_plan() -> None:
    """On a cluster (heartbeats only) a node's ranks fall silent together: one plan for both."""
    job = Job(world=4, per_node=2, spares=2, liveness=HeartbeatOnly())
    job.tick()
    job.silent |= {"a2", "a3"}
    job.tick(HEARTBEAT_TIMEOUT + 1)
    plan = job.m().plan(1)
    assert plan is not None and plan.dead == (2, 3) and plan.replaced == {2: "s0", 3: "s1"}
    assert job.m().plan(2) is None


def test_a_crash_names_its_silent_node_mate_in_the_same_plan() -> None:
    """One rank's exit is seen at once; its node mate, silent longer than the suspicion window,
    goes into the same plan instead of a second one a heartbeat timeout later."""
    job = Job(world=4, per_node=2, spares=2, suspect_after=3.0)
    job.tick()
    job.silent.add("a3")
    job.tick(4.0)
    assert job.m().plan(1) is None  # silent, but below the heartbeat timeout
    job.die("a2")
    job.tick()
    plan = job.m().plan(1)
    assert plan is not None and plan.dead == (2, 3)
    assert "a3" in job.launcher.killed


def test_a_reported_failure_condemns_silent_peers_sooner_but_not_the_reporter() -> None:
    """After a survivor reports a failed collective, a silent rank of the roster is named dead
    after `suspect_after`; the reporter itself (alive, its heartbeat starved) and a silent
    spare - like a newcomer busy in Megatron's start-up, whose collectives did not fail - only
    after the full heartbeat timeout."""
    job = Job(world=4, spares=2, liveness=HeartbeatOnly(), suspect_after=3.0)
    job.tick()
    job.silent |= {"a1", "a2", "s1"}  # a1 frozen; a2 and s1 busy (heartbeat threads starved)
    job.m("a2").report_failure("Connection closed by peer")
    job.tick(4.0)
    assert job.coord.dead == {"a1"}
    plan = job.m().plan(1)
    assert plan is not None and plan.dead == (1,) and plan.replaced == {1: "s0"}
    dead = job.events.of("process_dead")
    assert "after a peer's collective failed" in dead[0]["why"]
    job.tick(HEARTBEAT_TIMEOUT)  # ... until the full heartbeat timeout
    assert job.coord.dead == {"a1", "a2", "s1"}


def test_a_death_during_agreement_supersedes_the_plan() -> None:
    job = Job(spares=2)
    job.die("a2")
    job.tick()
    job.report(1, [1, 3])
    job.die("a0")  # neither 2's holder nor held by 2: both shards survive
    job.tick()
    assert job.decision(1) == Decision.superseded(2)
    plan = job.m().plan(2)
    assert plan is not None and plan.dead == (0, 2) and plan.needy == (0, 2)
    assert plan.replaced == {0: "s1", 2: "s0"} and plan.base == 0
    job.report(2, [1, 3])
    job.tick()
    decision = job.decision(2)
    assert decision is not None and decision.verdict is Verdict.ROSTER
    assert job.m().sources(2).holders == {0: job.holder(0), 2: job.holder(2)}


def test_a_survivor_that_never_reports_is_presumed_dead() -> None:
    job = Job(spares=2, liveness=HeartbeatOnly())
    job.tick()
    job.silent.add("a2")
    job.tick(HEARTBEAT_TIMEOUT + 1)
    job.report(1, [0, 1])  # a3 beats, but never reports
    job.tick(AGREE_TIMEOUT - 1)
    assert job.decision(1) is None
    job.tick(2.0)  # presumed dead now; planned at the next look
    assert [e["member"] for e in job.events.of("process_dead")] == ["a2", "a3"]
    job.tick()
    assert job.decision(1) == Decision.superseded(2)
    plan = job.m().plan(2)
    assert plan is not None and plan.dead == (2, 3)


def test_a_newcomer_lost_before_its_claim_gives_its_slot_up() -> None:
    job = Job(spares=2)
    job.decided("a2")
    job.die("s0")  # given rank 2, dead before it claimed the slot
    job.tick()
    assert job.m().wait_newcomers(1, [2], 0.0) is False  # survivors do not wait for it
    assert job.m("s0").claim_slot(1, 2) == GIVEN_UP
    plan = job.m().plan(2)
    assert plan is not None and plan.dead == (2,) and plan.replaced == {2: "s1"}
    assert plan.base == 1


def test_a_newcomer_lost_beside_one_alive_moves_the_live_ones_slot_on() -> None:
    """Plan 1 is decided (rank 1 <- s0, rank 3 <- s1); s1 dies before its claim, and no spare
    is left. The survivors, waiting for both claims, must not wait for s0's, which would never
    come (as in CI: they waited forever after the job ended out of redundancy): s1's slot is
    given up, s0's moved on - s0 takes its slot in the next plan, or is released with the job."""
    job = Job(spares=2)
    job.decided("a1", "a3")
    job.die("s1")
    job.tick()
    assert job.m().wait_newcomers(1, [1, 3], 0.0) is False  # the survivors move on
    assert job.m("s0").claim_slot(1, 1) == MOVED_ON
    assert job.m("s1").claim_slot(1, 3) == GIVEN_UP
    plan = job.m().plan(2)
    assert plan is not None and plan.needy == (1, 3) and plan.base == 1
    assert 1 not in plan.replaced  # rank 1 stays s0's, as in generation 1's roster
    job.report(2, [0, 2])
    job.tick()
    decision = job.decision(2)
    assert decision is not None and decision.verdict is Verdict.OUT_OF_REDUNDANCY  # no spare


def test_a_newcomer_lost_after_its_claim_keeps_the_claim_and_is_replaced() -> None:
    job = Job(spares=2)
    job.decided("a2")
    assert job.m("s0").claim_slot(1, 2) == CLAIMED
    job.die("s0")
    job.tick()
    assert job.m().wait_newcomers(1, [2], 0.0) is True  # the claim stands
    plan = job.m().plan(2)
    assert plan is not None and plan.needy == (2,) and plan.replaced == {2: "s1"}


def test_a_newcomer_that_restored_before_the_next_death_survives_into_the_next_plan() -> None:
    """A death after generation 1's newcomer restored, before rank 0's first iteration ended
    the recovery: the newcomer holds its state now; the next plan must not count it needy (as
    in CI, the survivors waited for its claim for ever, while it reported as a survivor)."""
    job = Job(spares=2)
    job.decided("a2")
    assert job.m("s0").claim_slot(1, 2) == CLAIMED
    for rank, member in job.coord.roster.slots.items():
        job.m(member).stamp(1, "joined", rank)
        job.m(member).stamp(1, "restored", rank)
    job.die("a1")
    job.tick()
    plan = job.m().plan(2)
    assert plan is not None and plan.needy == (1,) and plan.replaced == {1: "s1"}
    job.report(2, [0, 2, 3])  # s0 among them, as rank 2
    job.tick()
    assert job.decision(2) == Decision.roster(4)
    assert job.m().sources(2).holders == {1: 2}  # s0 holds rank 1's replica: nothing lost
    job.complete(2)  # one recovery of both deaths, which names both newcomers
    (record,) = job.coord.recoveries
    assert record["dead_ranks"] == [1, 2] and record["replaced_by"] == {"1": "s1", "2": "s0"}


def test_a_newcomer_that_claimed_but_did_not_restore_stays_needy_in_the_next_plan() -> None:
    job = Job(spares=2)
    job.decided("a2")
    assert job.m("s0").claim_slot(1, 2) == CLAIMED
    job.die("a0")
    job.tick()
    plan = job.m().plan(2)
    assert plan is not None and plan.needy == (0, 2) and plan.replaced == {0: "s1"}
    job.report(2, [1, 3])
    job.tick()
    assert job.decision(2) == Decision.roster(4)
    assert job.m().sources(2).holders == {0: job.holder(0), 2: job.holder(2)}


def test_a_newcomer_that_does_not_claim_within_the_join_timeout_is_killed_and_replaced() -> None:
    """Alive and beating but stuck in its build: the survivors wait for every claim, and waited
    for ever. A newcomer that claimed in time is not touched, however long it takes after."""
    job = Job(spares=3, join_timeout=60.0)
    job.decided("a1", "a3")
    assert job.m("s0").claim_slot(1, 1) == CLAIMED
    job.tick(59.0)  # s1 beats, but has not claimed rank 3's slot
    assert job.m().plan(2) is None and job.launcher.killed == []
    job.tick(2.0)
    assert job.launcher.killed == ["s1"]
    job.tick()
    assert job.m().wait_newcomers(1, [1, 3], 0.0) is False  # the survivors move on
    plan = job.m().plan(2)
    assert plan is not None and plan.needy == (1, 3)
    assert plan.replaced == {3: "s2"}  # s0 keeps rank 1: it claims it again in plan 2
    said = [e["why"] for e in job.events.of("process_dead") if e["member"] == "s1"]
    why = "did not take rank 3's slot within 60s of the decision (deadpool-join-timeout)"
    assert said == [f"{why}; killed"]


def test_no_spare_left_saves_a_complete_set_and_ends_out_of_redundancy() -> None:
    job = Job(spares=0)
    job.die("a2")
    job.tick()
    plan = job.m().plan(1)
    assert plan is not None and plan.replaced == {}
    job.report(1, [0, 1, 3])
    job.tick()
    assert job.decision(1) == Decision.out_of_redundancy()
    assert job.decision(2) == Decision.out_of_redundancy()  # who reports for the next one
    assert job.m().latest_plan() == 2  # plan watches see it
    report = job.m().out_of_redundancy()
    assert report is not None and report == job.coord.out_of_redundancy
    assert report.reason == "no spare left to replace rank(s) [2]"
    assert report.dead_ranks == (2,) and report.lost_ranks == ()
    assert report.save is not None and report.save.complete
    assert report.save.iteration == 4 and report.save.sources == {2: job.holder(2)}


def test_an_owner_and_its_holder_lost_together_lose_the_shard() -> None:
    job = Job(spares=2)
    holder = job.holder(2)
    job.die("a2", f"a{holder}")
    job.tick()
    survivors = [r for r in range(4) if r not in (2, holder)]
    job.report(1, survivors)
    job.tick()
    report = job.coord.out_of_redundancy
    assert report is not None and report.lost_ranks == (2,)
    assert report.lost_shards_holders == {2: (holder,)}
    assert report.save is not None and not report.save.complete and report.save.missing == (2,)
    assert report.save.sources == {holder: job.holder(holder)}  # the holder's own shard lives


def _re_registrations(ranks: Iterable[int]) -> dict[str, Registration]:
    """What the active members of ranks `ranks` tell a standby taking the job over: generation
    0 of a job of 4 ranks, at iteration 7."""
    roster = Job(spares=1).coord.roster
    layout = LayoutRecord(1, 1, 4, 1, 1)
    return {
        f"a{r}": Registration(
            member=f"a{r}",
            rank=r,
            generation=0,
            world_size=4,
            slots=dict(roster.slots),
            restore_iteration=None,
            last_completed=7,
            layout=layout,
        )
        for r in ranks
    }


def test_a_standby_adopts_the_job_and_recovers_who_never_came_back() -> None:
    """The primary is gone; the standby rebuilds the job from the members' re-registrations
    (`rebuild`), and the rank that never re-registered is recovered like any dead rank."""
    registrations = _re_registrations((0, 2, 3))
    registrations["s0"] = Registration(member="s0")
    state = rebuild(registrations, 4, ["s0"])
    assert state is not None and state.missing == {1: "a1"} and state.spares == ["s0"]
    standby = Job(spares=1, start=False)
    standby.coord.adopt(
        state.roster, state.spares, state.next_generation, {"a1": "did not re-register"}
    )
    _replaces_rank_1_with_s0(standby, state.next_generation)


def _replaces_rank_1_with_s0(standby: Job, g: int) -> None:
    """The standby plans generation g - rank 1 dead, s0 in its place - and agrees it from the
    survivors' reports."""
    standby.tick()
    plan = standby.m().plan(g)
    assert plan is not None and plan.dead == (1,) and plan.replaced == {1: "s0"}
    standby.report(g, [0, 2, 3])
    standby.tick()
    assert standby.decision(g) == Decision.roster(4)


def test_survivors_waiting_on_a_plan_the_lost_primary_never_decided_report_for_the_standbys() -> (
    None
):
    """The primary planned generation 1, the survivors reported and waited for its decision,
    then the primary's node was lost. The standby plans generation 2 (from the plan the
    survivors saw): it decides 1 as superseded by 2 - else the survivors' wait on its store
    ended 'not a peer failure', or after 30 minutes, their holdings never reported for 2 -
    and their reports for 2 agree it."""
    registrations = _re_registrations((0, 2, 3))
    for member in ("a0", "a2", "a3"):  # re-registered as waiting on plan 1 (rank 1 died)
        registrations[member] = dataclasses.replace(registrations[member], plan_seen=1)
    registrations["s0"] = Registration(member="s0")
    state = rebuild(registrations, 4, ["s0"])
    assert state is not None and state.roster.generation == 0 and state.next_generation == 2
    standby = Job(spares=1, start=False)
    standby.coord.adopt(state.roster, state.spares, 2, {"a1": "did not re-register"})
    survivor = Membership(standby.store.clone(), "a0", SEAL)
    assert survivor.wait_decision(1, 1.0) == Decision.superseded(2)
    _replaces_rank_1_with_s0(standby, 2)


def _taken_over_after_deciding_1() -> tuple[Job, Job]:
    """The primary decided generation 1 (rank 1 <- s0) from the survivors' reports; then its
    node was lost with s0, and the standby adopted roster 0 from the survivors'
    re-registrations (s1 waiting): (the primary, the standby)."""
    primary = Job(spares=2)
    primary.decided("a1")
    registrations = _re_registrations((0, 2, 3))
    for member in ("a0", "a2", "a3"):  # as `Driver.rejoin_record` reads their views
        seen = primary.m(member).plan_seen
        registrations[member] = dataclasses.replace(registrations[member], plan_seen=seen)
    registrations["s1"] = Registration(member="s1")
    state = rebuild(registrations, 4, ["s0", "s1"])
    assert state is not None and state.roster.generation == 0 and state.next_generation == 2
    standby = Job(spares=2, start=False)
    standby.silent.add("s0")
    standby.coord.adopt(state.roster, state.spares, 2, {"a1": "did not re-register"})
    return primary, standby


def test_survivors_waiting_on_the_lost_primarys_newcomers_report_for_the_standbys_plan() -> None:
    """The primary decided generation 1 (rank 1 <- s0); the survivors, which had reported for
    it, read the roster and waited for s0's claim, then the primary's node was lost with s0.
    No process re-registers with roster 1: the standby adopts roster 0 and plans above 1 (the
    survivors reported for it) and moves every slot of 1 on - else the survivors waited on its
    store for a claim nobody makes (30 minutes), were presumed dead after the agreement timeout
    meanwhile, and the job ended out of redundancy with nothing saved - and their reports for
    2 agree it."""
    _, standby = _taken_over_after_deciding_1()
    survivor = Membership(standby.store.clone(), "a0", SEAL)
    assert survivor.wait_newcomers(1, [1], 0.0) is False  # 1 will not be joined: on to 2
    standby.tick()
    plan = standby.m().plan(2)
    assert plan is not None and plan.dead == (1,) and plan.replaced == {1: "s1"}
    standby.report(2, [0, 2, 3])
    standby.tick()
    assert standby.decision(2) == Decision.roster(4)


class _LostAfterReading:
    """A survivor's connection that fails over to the standby's store right after it read
    `key` on the primary's (the primary's node lost then; `FailoverStore` repeats the next
    operation on the standby's, which has rebuilt the job)."""

    def __init__(self, primary: MemoryStore, key: str, standby: MemoryStore) -> None:
        self.serving, self.key, self.standby = primary, key, standby

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        value = self.serving.compare_set(key, expected, desired)
        if key == self.key:
            self.serving = self.standby
        return value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.serving, name)


def test_a_survivor_that_read_the_lost_primarys_decision_but_not_its_plan_reports_for_the_standbys() -> (
    None
):
    """The primary decided generation 1 (rank 1 <- s0) and was lost, with s0, between a
    survivor's read of the decision and its read of the plan: that read goes to the standby,
    which never held plan 1 - it superseded 1 by its own plan 2 as it adopted the job. The
    survivor takes that verdict and reports for 2 (before, 'generation 1 was decided without
    a plan' ended the survivor's process: one more rank lost in the recovery)."""
    primary, standby = _taken_over_after_deciding_1()
    store = _LostAfterReading(
        primary.store.clone(), Keys.DECIDED.format(g=1), standby.store.clone()
    )
    held: Any = SimpleNamespace(  # what its replicator holds
        holdings=lambda: {k: list(v) for k, v in standby.holds(0).items()}
    )
    survivor = Recovery(Membership(store, "a0", SEAL), "a0", 0, standby.coord.roster, held)
    agreed: list[Roster | BaseException] = []

    def agree() -> None:
        try:
            agreed.append(
                survivor.agree(
                    {},
                    last_completed=5,
                    deadline=time.time() + 20,
                    cause=RuntimeError("peer died"),
                    salvage_target=lambda t: (None, None),
                )
            )
        except BaseException as exc:  # noqa: BLE001 - shown by the assertion below
            agreed.append(exc)

    thread = threading.Thread(target=agree, daemon=True)
    thread.start()
    standby.tick()
    assert standby.m().plan(2) is not None
    standby.report(2, [2, 3])
    deadline = time.monotonic() + 20
    while standby.decision(2) is None and not agreed and time.monotonic() < deadline:
        standby.tick(0.0)
        time.sleep(0.01)
    assert standby.decision(2) == Decision.roster(4), agreed
    standby.m("s1").claim_slot(2, 1)
    thread.join(20)
    assert agreed and isinstance(agreed[0], Roster), agreed
    assert agreed[0].generation == 2 and agreed[0].slots[1] == "s1"


def test_a_process_starting_after_a_takeover_reads_the_world_size_from_the_newest_roster() -> None:
    """A standby that took the job over at generation 3 never held generation 0's roster: a
    process respawned or joining then learns the job's world size from the newest one."""
    standby = Job(spares=1, start=False)
    roster = Roster(3, 4, {r: f"a{r}" for r in range(4)})
    standby.coord.adopt(roster, ["s0"], 4, {})
    starting = Membership(standby.store.clone(), "s7", SEAL)
    assert starting.wait_newest_roster(1.0) == roster
    assert standby.store.num_keys() and not standby.store.check([Keys.ROSTER.format(g=0)])


def test_after_a_takeover_re_registered_members_get_one_heartbeat_timeout_to_beat_again() -> None:
    """A process's heartbeat may still be waiting on the lost primary for up to its bound on a
    store operation (at most the heartbeat timeout) after it re-registered: the standby judges
    its beats from one heartbeat timeout after the takeover on (CI: ranks named hung 4.2 s
    after a takeover, with a 4 s timeout, while their beats were on their way)."""
    registrations = _re_registrations(range(4))
    state = rebuild(registrations, 4, [])
    assert state is not None
    standby = Job(spares=0, start=False)
    standby.silent.add("a2")  # its beats have not reached the standby yet
    standby.coord.adopt(state.roster, state.spares, state.next_generation, {})
    standby.tick(1.0)
    standby.tick(HEARTBEAT_TIMEOUT + 7)
    assert standby.events.of("process_dead") == []  # silent 1.8 x the timeout since
    standby.tick(3.0)
    assert [e["member"] for e in standby.events.of("process_dead")] == ["a2"]


def test_a_loss_after_training_completed_costs_no_recovery() -> None:
    job = Job(spares=1)
    for r in range(4):
        job.m(f"a{r}").report_finished(r, 8)
    job.die("a3")
    job.tick()
    assert job.m().plan(1) is None and not job.coord.recovering
    end = job.m().end()
    assert end is not None and end == job.coord.ended
    assert end.dead_ranks == (3,) and end.lost_ranks == () and end.completed_iteration == 8
    assert end.save.complete and end.save.sources == {3: job.holder(3)}
    assert job.coord.spares == ("s0",)  # no spare spent
    assert not job.coord.training_done()
    for r in range(3):
        job.m(f"a{r}").mark_done()
    assert job.coord.training_done()  # a3 is gone after its work, not awaited


def test_a_spare_added_later_takes_the_next_slot() -> None:
    job = Job(spares=0)
    job.coord.add_spare("s7")
    job.m("s7").announce()
    assert job.coord.spares == ("s7",)
    job.coord.add_spare("s7")  # known already: nothing changes
    assert job.coord.spares == ("s7",)
    job.die("a0")
    job.tick()
    plan = job.m().plan(1)
    assert plan is not None and plan.replaced == {0: "s7"}
    assert [e["member"] for e in job.events.of("spare_added")] == ["s7"]


def test_a_spare_still_starting_up_is_taken_only_after_those_that_beat() -> None:
    job = Job(spares=0)
    job.coord.add_spare("s7")  # never beat: still importing, or stuck in its start-up
    job.silent.add("s7")
    job.coord.add_spare("s8")
    job.m("s8").announce()
    job.tick()
    job.die("a1")
    job.tick()
    plan = job.m().plan(1)
    assert plan is not None and plan.replaced == {1: "s8"}
    assert job.coord.spares == ("s7",)
    job.die("a2")  # the only spare left: taken anyway
    job.tick()
    plan = job.m().plan(2)
    assert plan is not None and plan.replaced == {1: "s8", 2: "s7"}


def test_a_process_that_joins_the_running_job_takes_the_next_name_then_a_slot() -> None:
    """`--deadpool-join` (`joining.py`): the joiner's name comes from the store's counter,
    after the job's own spares; it counts once its sealed announcement is there."""
    job = Job(spares=1)
    joiner = Membership(job.store.clone(), "joining", SEAL)
    name = joiner.claim_spare_name()
    assert name == "s1"  # s0 started with the job
    job.tick()  # claimed, not announced yet: not in the pool
    assert job.coord.spares == ("s0",)
    job.m(name).announce()
    job.tick()
    assert job.coord.spares == ("s0", "s1")
    assert [e["member"] for e in job.events.of("spare_joined")] == ["s1"]
    assert any("s1 joined the spare pool" in line for line in job.said)
    job.die("a0")
    job.tick()
    assert job.m().plan(1).replaced == {0: "s0"}  # type: ignore[union-attr]
    job.report(1, range(1, 4))
    job.tick()
    job.die("a2")
    job.tick()
    assert job.m().plan(2).replaced == {2: "s1"}  # type: ignore[union-attr]


def test_a_joining_name_that_never_announces_is_given_up_and_costs_nothing() -> None:
    """The counter is not sealed: a stranger who bumps it makes names that never announce."""
    job = Job(spares=0)
    job.store.add(Keys.SPARES_NEXT, 3)
    job.tick()
    job.tick(joining.WAIT_S + 1)
    assert job.coord.spares == ()
    gone = job.events.of("join_abandoned")
    assert sorted(e["member"] for e in gone) == ["s0", "s1", "s2"], gone
    assert Membership(job.store.clone(), "joining", SEAL).claim_spare_name() == "s3"


def test_the_joining_pool_waits_for_a_bounded_number_of_names() -> None:
    job = Job(spares=0)
    job.store.add(Keys.SPARES_NEXT, joining.MAX_PENDING + 5)
    job.tick()
    assert len(job.events.of("join_abandoned")) == 5
    assert len(job.coord._joiners.pending) == joining.MAX_PENDING


def test_a_respawned_process_is_not_taken_for_a_joining_spare() -> None:
    """In-place respawns take their names from the same counter; the coordinator knows them
    as the replacement it planned, never as a spare of the pool."""
    job = Job(spares=1, respawn_limit=2)
    job.die("a1")
    job.tick()
    plan = job.m().plan(1)
    assert plan is not None
    (member,) = plan.replaced.values()
    job.m(member).announce()
    job.tick()
    job.tick(joining.WAIT_S + 1)
    assert job.coord.spares == ("s0",) and not job.events.of("spare_joined")


def test_a_failure_before_replication_started_ends_at_once() -> None:
    """Every rank exits during start-up (say, a bad script argument) before rank 0 published
    the layout (the Megatron-LM runner's coordinator learns it only then): the coordinator ends
    the job with the reason instead of waiting for a layout it will never get."""
    job = Job(world=2, spares=1)
    job.coord = Coordinator(
        Membership(job.store, "launcher", SEAL),
        2,
        None,  # no layout published yet
        ["s0"],
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        agree_timeout=AGREE_TIMEOUT,
        liveness=job.launcher,
        events=job.events,
        clock=job.clock,
    )
    job.coord.start()
    job.die("a0", "a1")
    job.tick()
    job.tick()
    report = job.coord.out_of_redundancy
    assert report is not None and "failed before replication started" in report.reason
    assert report.lost_ranks == (0, 1) and report.save is None


# ---------------------------------------------------------------------- the job's own error
PATH_ERROR = (
    "AssertionError: One or both of the .idx and .bin files cannot be found at /nonexistent"
)


def test_every_rank_failing_in_start_up_is_the_jobs_error_and_spends_no_spare() -> None:
    """Every rank raises the same exception in its start-up (say, a data path that does not
    exist) and exits: the job's own error - no plan, no spare given a slot, the lowest rank's
    report named as the cause."""
    job = Job(world=4, spares=1)
    for r in (3, 1, 0, 2):
        job.raised(f"a{r}", Phase.START_UP, rank=r)
        job.die(f"a{r}")
    job.tick()
    verdict = job.coord.job_error
    assert verdict is not None and verdict == job.m().job_error()
    assert verdict.report.member == "a0" and verdict.dead_ranks == (0, 1, 2, 3)
    assert verdict.report.cause() == f"rank 0 start-up: {PATH_ERROR}"
    assert "before replication started" in verdict.reason
    assert job.m().plan(1) is None and job.m().latest_plan() == 0
    assert job.coord.spares == ("s0",) and not job.coord.recovering
    assert job.coord.out_of_redundancy is None
    assert f"JOB ERROR: rank 0 start-up: {PATH_ERROR}" in job.said
    assert job.events.of("job_error")[0]["report"]["member"] == "a0"
    job.die("s0")
    job.tick()
    assert job.m().plan(1) is None  # the job has ended: nothing more is decided


def test_one_rank_failing_in_start_up_ends_the_job_while_its_peers_still_live() -> None:
    """Only rank 2 raises (its peers wait for it in a collective): the job ends at its exit."""
    job = Job(world=4, spares=1)
    job.tick()
    job.raised("a2", Phase.START_UP, rank=2)
    job.die("a2")
    job.tick()
    verdict = job.coord.job_error
    assert verdict is not None and verdict.dead_ranks == (2,)
    assert verdict.report.cause() == f"rank 2 start-up: {PATH_ERROR}"
    assert job.m().plan(1) is None and job.coord.spares == ("s0",)


def test_a_reported_error_needs_no_launcher_nor_heartbeat_timeout() -> None:
    """On a cluster (heartbeats only) the report itself names the member dead, at once."""
    job = Job(world=4, spares=1, liveness=HeartbeatOnly())
    job.tick()
    job.raised("a1", Phase.START_UP, rank=1)
    job.tick(0.1)
    verdict = job.coord.job_error
    assert verdict is not None and verdict.report.member == "a1"
    assert "ended with an error: rank 1 start-up" in job.events.of("process_dead")[0]["why"]


def test_a_death_by_signal_in_start_up_stays_a_failure() -> None:
    """A process killed in its start-up reports nothing: a spare takes its slot, as before."""
    job = Job(world=4, spares=1)
    job.die("a2")
    job.tick()
    plan = job.m().plan(1)
    assert plan is not None and plan.replaced == {2: "s0"}
    assert job.coord.job_error is None


def test_a_newcomer_failing_as_the_rank_it_replaced_is_the_jobs_error() -> None:
    """Rank 2 raises in training: a first error there may be its node's (memory, disk), so a
    spare takes the slot. The spare raises the same error in the same phase: the error follows
    the slot - the job ends, the second spare is not spent."""
    job = Job(spares=2)
    message = "fault injection: rank 2 raises at iteration 4"
    job.raised("a2", Phase.TRAINING, rank=2, message=message)
    job.die("a2")
    job.tick()
    plan = job.m().plan(1)
    assert plan is not None and plan.replaced == {2: "s0"} and job.coord.job_error is None
    job.report(1, [0, 1, 3])
    job.tick()
    assert job.decision(1) == Decision.roster(4)
    job.raised("s0", Phase.TRAINING, rank=2, generation=1, message=message)
    job.die("s0")
    job.tick()
    verdict = job.coord.job_error
    assert verdict is not None and verdict.report.member == "s0"
    assert verdict.report.cause() == f"rank 2 training: AssertionError: {message}"
    assert "spare s0 failed as a2 did" in verdict.reason
    assert job.m().plan(2) is None and job.coord.spares == ("s1",)


def test_a_newcomer_failing_otherwise_is_hot_swapped() -> None:
    """Same slot, another error (or another phase): a failure to hot-swap like any other."""
    job = Job(spares=2)
    job.raised("a2", Phase.TRAINING, rank=2, message="CUDA error: an illegal memory access")
    job.die("a2")
    job.tick()
    job.report(1, [0, 1, 3])
    job.tick()
    job.raised("s0", Phase.START_UP, rank=2, generation=1, message="CUDA error: out of memory")
    job.die("s0")
    job.tick()
    assert job.coord.job_error is None
    plan = job.m().plan(2)
    assert plan is not None and plan.replaced == {2: "s1"}


def test_the_same_error_two_holders_apart_is_the_jobs_error() -> None:
    """a2 raises, its spare s0 is killed by a signal (nothing reported), the next spare s1
    raises a2's error: the nearest earlier holder that reported anything decides."""
    job = Job(spares=3)
    message = "fault injection: rank 2 raises at iteration 4"
    job.raised("a2", Phase.TRAINING, rank=2, message=message)
    job.die("a2")
    job.tick()
    job.report(1, [0, 1, 3])
    job.tick()
    job.die("s0")
    job.tick()
    plan = job.m().plan(2)
    assert plan is not None and plan.replaced == {2: "s1"}
    job.report(2, [0, 1, 3])
    job.tick()
    job.raised("s1", Phase.TRAINING, rank=2, generation=2, message=message)
    job.die("s1")
    job.tick()
    verdict = job.coord.job_error
    assert verdict is not None and "spare s1 failed as a2 did" in verdict.reason
    assert job.coord.spares == ("s2",)


def test_a_waiting_spares_error_only_shrinks_the_pool() -> None:
    job = Job(spares=2)
    job.raised("s0", Phase.WAITING, rank=None, generation=-1)
    job.die("s0")
    job.tick()
    assert job.coord.spares == ("s1",) and job.coord.job_error is None
    assert job.m().plan(1) is None


def test_a_report_counted_before_it_is_published_is_read_once_it_is() -> None:
    """Two processes report at once: the store numbers them in one order, their values may land
    in the other. A number counted but not yet published is looked at again next time."""
    job = Job(world=4, spares=1, liveness=HeartbeatOnly())
    job.tick()
    job.store.add(Keys.ERRORS, 1)  # report 1 is counted, its value not published yet
    job.raised("s0", Phase.WAITING, rank=None, generation=-1)  # becomes report 2
    job.tick(0.1)
    assert job.coord.dead == {"s0"} and job.coord.spares == () and job.coord.job_error is None
    late = ErrorReport(1, "a1", 1, 0, Phase.START_UP, "AssertionError", "late", 0.0)
    key = Keys.ERROR.format(number=1)
    job.store.set(key, SEAL.seal(key, late.encode()))  # as a1's Membership publishes it
    job.tick(0.1)
    verdict = job.coord.job_error
    assert verdict is not None and verdict.report.member == "a1"


# ---------------------------------------------------------------------- in-place respawn
def test_a_crash_on_a_live_node_is_respawned_there_and_spends_no_spare() -> None:
    job = Job(world=4, per_node=2, spares=1, respawn_limit=2)
    job.die("a3")
    job.tick()
    assert job.agents.started == [(3, "a3", 1, "s1")]
    plan = job.m().plan(1)
    assert plan is not None and plan.dead == (3,) and plan.replaced == {3: "s1"}
    assert job.coord.spares == ("s0",)
    assert any("rank 3 <- s1 (respawned on node 1)" in line for line in job.said)
    job.report(1, [0, 1, 2])
    job.tick()
    assert job.decision(1) == Decision.roster(4)
    assert job.m().roster(1).slots[3] == "s1"


def test_a_respawned_process_lost_before_its_claim_is_respawned_again() -> None:
    job = Job(world=4, per_node=2, spares=1, respawn_limit=2)
    job.die("a3")
    job.tick()
    job.report(1, [0, 1, 2])
    job.tick()
    job.die("s1")  # the new process dies before it claimed rank 3
    job.tick()
    plan = job.m().plan(2)
    assert plan is not None and plan.replaced == {3: "s2"} and plan.dead == (3,)
    assert [s[3] for s in job.agents.started] == ["s1", "s2"]
    assert job.coord.spares == ("s0",)


def test_past_the_respawn_limit_a_node_uses_spares_until_the_window_passes() -> None:
    job = Job(world=4, per_node=2, spares=2, respawn_limit=1, respawn_window=100.0)
    job.die("a2")
    job.tick()
    job.report(1, [0, 1, 3])
    job.tick()
    assert job.decision(1) == Decision.roster(4)
    job.complete(1)
    job.die("a3")  # node 1's second failure within the window: a spare
    job.tick()
    plan = job.m().plan(2)
    assert plan is not None and plan.replaced == {3: "s0"}
    assert any("deadpool-respawn-limit" in line for line in job.said)
    assert job.events.of("respawn_refused")[-1]["why"] == "respawn limit reached"
    job.report(2, [0, 1, 2])
    job.tick()
    assert job.decision(2) == Decision.roster(4)
    job.complete(2)
    job.clock.advance(100.0)
    job.die("s0")  # the window has passed: node 1 may respawn again
    job.tick()
    plan = job.m().plan(3)
    assert plan is not None and plan.replaced == {3: "s3"} and job.coord.spares == ("s1",)


def test_a_lost_node_takes_spares_and_its_mates_elsewhere_still_respawn() -> None:
    job = Job(world=4, per_node=2, spares=2, respawn_limit=2)
    job.agents.lost.add(0)
    job.die("a0", "a2")  # node 0 lost; a2 crashed on node 1, which is fine
    job.tick()
    plan = job.m().plan(1)
    assert plan is not None and plan.replaced == {0: "s0", 2: "s2"}
    assert job.events.of("respawn_refused")[0]["why"] == "node lost"
    assert job.coord.spares == ("s1",)


def test_a_rank_moved_to_a_spare_node_is_respawned_there_after_its_node_was_lost() -> None:
    """Node 0 lost: spares s0 and s1 (spare node 2) take ranks 0 and 1. When s0 crashes
    later, its node is node 2, whose agent lives: respawned there, no spare needed."""
    job = Job(world=4, per_node=2, spares=2, respawn_limit=2)
    job.agents.lost.add(0)
    job.die("a0", "a1")
    job.tick()
    plan = job.m().plan(1)
    assert plan is not None and plan.replaced == {0: "s0", 1: "s1"}
    job.report(1, [2, 3])
    job.tick()
    assert job.decision(1) == Decision.roster(4)
    job.complete(1)
    job.die("s0")
    job.tick()
    plan = job.m().plan(2)
    assert plan is not None and plan.replaced == {0: "s2"}
    assert job.agents.started == [(0, "s0", 2, "s2")]


def test_more_crashes_than_spares_all_recovered_in_place() -> None:
    job = Job(world=4, per_node=1, spares=0, respawn_limit=2)
    for generation, member in enumerate(["a0", "a1", "a2"], start=1):
        job.die(member)
        job.tick()
        rank = int(member[1:])
        plan = job.m().plan(generation)
        assert plan is not None and plan.dead == (rank,) and plan.replaced[rank].startswith("s")
        job.report(generation, [r for r in range(4) if r != rank])
        job.tick()
        assert job.decision(generation) == Decision.roster(4)
        job.complete(generation)
    assert job.coord.out_of_redundancy is None and len(job.agents.started) == 3
    assert [r["respawned"] for r in job.coord.recoveries] == [{"0": 0}, {"1": 1}, {"2": 2}]


def test_a_standby_that_took_over_goes_on_counting_the_respawns_of_the_lost_coordinator() -> None:
    """Node 1's agent told this coordinator (a standby that took the job over) that it
    respawned a process 30 s ago: with one respawn per 100 s, node 1's next failure takes a
    spare, and one 70 s later is respawned again."""
    job = Job(world=4, per_node=2, spares=2, respawn_limit=1, respawn_window=100.0)
    job.m("agent1").set_respawn_history(1, RespawnHistory((30.0,)))
    job.die("a3")
    job.tick()
    plan = job.m().plan(1)
    assert plan is not None and plan.replaced == {3: "s0"}
    assert job.events.of("respawn_refused")[-1]["why"] == "respawn limit reached"
    job.report(1, [0, 1, 2])
    job.tick()
    assert job.decision(1) == Decision.roster(4)
    job.complete(1)
    job.clock.advance(69.0)  # 30 + 1 + 69: the earlier respawn left the window
    job.die("a2")
    job.tick()
    plan = job.m().plan(2)
    assert plan is not None and plan.replaced == {2: "s2"} and job.agents.started[-1][2] == 1


def test_respawn_budget_slides() -> None:
    budget = RespawnBudget(2, 10.0)
    assert budget.allows(0, 0.0)
    budget.spend(0, 0.0)
    budget.spend(0, 5.0)
    assert not budget.allows(0, 9.9) and budget.allows(1, 9.9)
    assert budget.allows(0, 10.0) and budget.used(0) == 1
    assert not RespawnBudget(0, 10.0).allows(0, 0.0)


def test_an_error_repeated_after_a_respawn_is_no_job_error_until_a_spare_repeats_it() -> None:
    """Rank 2 raises in training; its node respawns it, and the new process raises the same:
    on the same node and GPU that proves nothing about the job (a bad GPU repeats too), so the
    slot goes on - to a spare once the node's budget is spent; the spare, elsewhere, raising it
    too ends the job."""
    job = Job(world=4, per_node=2, spares=1, respawn_limit=1)
    message = "fault injection: rank 2 raises at iteration 4"
    job.raised("a2", Phase.TRAINING, rank=2, message=message)
    job.die("a2")
    job.tick()
    assert job.m().plan(1).replaced == {2: "s1"}  # type: ignore[union-attr]
    job.report(1, [0, 1, 3])
    job.tick()
    job.complete(1)
    job.raised("s1", Phase.TRAINING, rank=2, generation=1, message=message)
    job.die("s1")
    job.tick()
    assert job.coord.job_error is None
    plan = job.m().plan(2)
    assert plan is not None and plan.replaced == {2: "s0"}  # the budget is spent: a spare
    job.report(2, [0, 1, 3])
    job.tick()
    job.complete(2)
    job.raised("s0", Phase.TRAINING, rank=2, generation=2, message=message)
    job.die("s0")
    job.tick()
    verdict = job.coord.job_error
    assert verdict is not None and "spare s0 failed as s1 did" in verdict.reason


def test_a_node_that_cannot_start_a_process_hands_the_slot_to_a_spare() -> None:
    job = Job(world=4, per_node=2, spares=1, respawn_limit=1)

    def cannot(rank: int, dead: str, node: int) -> str:
        raise OSError(24, "Too many open files")

    job.agents.respawn = cannot  # type: ignore[method-assign]
    job.die("a2")
    job.tick()
    plan = job.m().plan(1)
    assert plan is not None and plan.replaced == {2: "s0"}
    assert "Too many open files" in job.events.of("respawn_refused")[0]["why"]


def test_a_rank_and_its_holder_crashing_together_on_live_nodes_lose_nothing() -> None:
    """Both processes are respawned on their nodes and report their predecessors' segment
    files: each restores from its own, no spare is spent, nothing is out of redundancy. With
    replicas that died with their processes (GPU memory) the same crash ends out of
    redundancy: rank 1's only copies were in the two dead processes."""
    for segments in (True, False):
        job = Job(world=4, per_node=1, spares=0, respawn_limit=1)
        holder = job.holder(1)
        job.die("a1", f"a{holder}")
        job.tick()
        plan = job.m().plan(1)
        assert plan is not None and sorted(plan.needy) == sorted([1, holder])
        job.report(1, [r for r in range(4) if r not in (1, holder)], segments=segments)
        job.tick()
        if segments:
            assert job.decision(1) == Decision.roster(4)
            assert job.m().sources(1).holders == {}  # both restore from their own files
        else:
            assert job.coord.out_of_redundancy is not None
            assert 1 in job.coord.out_of_redundancy.lost_ranks


def test_the_job_status_the_ranks_read_follows_spares_recoveries_and_the_standby() -> None:
    """`job/status` (for Megatron's TensorBoard/W&B scalars): published at the start and after
    each event that changes it - a spare taken, a recovery completed, a standby lost."""
    from megatron_deadpool.hotswap.protocol.messages import JobStatus
    from megatron_deadpool.hotswap.report.job_status import publish_status

    job = Job(spares=2, start=False)
    publish_status(job.events, job.coord, standbys=1)
    job.coord.start()
    assert job.m().job_status() == JobStatus(2, 0, 0, 1, 1)
    job.decided("a2")
    # s0 took rank 2's slot; the shard rank 2 held a copy of is short until a round commits
    short = (1, 1, 4)  # under-replicated shards, the recovery's generation, restore iteration
    assert job.m().job_status() == JobStatus(1, 0, 0, 1, 1, *short)
    job.complete(1)
    assert job.m().job_status() == JobStatus(1, 1, 0, 1, 1, *short)
    job.events("standby_lost", standby="h:1", ever_seen=True)
    assert job.m().job_status() == JobStatus(1, 1, 0, 1, 0, *short)


def test_a_strangers_add_to_the_failure_counter_opens_no_suspicion() -> None:
    """The failure counter is a hint anyone can add to: a stranger's add - or a survivor's old
    report copied back - makes no live rank whose heartbeat lags a suspect (it would be named
    dead after `suspect_after`, a recovery planned for nothing); a survivor's sealed report
    does, as before."""
    job = Job(world=4, spares=2, liveness=HeartbeatOnly(), suspect_after=3.0)
    job.tick()
    job.silent.add("a1")  # its heartbeat lags (a busy process), below the heartbeat timeout
    job.store.add(Keys.FAILURES, 5)
    job.tick(4.0)
    assert job.coord.dead == set() and job.m().plan(1) is None
    job.m("a2").report_failure("Connection closed by peer")
    job.tick()
    assert job.coord.dead == {"a1"}
    # The suspicion over, an old report copied back with a stranger's add: no new suspicion.
    job.tick(HEARTBEAT_TIMEOUT)
    old = job.store.get(Keys.LATEST_FAILURE)
    job.silent.add("a3")
    job.store.add(Keys.FAILURES, 1)
    job.store.set(Keys.LATEST_FAILURE, old)
    job.tick(4.0)
    assert "a3" not in job.coord.dead
    # Nor a survivor's report that lands after a later-numbered one, stamped later (its clock
    # ahead, or its set slower): numbered below the count already acted on.
    late = FailureReport(number=1, time=time.time() + 3600.0, why="Connection reset by peer")
    job.m("a0").core.set(Keys.LATEST_FAILURE, late.encode())
    job.store.add(Keys.FAILURES, 1)
    job.tick(4.0)
    assert "a3" not in job.coord.dead
