"""The coordinator: who takes which slot, the restore iteration, the end; it looks, decides, acts.

It runs inside the local launchers (`local_job.py`, where it can also see process exits and
kill a hung process) or on its own on a cluster's batch host (`deadpool coordinator`), where
heartbeats and the processes' own reports are its signals. Who is dead is the failure
detector's part (`detector.py`); each `tick()` reads what it needs from the store, its clock
and the nodes' agents into plain values, decides with the pure functions of `decide.py` and
hands the actions they come to to its executor (`execute.py`), which writes and reports them:
  1. for members that died since the last tick: when a death is the job's own error - a rank
     that reported an exception before replication started, a newcomer that failed as the
     member it replaced did (`job_error.judge`) - the verdict that ends the job (`JobError`, no
     spare spent); otherwise a plan for a new generation - the dead set and who takes their
     slots: a process the failed one's node respawns in its place, while that node's agent is
     alive and its respawn budget allows (`respawn.py`), else a spare (`Plan`) - or, once
     training completed, the end report of what was lost
     afterwards (`EndReport`: nothing to recompute);
  2. once every planned survivor reported its holdings, the restore iteration
     (`restore_plan.plan_restore`) and the new roster - or, when memory cannot recover the
     failure, the out-of-redundancy report naming the lost ranks and shards and what survivors
     save (`OutOfRedundancy`) - and its decision, which survivors block on; a survivor that
     does not report within the agreement timeout is presumed dead (a new plan);
  3. each phase's wall time, from the stamps ranks publish; the recovery is then complete, and
     the keys of the generations before the previous one are deleted over the next ticks, a
     batch each (`pruning.py`; what may go: `retention.py`).
Each tick also adds to the spare pool the processes that joined the running job
(`joining.py`). Every observation and decision goes to the event log (`events.py`). State
changes only through these methods (`add_spare` for a spare a launcher adds later); what
launchers read is read-only.

The cost of a tick does not grow with the job while nothing happens: heartbeats are read in one
batched sweep every `sweep_interval`, reports and phase stamps are counted by the store (one
round trip to look), and a loop that calls `wait()` between ticks wakes as soon as the last
expected report arrives instead of sleeping.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ...replication.placement import Placement, place_replicas
from ..protocol.coordinator_view import CoordinatorView
from ..protocol.joining import Joiners, next_spare_number
from ..protocol.messages import Decision, EndReport, JobError, OutOfRedundancy, Roster
from ..protocol.store_protocol import ServingStore
from ..protocol.wakeup import StoreWaiter, coordinator_inbox
from .actions import OrderRespawn, PendingRecovery
from .clock import Clock, SystemClock
from .decide import (
    Deaths,
    NodeState,
    Respawning,
    RespawnOutcome,
    decide_agreement,
    decide_deaths,
    late_newcomers,
)
from .detector import FailureDetector, SweepObserver
from .events import EventLog
from .execute import CoordinatorState, Executor
from .liveness import Liveness
from .pruning import Pruner
from .respawn import NodeAgents, RespawnBudget
from .settings import CoordinatorSettings


@dataclass(frozen=True)
class DecisionCost:
    """What deciding one recovery cost the coordinator (from the last report to the roster)."""

    t_start: float
    cpu_s: float
    wall_s: float


class DecisionObserver(Protocol):
    def decided(self, cost: DecisionCost) -> None: ...


class CoordinatorObserver(SweepObserver, DecisionObserver, Protocol):
    """What a benchmark watches: every heartbeat sweep, every decision."""


class Coordinator:
    """Failure handling for one job over its store."""

    def __init__(
        self,
        membership: CoordinatorView,
        world_size: int,
        placement: Placement | None,
        spares: list[str],
        *,
        heartbeat_timeout: float,
        agree_timeout: float,
        join_timeout: float = 600.0,
        liveness: Liveness,
        events: EventLog,
        say: Callable[[str], None] = lambda text: None,
        sweep_interval: float | None = None,
        suspect_after: float | None = None,
        clock: Clock | None = None,
        observer: CoordinatorObserver | None = None,
        agents: NodeAgents | None = None,
        respawn: RespawnBudget | None = None,
    ) -> None:
        """(Launchers, `deadpool coordinator` and the benchmarks build one from their settings:
        `from_settings`.) `placement` None: learnt from the layout rank 0 publishes.
        `join_timeout`: how long a newcomer may take to claim its slot once decided.
        `sweep_interval`, `suspect_after`: see `FailureDetector`. `say` prints a line for the
        user. `agents` and `respawn`: a failed rank's node starts its replacement while
        `respawn` allows (`respawn.py`); without them every failed rank takes a spare."""
        self.membership = membership
        self.world_size = world_size
        self.agree_timeout = agree_timeout
        self.join_timeout = join_timeout
        self.events = events
        self.say = say
        self.clock = clock or SystemClock()
        self.observer = observer
        membership.on_rejected = lambda key, why: events("rejected_value", key=key, why=why)
        self.detector = FailureDetector(
            membership,
            liveness,
            heartbeat_timeout=heartbeat_timeout,
            suspect_after=suspect_after,
            sweep_interval=sweep_interval,
            clock=self.clock,
            events=events,
            say=say,
            observer=observer,
        )
        self._placement = placement
        self._state = CoordinatorState(
            Roster(0, world_size, {r: f"a{r}" for r in range(world_size)}), list(spares)
        )
        self._handled: set[str] = set()  # dead members a plan already accounts for
        self._inbox: StoreWaiter | None = None
        self._pruner = Pruner(membership)
        self._agents = agents
        self._respawn = respawn if agents is not None else None
        self._act = Executor(
            self._state, membership, self.detector, events, say, self.clock, agents, self._respawn
        )
        self._joiners = Joiners(next_spare_number(spares))

    @classmethod
    def from_settings(
        cls,
        settings: CoordinatorSettings,
        membership: CoordinatorView,
        *,
        liveness: Liveness,
        events: EventLog,
        placement: Placement | None = None,
        say: Callable[[str], None] = lambda text: None,
        agents: NodeAgents | None = None,
        clock: Clock | None = None,
        observer: CoordinatorObserver | None = None,
    ) -> Coordinator:
        """The coordinator of the job `settings` describe (its spares s0.., respawns through
        `agents` within the settings' budget); the rest as for `Coordinator(...)`."""
        return cls(
            membership,
            settings.world_size,
            placement,
            settings.spare_names,
            heartbeat_timeout=settings.heartbeat_timeout,
            agree_timeout=settings.agree_timeout,
            join_timeout=settings.join_timeout,
            liveness=liveness,
            events=events,
            say=say,
            sweep_interval=settings.sweep_interval,
            suspect_after=settings.suspect_after,
            clock=clock,
            observer=observer,
            agents=agents,
            respawn=RespawnBudget(settings.respawn_limit, settings.respawn_window),
        )

    # ------------------------------------------------------------------ what launchers read
    @property
    def roster(self) -> Roster:
        """The newest published roster."""
        return self._state.roster

    @property
    def spares(self) -> tuple[str, ...]:
        """The spares still waiting, in the order they take slots."""
        return tuple(self._state.spares)

    @property
    def recovering(self) -> bool:
        """A recovery is planned and not complete (every rank restored)."""
        return self._state.recovery is not None

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """Each completed recovery: dead ranks, replacements, restore iteration, phases."""
        return list(self._state.recoveries)

    @property
    def out_of_redundancy(self) -> OutOfRedundancy | None:
        """Why memory could not recover a failure, once it could not (the job then ends)."""
        return self._state.out_of_redundancy

    @property
    def job_error(self) -> JobError | None:
        """The job's own error, once a death was one (the job then ends; no spare is spent)."""
        return self._state.job_error

    @property
    def ended(self) -> EndReport | None:
        """Members lost after training completed, once any was."""
        return self._state.ended

    @property
    def dead(self) -> frozenset[str]:
        return self.detector.dead

    @property
    def after_work(self) -> frozenset[str]:
        """Members gone after their work was done (no failure)."""
        return self.detector.after_work

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        """Publish generation 0's roster (ranks 0..W-1 are a0..a{W-1})."""
        self.membership.number_spares_from(self._joiners.seen)
        self.membership.publish_roster(self._state.roster)
        self.detector.watch(self._live())
        self.events("roster", generation=0, slots=self._state.roster.slots)

    def adopt(
        self,
        roster: Roster,
        spares: list[str],
        next_generation: int,
        dead: dict[str, str],
        lost_at: float | None = None,
    ) -> None:
        """Instead of `start`: go on with a job another coordinator ran (a standby taking over,
        `standby.py`) - its current roster, the spares still waiting, plans from
        `next_generation` on (those of the lost coordinator after the roster are settled: each
        superseded, its slots moved on), and the members known dead (member -> why), recovered
        next tick.
        `lost_at`: wall time the earlier coordinator last answered (the dead members failed at
        or after it, most likely with its node)."""
        if lost_at is not None:
            self.detector.lost_at(list(dead), lost_at)
        self._state.roster = roster
        self._state.spares = list(spares)
        self._state.next_generation = next_generation
        self._pruner = Pruner(self.membership, first=roster.generation)  # nothing older here
        known = [*spares, *roster.slots.values(), *dead]
        self._joiners = Joiners(next_spare_number(known))
        self.membership.number_spares_from(self._joiners.seen)
        self.membership.publish_roster(roster)
        # Plans the lost coordinator made after that roster: survivors may wait here on a
        # decision nothing else would write - superseded by the plan this one makes, which they
        # then report for (`Recovery.agree`) -, or, having read its decision (a roster this
        # store never held), on its newcomers' claims (`WorkerView.wait_newcomers`), which no
        # newcomer makes here: every slot is moved on, as `_plan` settles a decided plan's
        # unclaimed slots, so that they report for this one's plan too. (Which ranks were
        # newcomers only the lost store knew: one compare-and-set per rank, once.)
        for g in range(roster.generation + 1, next_generation):
            self.membership.decide(g, Decision.superseded(next_generation))
            for rank in range(roster.world_size):
                self.membership.move_slot_on(g, rank)
        self.events("roster", generation=roster.generation, slots=roster.slots, adopted=True)
        # They re-registered: judged by their beats, from one heartbeat timeout on. A process's
        # other connection (its heartbeat's, or its main thread's) may still be waiting on the
        # lost coordinator for up to its bound on a store operation, which is at most the
        # heartbeat timeout (`Driver.connect`), before it fails over here and beats again
        # (CI: ranks named hung 4.2 s after a takeover while their beats were on their way).
        self.detector.expect(self._live(), grace=self.detector.heartbeat_timeout)
        for member, why in dead.items():
            self.detector.mark_dead(member, why)

    def add_spare(self, member: str, event: str = "spare_added") -> None:
        """A spare joins the pool (a new one a launcher started, or one that re-registered
        with a standby late); it takes a slot after those already waiting."""
        if self.knows(member):
            return
        self._state.spares.append(member)
        self.detector.watch([member])
        self.events(event, member=member, spares=len(self._state.spares))

    def knows(self, member: str) -> bool:
        """Whether `member` is in the job: waiting, in a slot, or dead."""
        return (
            member in self._state.spares
            or member in self.dead
            or member in self._state.roster.slots.values()
            or member in self._slots().values()  # a planned newcomer (a respawn: `joining.py`)
        )

    def training_done(self) -> bool:
        """No recovery under way and every rank's member (but those lost after training)
        reported its work done, as seen through the store: a cluster's coordinator sees no
        process exit."""
        gone = self.after_work
        waiting = [m for m in self._state.roster.slots.values() if m not in gone]
        # The count first: one round trip per call, whatever the size of the job.
        done = self.membership.done_count() >= len(waiting) and self.membership.all_done(waiting)
        return self._state.recovery is None and done

    def salvage_outstanding(self) -> list[int]:
        """Out of redundancy: the surviving ranks that have neither saved their part of the
        snapshot set nor fallen silent (the store must serve them until they have)."""
        report = self._state.out_of_redundancy
        dead = set(report.dead_ranks) if report else set()
        pending = {r: m for r, m in self._state.roster.slots.items() if r not in dead}
        silent = self.detector.silent_among(list(pending.values()))
        return [
            r
            for r, m in pending.items()
            if m not in silent and not self.membership.all_salvaged([r])
        ]

    def wait(self, timeout_s: float) -> bool:
        """Sleep until a member wakes the coordinator (the last report of a recovery arrived)
        or `timeout_s` passed; call it between ticks instead of sleeping, and `close()` at the
        end."""
        if self._inbox is None:
            self._inbox = coordinator_inbox(self.membership)
        return self._inbox.wait(timeout_s)

    def wake(self) -> None:
        """End a `wait` under way now, from any thread (a launcher that saw one of its processes
        exit: the next tick reads it)."""
        inbox = self._inbox
        if inbox is not None:
            inbox.event.set()

    def close(self) -> None:
        """Stop the thread `wait` started (before the store goes away), and name every value
        left in the store that the job did not write (event `rejected_value`)."""
        if self._inbox is not None:
            self._inbox.stop()
            self._inbox = None
        if isinstance(self.membership.store, ServingStore):
            self.membership.audit()

    # ------------------------------------------------------------------ tick
    def tick(self) -> None:
        """One look at the job, and whatever decision it calls for."""
        self.detector.look(self._live, self._slots())
        self._look_for_joiners()
        fresh = self.detector.dead - self._handled
        if fresh:  # something died since the last tick: look at the slots (O(world) once)
            self._lost(fresh)
        rec = self._state.recovery
        if rec is not None and not self._ended():
            if rec.t_agreed is None:
                # No garbage collection while deciding: at 16,384 ranks the decision makes some
                # 100,000 objects, enough to start collections of this large heap midway (up to
                # 2.5x slower, measured); they run once the roster is out.
                gc.disable()
                try:
                    self._try_agree()
                finally:
                    gc.enable()
            if self._state.recovery is not None and self._state.recovery.t_agreed is not None:
                self._late_newcomers()
                self._track_phases()
        if self._state.recovery is None:
            self._pruner.step()

    def _look_for_joiners(self) -> None:
        """Spares that joined the running job (`joining.py`) enter the pool."""
        found = self._joiners.look(self.membership, self.clock.monotonic(), self.knows)
        for member in found.joined:
            self.add_spare(member, event="spare_joined")
            waiting = len(self._state.spares)
            self.say(f"{member} joined the spare pool ({waiting} spare(s) waiting)")
        for member, why in found.abandoned.items():
            self.events("join_abandoned", member=member, why=why)

    def _ended(self) -> bool:
        """The job ended by a decision: out of redundancy, or the job's own error."""
        return self._state.out_of_redundancy is not None or self._state.job_error is not None

    def _live(self) -> list[str]:
        """The members watched: spares and the current (or planned) slots, not dead ones."""
        members = dict.fromkeys([*self._state.spares, *self._slots().values()])
        return [m for m in members if not self.detector.is_dead(m)]

    def _slots(self) -> dict[int, str]:
        return self._state.recovery.slots if self._state.recovery else self._state.roster.slots

    def _lost(self, fresh: frozenset[str]) -> None:
        state = self._state
        for member in [m for m in state.spares if m in fresh]:
            state.spares.remove(member)
            self.events("spare_lost", member=member, spares_left=len(state.spares))
        slots = self._slots()
        dead = {r for r, m in slots.items() if m in fresh}
        placement = self.placement() if dead else None
        if placement is not None:
            node = placement.layout
            dead |= self.detector.silent_node_mates(
                dead, slots, lambda r: node.domain_ranks(node.domain(r)), self._handled
            )
        self._handled.update(fresh | {slots[r] for r in dead})
        self._pruner.died(state.next_generation, sorted(fresh))
        if not dead or self._ended():
            return
        seen = self._deaths(frozenset(dead), placement)
        outcomes: dict[int, RespawnOutcome] = {}
        done = 0
        while True:  # decide; a respawn order's outcome goes into the decision again
            actions = decide_deaths(seen, outcomes)
            for action in actions[done:]:
                done += 1
                if isinstance(action, OrderRespawn):
                    outcomes[action.rank] = self._act.respawn(action)
                    break
                self._act(action)
            else:
                return

    # ------------------------------------------------------------------ what it looks at
    def _deaths(self, dead: frozenset[int], placement: Placement | None) -> Deaths:
        """What the decision on `dead` needs: the coordinator's own record and what it reads
        from the store, its clock and the nodes' agents now."""
        state, rec = self._state, self._state.recovery
        base = self._slots()
        # A respawn runs on the same node and GPU: the same error again there proves nothing
        # about the job (a bad GPU repeats too); only a spare elsewhere repeating it does.
        chain = {new: old for new, old in state.replaced.items() if new not in state.respawned}
        # Read in the order the decision uses them (so the store sees the reads it saw before
        # the decisions were split from the acts).
        errors = self.detector.error_reports()
        completed = self.membership.training_complete() if rec is None else None
        now = self.clock.time()  # detected (before any wait for a node's agent's verdict)
        restored: set[int] = set()
        if rec is not None and rec.t_agreed is not None:  # its newcomers that restored already
            restored = {
                rank
                for rank in sorted(rec.needy - dead)
                if self.membership.stamp_time(rec.generation, "restored", rank) is not None
            }
        no_spare = rec is not None and bool(rec.no_spare)
        respawning = None if no_spare else self._respawning([base[r] for r in sorted(dead)])
        failure = (0.0, "")
        if rec is None:
            failure = self.detector.failure_time([base[r] for r in sorted(dead)])
        return Deaths(
            dead=dead,
            world_size=self.world_size,
            roster=state.roster,
            recovery=rec,
            next_generation=state.next_generation,
            spares=tuple(state.spares),
            beaten=frozenset(s for s in state.spares if self.detector.has_beaten(s)),
            errors=errors,
            chain=chain,
            completed=completed,
            restored=frozenset(restored),
            respawning=respawning,
            placement=placement,
            ended=state.ended,
            failure=failure,
            now=now,
            monotonic=self.clock.monotonic(),
            progress=self.membership.progress(),
        )

    def _respawning(self, dead: list[str]) -> Respawning | None:
        """What the nodes of `dead` members can respawn now; None: no respawn at all (no
        agents, or no layout yet: nothing was ever replicated)."""
        agents, budget = self._agents, self._respawn
        if agents is None or budget is None or self.placement() is None:
            return None
        node_of = {member: agents.node_of(member) for member in dead}
        nodes: dict[int, NodeState] = {}
        now = self.clock.monotonic()
        for node in dict.fromkeys(node_of.values()):
            if not agents.alive(node):
                nodes[node] = NodeState(alive=False)
                continue
            if not budget.recalled(node):  # its respawns for a coordinator this one replaced
                history = self.membership.respawn_history(node)
                budget.recall(node, history.ages if history else (), now)
            budget.allows(node, now)  # forgets the respawns older than the window
            nodes[node] = NodeState(alive=True, recent=budget.used(node))
        return Respawning(budget.limit, budget.window, node_of, nodes)

    def _try_agree(self) -> None:
        rec = self._state.recovery
        assert rec is not None
        g = rec.generation
        survivors = [r for r in range(self.world_size) if r not in rec.needy]
        reporters = survivors + sorted(rec.respawned)
        # The counter is a hint that anyone can add to: a count out of its range is rejected
        # (and reported), and by the agreement timeout the sealed reports decide alone.
        uncounted = self.membership.reports_missing(g)
        overdue = self.clock.monotonic() - rec.planned_at > self.agree_timeout
        if not -self.world_size - len(rec.respawned) <= uncounted <= len(reporters):
            self.membership.reject_holdings_count(g, -uncounted)
        holdings = None  # read in full once the store counted enough reports
        if uncounted <= 0 or uncounted > len(reporters) or overdue:
            holdings = self.membership.all_holdings(g, reporters)
        if holdings is None:
            if overdue:
                missing = [r for r in reporters if self.membership.holdings(g, r) is None]
                self.events("agree_timeout", generation=g, missing=missing)
                for r in missing:
                    self.detector.mark_dead(
                        rec.slots[r], "did not report for recovery (presumed dead)"
                    )
            return
        cpu0, t0 = time.thread_time(), time.time()
        placement = self.placement()
        n = self._state.next_generation
        self._act(decide_agreement(rec, holdings, placement, self.world_size, n))
        if self.observer is not None:
            self.observer.decided(
                DecisionCost(t_start=t0, cpu_s=time.thread_time() - cpu0, wall_s=time.time() - t0)
            )

    def placement(self) -> Placement | None:
        """The job's placement; a cluster coordinator learns the layout from rank 0 (None
        until rank 0 published it: no rank got as far as replicating)."""
        if self._placement is None:
            record = self.membership.layout()
            if record is None:
                return None
            self._placement = place_replicas(record.layout(), record.replicas)
        return self._placement

    def _late_newcomers(self) -> None:
        """Newcomers that have not claimed their slot a join timeout after the decision are
        taken for lost (killed where the launcher can: `decide.late_newcomers`)."""
        rec = self._state.recovery
        assert rec is not None and rec.agreed_at is not None
        waited = self.clock.monotonic() - rec.agreed_at
        if waited <= self.join_timeout:
            return
        for action in late_newcomers(
            rec, waited, self.join_timeout, self.detector.dead, self._claimed(rec)
        ):
            self._act(action)

    def _claimed(self, rec: PendingRecovery) -> frozenset[int]:
        """The newcomers' slots of `rec` claimed so far (read for the live newcomers only)."""
        return frozenset(
            rank
            for rank in sorted(rec.needy)
            if not self.detector.is_dead(rec.slots[rank])
            and self.membership.claimed(rec.generation, rank)
        )

    def _track_phases(self) -> None:
        rec = self._state.recovery
        assert rec is not None and rec.t_agreed is not None and rec.restore_iteration is not None
        g, ranks, m = rec.generation, list(range(self.world_size)), self.membership
        # The counts are hints anyone can add to: the stamps confirm them, read once the counts
        # say they are in, or the agreement timeout passed since the decision.
        overdue = self.clock.monotonic() - (rec.agreed_at or 0.0) > self.agree_timeout
        if not overdue and (  # one round trip while waiting
            m.stamp_count(g, "first_iteration") < 1
            or any(m.stamp_count(g, phase) < self.world_size for phase in ("restored", "joined"))
        ):
            return
        stamps = [m.stamp_times(g, "joined", ranks), m.stamp_times(g, "restored", ranks)]
        stamps.append(m.stamp_times(g, "first_iteration", [0]))
        if any(s is None for s in stamps):
            return
        joined, restored, first = (max(s or [0.0]) for s in stamps)
        phases = {
            "detect": rec.t_detect - rec.t_failure,
            "agree": rec.t_agreed - rec.t_detect,
            "reconstruct": joined - rec.t_agreed,
            "restore": restored - joined,
            "first_iteration": first - restored,
        }
        # With the newcomers of an earlier plan of it that restored before a death continued it.
        earlier = rec.restored_earlier
        replaced = {r: rec.slots[r] for r in sorted(rec.needy | earlier.keys())}
        respawned = {**{r: n for r, n in earlier.items() if n is not None}, **rec.respawned}
        record: dict[str, Any] = {
            "generation": g,
            "dead_ranks": sorted(rec.dead),
            "replaced_by": {str(r): m for r, m in replaced.items()},
            "respawned": {str(r): node for r, node in sorted(respawned.items())},
            "restore_iteration": rec.restore_iteration,
            "recomputed_iterations": max(0, rec.prev_last_iteration - rec.restore_iteration),
            "phases_s": {k: round(max(0.0, v), 4) for k, v in phases.items()},
            "failure_time": rec.failure_evidence,
            "stale_group_refs": m.stale_refs(g),
            "total_s": round(first - rec.t_failure, 4),
        }
        # Of the reconstruct: until the last newcomer, its objects built, claimed its slot.
        claimed = m.stamp_times(g, "claimed", sorted(rec.needy)) if rec.needy else None
        if claimed:
            record["newcomers_claimed_s"] = round(max(0.0, max(claimed) - rec.t_agreed), 4)
        self._state.recoveries.append(record)
        self._pruner.completed(g)
        self.events("recovered", **record)
        self.say(
            f"recovered in {record['total_s']:.2f}s: "
            + ", ".join(f"{k} {v:.2f}s" for k, v in record["phases_s"].items())
            + f"; recomputed {record['recomputed_iterations']} iteration(s)"
        )
        self._state.recovery = None
