"""The coordinator's decisions: who takes which slot, the restore iteration, the end.

It runs inside the local launchers (`local_job.py`, where it can also see process exits and
kill a hung process) or on its own on a cluster's batch host (`deadpool coordinator`), where
heartbeats and the processes' own reports are its signals. Who is dead is the failure
detector's part (`detector.py`); each `tick()` then:
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
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...errors import ExitCode
from ...replication.placement import Placement, place_replicas
from ..protocol.coordinator_view import CoordinatorView
from ..protocol.joining import Joiners, next_spare_number
from ..protocol.messages import (
    Decision,
    EndReport,
    HoldingsReport,
    JobError,
    OutOfRedundancy,
    Plan,
    Roster,
    SaveOrder,
    Sources,
)
from ..protocol.store_protocol import ServingStore
from ..protocol.wakeup import StoreWaiter, coordinator_inbox
from .clock import Clock, SystemClock
from .detector import FailureDetector, SweepObserver
from .events import EventLog
from .job_error import judge
from .liveness import Liveness
from .pruning import Pruner
from .respawn import NodeAgents, RespawnBudget
from .restore_plan import RestorePlan, plan_restore, plan_salvage


@dataclass
class PendingRecovery:
    """One recovery in progress (re-planned with a larger dead set if more ranks die)."""

    generation: int
    dead: set[int]
    slots: dict[int, str]
    needy: set[int]
    t_failure: float
    failure_evidence: str
    """What `t_failure` is: an injected fault's own stamp, or the last heartbeat seen (the
    failure happened at or after it: `detect` is then an upper bound)."""
    t_detect: float
    t_plan: float
    planned_at: float
    """When it was planned, on the monotonic clock (the agreement timeout runs from here)."""
    prev_last_iteration: int = 0
    no_spare: str = ""
    """Why this recovery can only save what survives (no spare left), if so."""
    respawned: dict[int, int] = field(default_factory=dict)
    """rank -> node, for the dead ranks whose node respawned a process in place."""
    restored_earlier: dict[int, int | None] = field(default_factory=dict)
    """rank -> the node that respawned its newcomer (None: a spare), for the newcomers of an
    earlier plan of this recovery that restored before a death continued it (reported only;
    the newcomer is still the rank's slot)."""
    t_agreed: float | None = None
    agreed_at: float | None = None
    """When it was decided, on the monotonic clock (the join timeout runs from here)."""
    restore_iteration: int | None = None


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


@dataclass
class _Outcome:
    """What the job came to, as far as the coordinator decides it."""

    recoveries: list[dict[str, Any]] = field(default_factory=list)
    out_of_redundancy: OutOfRedundancy | None = None
    ended: EndReport | None = None
    job_error: JobError | None = None


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
        """`placement` None: learnt from the layout rank 0 publishes. `join_timeout`: how
        long a newcomer may take to claim its slot once decided (`_late_newcomers`).
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
        self._spares = list(spares)
        self._roster = Roster(0, world_size, {r: f"a{r}" for r in range(world_size)})
        self._recovery: PendingRecovery | None = None
        self._outcome = _Outcome()
        self._handled: set[str] = set()  # dead members a plan already accounts for
        self._replaced: dict[str, str] = {}  # newcomer -> the member whose slot it took
        self._next_generation = 1
        self._inbox: StoreWaiter | None = None
        self._pruner = Pruner(membership)
        self._agents = agents
        self._respawn = respawn if agents is not None else None
        self._respawned: set[str] = set()  # members a node's agent started in a failed one's place
        self._joiners = Joiners(next_spare_number(self._spares))

    # ------------------------------------------------------------------ what launchers read
    @property
    def roster(self) -> Roster:
        """The newest published roster."""
        return self._roster

    @property
    def spares(self) -> tuple[str, ...]:
        """The spares still waiting, in the order they take slots."""
        return tuple(self._spares)

    @property
    def recovering(self) -> bool:
        """A recovery is planned and not complete (every rank restored)."""
        return self._recovery is not None

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """Each completed recovery: dead ranks, replacements, restore iteration, phases."""
        return list(self._outcome.recoveries)

    @property
    def out_of_redundancy(self) -> OutOfRedundancy | None:
        """Why memory could not recover a failure, once it could not (the job then ends)."""
        return self._outcome.out_of_redundancy

    @property
    def job_error(self) -> JobError | None:
        """The job's own error, once a death was one (the job then ends; no spare is spent)."""
        return self._outcome.job_error

    @property
    def ended(self) -> EndReport | None:
        """Members lost after training completed, once any was."""
        return self._outcome.ended

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
        self.membership.publish_roster(self._roster)
        self.detector.watch(self._live())
        self.events("roster", generation=0, slots=self._roster.slots)

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
        `next_generation` on, and the members known dead (member -> why), recovered next tick.
        `lost_at`: wall time the earlier coordinator last answered (the dead members failed at
        or after it, most likely with its node)."""
        if lost_at is not None:
            self.detector.lost_at(list(dead), lost_at)
        self._roster = roster
        self._spares = list(spares)
        self._next_generation = next_generation
        self._pruner = Pruner(self.membership, first=roster.generation)  # nothing older here
        known = [*spares, *roster.slots.values(), *dead]
        self._joiners = Joiners(next_spare_number(known))
        self.membership.number_spares_from(self._joiners.seen)
        self.membership.publish_roster(roster)
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
        self._spares.append(member)
        self.detector.watch([member])
        self.events(event, member=member, spares=len(self._spares))

    def knows(self, member: str) -> bool:
        """Whether `member` is in the job: waiting, in a slot, or dead."""
        return (
            member in self._spares
            or member in self.dead
            or member in self._roster.slots.values()
            or member in self._slots().values()  # a planned newcomer (a respawn: `joining.py`)
        )

    def training_done(self) -> bool:
        """No recovery under way and every rank's member (but those lost after training)
        reported its work done, as seen through the store: a cluster's coordinator sees no
        process exit."""
        gone = self.after_work
        waiting = [m for m in self._roster.slots.values() if m not in gone]
        # The count first: one round trip per call, whatever the size of the job.
        done = self.membership.done_count() >= len(waiting) and self.membership.all_done(waiting)
        return self._recovery is None and done

    def salvage_outstanding(self) -> list[int]:
        """Out of redundancy: the surviving ranks that have neither saved their part of the
        snapshot set nor fallen silent (the store must serve them until they have)."""
        report = self._outcome.out_of_redundancy
        dead = set(report.dead_ranks) if report else set()
        pending = {r: m for r, m in self._roster.slots.items() if r not in dead}
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
        rec = self._recovery
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
            if self._recovery is not None and self._recovery.t_agreed is not None:
                self._late_newcomers()
                self._track_phases()
        if self._recovery is None:
            self._pruner.step()

    def _look_for_joiners(self) -> None:
        """Spares that joined the running job (`joining.py`) enter the pool."""
        found = self._joiners.look(self.membership, self.clock.monotonic(), self.knows)
        for member in found.joined:
            self.add_spare(member, event="spare_joined")
            self.say(f"{member} joined the spare pool ({len(self._spares)} spare(s) waiting)")
        for member, why in found.abandoned.items():
            self.events("join_abandoned", member=member, why=why)

    def _ended(self) -> bool:
        """The job ended by a decision: out of redundancy, or the job's own error."""
        return self._outcome.out_of_redundancy is not None or self._outcome.job_error is not None

    def _live(self) -> list[str]:
        """The members watched: spares and the current (or planned) slots, not dead ones."""
        members = dict.fromkeys([*self._spares, *self._slots().values()])
        return [m for m in members if not self.detector.is_dead(m)]

    def _slots(self) -> dict[int, str]:
        return self._recovery.slots if self._recovery else self._roster.slots

    def _lost(self, fresh: frozenset[str]) -> None:
        for member in [m for m in self._spares if m in fresh]:
            self._spares.remove(member)
            self.events("spare_lost", member=member, spares_left=len(self._spares))
        slots = self._slots()
        dead = {r for r, m in slots.items() if m in fresh}
        placement = self.placement() if dead else None
        if placement is not None:
            node = placement.layout
            dead |= self.detector.silent_node_mates(
                dead, slots, lambda r: node.domain_ranks(node.domain(r)), self._handled
            )
        self._handled.update(fresh | {slots[r] for r in dead})
        self._pruner.died(self._next_generation, sorted(fresh))
        if not dead or self._ended():
            return
        # A respawn runs on the same node and GPU: the same error again there proves nothing
        # about the job (a bad GPU repeats too); only a spare elsewhere repeating it does.
        chain = {new: old for new, old in self._replaced.items() if new not in self._respawned}
        verdict = judge({r: slots[r] for r in dead}, self.detector.error_reports(), chain)
        if verdict is not None:
            self._end_job_error(verdict)
            return
        completed = self.membership.training_complete() if self._recovery is None else None
        if completed is None:
            self._plan(dead)
        else:
            self._end(dead, completed)

    # ------------------------------------------------------------------ deciding
    def _plan(self, dead: set[int]) -> None:
        rec, now = self._recovery, self.clock.time()
        base = rec.slots if rec else self._roster.slots
        all_dead = (rec.dead if rec else set()) | dead
        slots = dict(base)
        needy = set(rec.needy) if rec else set()
        no_spare = rec.no_spare if rec else ""
        respawned = dict(rec.respawned) if rec else {}
        restored_earlier = dict(rec.restored_earlier) if rec else {}
        if rec is not None and rec.t_agreed is not None:  # decided; not everyone joined yet
            # Its survivors wait for every newcomer's claim (`wait_newcomers`); it will not be
            # joined now: settle every slot not claimed yet, so that they move on to this plan
            # - a newcomer lost is given up, a live one takes its slot in this plan instead.
            # A newcomer that restored already holds its state and its owners' replicas: it
            # survives into this plan and reports (one restoring after this read stays needy:
            # it claims its slot again as it agrees, `Recovery.agree`).
            for rank in sorted(rec.needy):
                if rank in dead:
                    self.membership.give_up_slot(rec.generation, rank)
                elif self.membership.stamp_time(rec.generation, "restored", rank) is not None:
                    needy.discard(rank)
                    restored_earlier[rank] = respawned.pop(rank, None)
                else:
                    self.membership.move_slot_on(rec.generation, rank)
        for rank in sorted(dead):
            needy.add(rank)
            respawned.pop(rank, None)
            restored_earlier.pop(rank, None)
            respawn = None if no_spare else self._respawn_in_place(rank, base[rank])
            if respawn is not None:
                slots[rank], respawned[rank] = respawn
            elif self._spares and not no_spare:
                slots[rank] = self._take_spare()
            else:  # nothing can take the slot: agree anyway, to save what survives
                no_spare = f"no spare left to replace rank(s) {sorted(all_dead)}"
                continue
            self._replaced[slots[rank]] = base[rank]
        generation = self._next_generation
        self._next_generation += 1
        if rec is not None:
            t_failure, evidence, t_detect = rec.t_failure, rec.failure_evidence, rec.t_detect
        else:
            t_failure, evidence = self.detector.failure_time([base[r] for r in dead])
            t_detect = now
        self._recovery = PendingRecovery(
            generation=generation,
            dead=all_dead,
            slots=slots,
            needy=needy,
            t_failure=t_failure,
            failure_evidence=evidence,
            t_detect=t_detect,
            t_plan=now,
            planned_at=self.clock.monotonic(),
            prev_last_iteration=self.membership.progress(),
            no_spare=no_spare,
            respawned=respawned,
            restored_earlier=restored_earlier,
        )
        # What every survivor reads: the changes to the published roster, not all the slots
        # (16,384 survivors reading 200 KB each would keep the store busy for seconds).
        published = self._roster.slots
        plan = Plan(
            generation=generation,
            base=self._roster.generation,
            world_size=self.world_size,
            dead=tuple(sorted(all_dead)),
            needy=tuple(sorted(needy)),
            replaced={r: m for r, m in slots.items() if published[r] != m},
        )
        self.membership.publish_plan(plan)
        if respawned:  # a respawned process waits as spares do: it reports once it sees the plan
            self.membership.wake_spares()
        # Survivors report without waiting for the plan: some reports may be in already.
        # ... and the processes respawned in place, from their segment files (they report too).
        self.membership.expect_reports(generation, self.world_size - len(needy) + len(respawned))
        if rec is not None:  # survivors waiting on the old plan move on to this one
            self.membership.decide(rec.generation, Decision.superseded(generation))
        self.events("plan", generation=generation, dead=plan.dead, needy=plan.needy, slots=slots)
        replaced = ", ".join(
            (
                f"rank {r} <- {slots[r]}"
                + (f" (respawned on node {respawned[r]})" if r in respawned else "")
                if slots[r] != base[r]
                else f"rank {r}: no spare"
            )
            for r in sorted(dead)
        )
        self.say(f"recovery: generation {generation}, dead ranks {sorted(all_dead)}; {replaced}")

    def _take_spare(self) -> str:
        """The first spare whose heartbeat was seen, else the first: a spare still starting up
        (a refill, a joining one) would make the survivors wait for its start-up - and for
        ever if it never ends, as no heartbeat judges a process that never beat."""
        member = next((s for s in self._spares if self.detector.has_beaten(s)), self._spares[0])
        self._spares.remove(member)
        return member

    def _respawn_in_place(self, rank: int, dead: str) -> tuple[str, int] | None:
        """A new process in the place of `dead` (which held `rank`) on its node, when that
        node's agent is alive and its respawn budget allows one: its member name and the node;
        None: take a spare."""
        if self._agents is None or self._respawn is None or self.placement() is None:
            return None
        node, now = self._agents.node_of(dead), self.clock.monotonic()
        if not self._agents.alive(node):
            self.events("respawn_refused", rank=rank, node=node, why="node lost")
            return None
        if not self._respawn.recalled(node):  # its respawns for a coordinator this one replaced
            history = self.membership.respawn_history(node)
            self._respawn.recall(node, history.ages if history else (), now)
        if not self._respawn.allows(node, now):
            self.events("respawn_refused", rank=rank, node=node, why="respawn limit reached")
            self.say(
                f"node {node}: {self._respawn.used(node)} respawn(s) within "
                f"{self._respawn.window:g}s (deadpool-respawn-limit): no respawn for rank {rank}"
            )
            return None
        try:
            member = self._agents.respawn(rank, dead, node)
        except OSError as exc:  # the node cannot start a process (fork server, limits): a spare
            self.events("respawn_refused", rank=rank, node=node, why=f"cannot start one: {exc}")
            return None
        self._respawn.spend(node, now)
        self._respawned.add(member)
        self.detector.watch([member])
        self.events("respawned", rank=rank, node=node, member=member, replaces=dead)
        return member, node

    def _try_agree(self) -> None:
        rec = self._recovery
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
        self._agree(rec, holdings)
        if self.observer is not None:
            self.observer.decided(
                DecisionCost(t_start=t0, cpu_s=time.thread_time() - cpu0, wall_s=time.time() - t0)
            )

    def _agree(self, rec: PendingRecovery, holdings: dict[int, HoldingsReport]) -> None:
        g = rec.generation
        last = max([rec.prev_last_iteration] + [h.last_completed for h in holdings.values()])
        rec.prev_last_iteration = last
        holds = {r: h.holds for r, h in holdings.items()}
        placement = self.placement()
        if placement is None:  # failed during start-up: nothing was ever replicated
            self._end_out_of_redundancy(
                f"rank(s) {sorted(rec.dead)} failed before replication started: nothing in "
                "memory to recover from (see their logs)",
                lost_ranks=sorted(rec.dead),
            )
            return
        plan = plan_restore(placement, holds, rec.needy, rec.respawned)
        if rec.no_spare or not plan.ok:
            survivors = {r: h for r, h in holds.items() if r not in rec.needy}  # they save
            self._end_out_of_redundancy(
                rec.no_spare or plan.reason,
                lost_ranks=plan.lost_ranks,
                dead=sorted(rec.dead),
                save=self._save_order(placement, plan, survivors, rec.needy),
            )
            return
        assert plan.iteration is not None
        rec.t_agreed, rec.agreed_at = self.clock.time(), self.clock.monotonic()
        rec.restore_iteration = plan.iteration
        roster = Roster(g, self.world_size, rec.slots, restore_iteration=plan.iteration)
        self.membership.publish_sources(g, Sources(plan.sources))
        self.membership.publish_roster(roster)
        self.membership.decide(g, Decision.roster(plan.iteration))
        self._roster = roster
        self.events(
            "agreed",
            generation=g,
            restore_iteration=plan.iteration,
            sources=plan.sources,
            last_completed=last,
        )
        self.say(
            f"agreed: restore iteration {plan.iteration}, "
            + (
                "shards from " + ", ".join(f"rank {h} -> rank {n}" for n, h in plan.sources.items())
                if plan.sources
                else "every rank from its own snapshot"
            )
        )

    def _save_order(
        self,
        placement: Placement,
        plan: RestorePlan,
        holds: dict[int, dict[str, tuple[int, ...]]],
        needy: set[int],
    ) -> SaveOrder | None:
        """What survivors write before stopping: one common iteration, and who writes what."""
        salvage = plan_salvage(placement, holds, needy, plan)
        if salvage is None:
            return None
        return SaveOrder(
            iteration=salvage.iteration,
            sources=dict(salvage.sources),
            complete=salvage.complete,
            missing=tuple(salvage.missing(needy)),
        )

    def _end_out_of_redundancy(
        self,
        reason: str,
        *,
        lost_ranks: list[int],
        dead: list[int] | None = None,
        save: SaveOrder | None = None,
    ) -> None:
        placement = self.placement()
        holders = placement.holders if placement is not None else None
        report = OutOfRedundancy(
            reason=reason,
            dead_ranks=tuple(dead if dead is not None else lost_ranks),
            lost_ranks=tuple(lost_ranks),
            lost_shards_holders={r: tuple(holders[r]) if holders else () for r in lost_ranks},
            save=save,
        )
        self._outcome.out_of_redundancy = report
        # Survivors waiting on the current plan, and those that report for the next
        # generation, see the decision.
        generations = [self._next_generation]
        if self._recovery is not None:
            generations.append(self._recovery.generation)
        self.membership.publish_out_of_redundancy(report, generations)
        self.events("out_of_redundancy", **report.to_dict())
        self.say(f"OUT OF REDUNDANCY: {reason}")

    def _end_job_error(self, verdict: JobError) -> None:
        """The job's own error: no plan, no spare; the job ends (the launchers stop it)."""
        self._outcome.job_error = verdict
        self.membership.publish_job_error(verdict)
        self.events("job_error", **verdict.to_dict())
        self.say(f"JOB ERROR: {verdict.report.cause()}")
        self.say(f"{verdict.reason}; no spare used: fix the job (exit code {ExitCode.JOB_ERROR:d})")

    def _end(self, dead: set[int], completed: int) -> None:
        """Ranks lost after training completed: no recovery (nothing to recompute); the
        survivors are told who died and who holds each dead rank's final state, to save it."""
        earlier = self._outcome.ended
        all_dead = sorted(set(earlier.dead_ranks if earlier else ()) | dead)
        placement = self.placement()
        sources: dict[int, int] = {}
        for rank in all_dead:
            holders = placement.holders[rank] if placement else ()
            alive = [h for h in holders if h not in all_dead]
            if alive:
                sources[rank] = alive[0]
        lost = tuple(r for r in all_dead if r not in sources)
        report = EndReport(
            reason=f"rank(s) {all_dead} lost after training completed at iteration {completed}",
            completed_iteration=completed,
            dead_ranks=tuple(all_dead),
            lost_ranks=lost,
            save=SaveOrder(iteration=completed, sources=sources, complete=not lost, missing=lost),
        )
        self._outcome.ended = report
        for rank in dead:
            self.detector.mark_after_work(self._roster.slots[rank])
        self.membership.publish_end(report)
        self.events("lost_after_training", **report.to_dict())
        self.say(
            f"rank(s) {sorted(dead)} lost after training completed at iteration {completed}: "
            "nothing to recompute"
            + (f"; the final state of rank(s) {list(lost)} is gone with them" if lost else "")
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
        """A newcomer that has not claimed its slot a join timeout after the decision is taken
        for lost (killed where the launcher can): the survivors wait for every claim, so one
        stuck in its build - alive, beating - would hold them for ever. The next plan gives
        its slot to another spare."""
        rec = self._recovery
        assert rec is not None and rec.agreed_at is not None
        if self.clock.monotonic() - rec.agreed_at <= self.join_timeout:
            return
        for rank in sorted(rec.needy):
            member = rec.slots[rank]
            if not self.detector.is_dead(member) and not self.membership.claimed(
                rec.generation, rank
            ):
                self.detector.condemn(
                    member,
                    f"did not take rank {rank}'s slot within {self.join_timeout:g}s of the "
                    "decision (deadpool-join-timeout)",
                )

    def _track_phases(self) -> None:
        rec = self._recovery
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
        self._outcome.recoveries.append(record)
        self._pruner.completed(g)
        self.events("recovered", **record)
        self.say(
            f"recovered in {record['total_s']:.2f}s: "
            + ", ".join(f"{k} {v:.2f}s" for k, v in record["phases_s"].items())
            + f"; recomputed {record['recomputed_iterations']} iteration(s)"
        )
        self._recovery = None
