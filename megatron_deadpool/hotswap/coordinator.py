"""The coordinator: watches processes and heartbeats, assigns spares, drives agreement.

It runs inside `deadpool train`'s launcher (where it can also see process exits and kill a
hung process) or on its own on a cluster's batch host (`deadpool coordinator`), where
heartbeats are its only signal. Each `tick()`:
  1. notices dead actives (an exit the launcher saw, or a heartbeat counter that has not moved
     for the heartbeat timeout, timed on the coordinator's own monotonic clock: a hung process
     is killed where the coordinator can, so its sockets close and peers unblock). Once a
     survivor reported a failed collective, a rank that stays silent for `suspect_after`
     (shorter) is named dead too, and so are the silent ranks on a dead rank's node;
  2. publishes a plan for a new generation: the dead set and the spares taking their slots;
  3. once every planned survivor reported its holdings, computes the restore iteration
     (`restore_plan.plan_restore`) and publishes the new roster - or, when memory cannot
     recover the failure, an abort naming the lost ranks and shards - and its decision, which
     survivors block on;
  4. records each phase's wall time from the timestamps ranks publish.
Every decision is appended to the event log (JSON lines).

The cost of a tick does not grow with the job while nothing happens: heartbeats are read in one
batched sweep every `sweep_interval`, reports and phase stamps are counted by the store (one
round trip to look), and a loop that calls `wait()` between ticks wakes as soon as the last
expected report arrives instead of sleeping.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..replication.placement import Layout, Placement, place_replicas
from .heartbeats import HeartbeatClock
from .liveness import Liveness
from .membership import Membership
from .restore_plan import plan_restore, plan_salvage
from .roster import Roster
from .wakeup import StoreWaiter, coordinator_inbox

log = logging.getLogger("megatron_deadpool.hotswap.coordinator")


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
    prev_last_iteration: int = 0
    no_spare: str = ""
    """Why this recovery can only save what survives (no spare left), if so."""
    t_agreed: float | None = None
    restore_iteration: int | None = None
    record: dict[str, Any] = field(default_factory=dict)


class EventLog:
    """Append-only JSON-lines log of the coordinator's observations and decisions."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: str, **fields: Any) -> None:
        entry = {"t": time.time(), "event": event, **fields}
        self.events.append(entry)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")


class Coordinator:
    """Failure handling for one job over its store."""

    def __init__(
        self,
        members: Membership,
        world_size: int,
        placement: Placement | None,
        spares: list[str],
        *,
        heartbeat_timeout: float,
        agree_timeout: float,
        liveness: Liveness,
        events: EventLog,
        on_event: Callable[[str], None] = lambda text: None,
        sweep_interval: float | None = None,
        suspect_after: float | None = None,
    ) -> None:
        """`sweep_interval`: seconds between heartbeat sweeps (default: the heartbeat
        timeout / 20, so a hang is named at most 5% after the timeout). `suspect_after`: once
        a survivor reported a failed collective, a rank silent this long (default: the
        heartbeat timeout) is declared dead - a crashed process's peers see its connections
        close at once, and its heartbeat has stopped."""
        self.members = members
        self.placement = placement
        self.world = world_size
        self.spares = list(spares)
        self.heartbeat_timeout = heartbeat_timeout
        self.agree_timeout = agree_timeout
        self.liveness = liveness
        self.events = events
        self.on_event = on_event
        self.roster = Roster(0, self.world, {r: f"a{r}" for r in range(self.world)})
        self.dead_pids: set[str] = set()
        self.handled: set[str] = set()  # dead processes a plan already accounts for
        self.recovery: PendingRecovery | None = None
        self.finished: list[dict[str, Any]] = []
        self.aborted: dict[str, Any] | None = None
        self.next_generation = 1
        self.sweep_interval = heartbeat_timeout / 20 if sweep_interval is None else sweep_interval
        self.beats = HeartbeatClock()
        self.done_pids: set[str] = set()  # finished their work: silent on purpose
        self._watched: set[str] = set()  # pids whose heartbeat counter exists
        self._next_sweep = 0.0
        self._inbox: StoreWaiter | None = None
        self.suspect_after = min(suspect_after or heartbeat_timeout, heartbeat_timeout)
        self.failures_seen = 0
        self.suspicion_base = 0  # failure reports seen before the current suspicion
        self.suspicious_until = 0.0  # (monotonic) while a reported failure is unexplained
        self.suspects: set[str] = set()  # who a reported failure can be explained by
        self.ended: dict[str, Any] | None = None  # processes lost after training completed
        self.after_training: set[str] = set()  # processes gone after their work was done
        self.lost_at: dict[str, float] = {}  # pid -> when it was lost, known otherwise (`adopt`)

    def start(self) -> None:
        self.members.publish_roster(self.roster)
        self._watch(self._live_pids())
        self.events("roster", generation=0, slots=self.roster.slots)

    def training_done(self) -> bool:
        """No recovery under way and every rank's process (but those lost after training)
        reported its work done, as seen through the store: a cluster's coordinator sees no
        process exit."""
        waiting = [p for p in self.roster.slots.values() if p not in self.after_training]
        # The count first: one round trip per call, whatever the size of the job.
        done = self.members.done_count() >= len(waiting) and self.members.all_done(waiting)
        return self.recovery is None and done

    def wait(self, timeout_s: float) -> bool:
        """Sleep until a process wakes the coordinator (the last report of a recovery
        arrived) or `timeout_s` passed; call it between ticks instead of sleeping, and
        `close()` at the end."""
        if self._inbox is None:
            self._inbox = coordinator_inbox(self.members)
        return self._inbox.wait(timeout_s)

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
        `next_generation` on, and the processes known dead (pid -> why), recovered next tick.
        `lost_at`: wall time the earlier coordinator last answered (the dead processes failed
        at or after it, most likely with its node)."""
        if lost_at is not None:
            self.lost_at.update({pid: lost_at for pid in dead})
        self.roster = roster
        self.spares = list(spares)
        self.next_generation = next_generation
        self.members.publish_roster(roster)
        self.events("roster", generation=roster.generation, slots=roster.slots, adopted=True)
        now = time.monotonic()
        for pid in self._live_pids():  # they re-registered: judged by their beats from now on
            self.beats.expect(pid, now)
        self._watch(self._live_pids())
        for pid, why in dead.items():
            self._mark_dead(pid, why)

    def close(self) -> None:
        """Stop the thread `wait` started (before the store goes away)."""
        if self._inbox is not None:
            self._inbox.stop()
            self._inbox = None

    # ------------------------------------------------------------------ liveness
    def _live_pids(self) -> list[str]:
        """The processes watched: spares and the current (or planned) slots, not dead ones."""
        current = self.recovery.slots if self.recovery else self.roster.slots
        pids = dict.fromkeys([*self.spares, *current.values()])
        return [p for p in pids if p not in self.dead_pids]

    def _watch(self, pids: list[str]) -> None:
        new = [p for p in pids if p not in self._watched]
        if new:
            self.members.watch_heartbeats(new)
            self._watched.update(new)

    def _notice_exits(self) -> None:
        for pid, code in self.liveness.exits().items():
            if code == 0 or pid in self.dead_pids or pid in self.after_training:
                continue  # 0: finished its work, not a failure
            if self.members.is_done(pid):  # its work was done: nothing to recover
                self._note_exit_after_done(pid, code)
            else:
                self._mark_dead(pid, f"exited with code {code}")

    def _sweep(self, now: float) -> None:
        """Read every watched heartbeat counter (batched) and name the silent processes:
        silent for the heartbeat timeout, or - while a reported failure is unexplained - for
        `suspect_after`, unless the process itself reported the failure (it is alive)."""
        pids = self._live_pids()
        self._watch(pids)
        counts = self.members.heartbeat_counts(pids)
        suspicious = now < self.suspicious_until
        limit = self.suspect_after if suspicious else self.heartbeat_timeout
        for pid, age in self.beats.sweep(pids, counts, now, limit):
            if age > self.heartbeat_timeout:
                self._silent(pid, f"silent for {age:.1f}s (hung)")
            elif pid in self.suspects and not self._reported_failure(pid):
                self._silent(pid, f"silent for {age:.1f}s after a peer's collective failed")

    def _silent(self, pid: str, why: str) -> bool:
        """`pid`'s heartbeat has not moved for too long: dead (killed where the coordinator
        can), unless it ended; whether it was named dead."""
        if pid in self.done_pids or self.liveness.exited(pid) is not None:
            return False  # exited: its exit code decides
        if self.members.is_done(pid):  # finished; its heartbeat stopped on purpose
            self.done_pids.add(pid)
            return False
        killed = self.liveness.kill(pid)
        self._mark_dead(pid, why + ("; killed" if killed else ""))
        return True

    def _note_exit_after_done(self, pid: str, code: int) -> None:
        self.handled.add(pid)
        self.after_training.add(pid)
        self.events("exited_after_done", pid=pid, code=code)
        self.on_event(f"process {pid} exited with code {code} after finishing its work")

    def _watch_failure_reports(self, now: float) -> None:
        """A survivor saw a collective fail: suspect silent ranks for a heartbeat timeout.
        (Nothing to read where suspicion changes nothing: the local launchers.)"""
        if self.suspect_after >= self.heartbeat_timeout:
            return
        count = self.members.failure_count()
        if count > self.failures_seen:
            if now >= self.suspicious_until:
                self.suspicion_base = self.failures_seen
                self.suspects = set()
            # Suspects: the processes in the slots when the failure was reported - its peers.
            # Not the spares, nor the newcomers of a recovery planned later: those are busy
            # starting (a newcomer's Megatron start-up can starve its heartbeat for seconds),
            # and no collective of theirs failed.
            current = self.recovery.slots if self.recovery else self.roster.slots
            self.suspects |= set(current.values())
            self.failures_seen = count
            self.suspicious_until = now + self.heartbeat_timeout
            self._next_sweep = now  # sweep at once
            self.events("failure_reported", count=count)

    def _reported_failure(self, pid: str) -> bool:
        """`pid` itself reported a failed collective since the suspicion began: it is alive,
        only its heartbeat may lag (a busy or starved process), so only the heartbeat timeout
        can condemn it."""
        return self.members.failure_number(pid) > self.suspicion_base

    def _mark_dead(self, pid: str, why: str) -> None:
        self.dead_pids.add(pid)
        self.events("process_dead", pid=pid, why=why)
        self.on_event(f"process {pid} {why}")

    # ------------------------------------------------------------------ tick
    def tick(self) -> None:
        mono = time.monotonic()
        self._watch_failure_reports(mono)
        self._notice_exits()
        if mono >= self._next_sweep:
            self._next_sweep = mono + self.sweep_interval
            self._sweep(mono)
        fresh = self.dead_pids - self.handled
        if fresh:  # something died since the last tick: look at the slots (O(world) once)
            for pid in [p for p in self.spares if p in fresh]:
                self.spares.remove(pid)
                self.events("spare_lost", pid=pid, spares_left=len(self.spares))
            current = self.recovery.slots if self.recovery else self.roster.slots
            dead = {r for r, pid in current.items() if pid in fresh}
            dead |= self._silent_node_mates(dead, current, mono)
            self.handled.update(fresh | {current[r] for r in dead})
            if dead and self.aborted is None:
                completed = self.members.training_complete() if self.recovery is None else None
                if completed is None:
                    self._plan(dead, time.time())
                else:
                    self._end(dead, completed)
        if self.recovery is not None and self.aborted is None:
            if self.recovery.t_agreed is None:
                # No garbage collection while deciding: at 16,384 ranks the decision makes some
                # 100,000 objects, enough to start collections of this large heap midway (up to
                # 2.5x slower, measured); they run once the roster is out.
                gc.disable()
                try:
                    self._try_agree(time.time())
                finally:
                    gc.enable()
            if self.recovery is not None and self.recovery.t_agreed is not None:
                self._track_phases()

    def _silent_node_mates(self, dead: set[int], slots: dict[int, str], now: float) -> set[int]:
        """Ranks on a dead rank's node that are silent too (longer than the suspicion window):
        a lost node's ranks go into one plan, not one plan per rank as their beats age."""
        placement = self._placement() if dead else None
        if placement is None:
            return set()
        layout, mates = placement.layout, set()
        for rank in dead:
            for mate in layout.domain_ranks(layout.domain(rank)):
                pid = slots.get(mate)
                if mate in dead or pid is None or pid in self.handled or pid in self.dead_pids:
                    continue
                age = self.beats.age(pid, now)
                if age is not None and age > self.suspect_after:
                    why = f"silent for {age:.1f}s, on the node of dead rank {rank}"
                    if self._silent(pid, why):
                        mates.add(mate)
        return mates

    def _failure_time(self, pids: list[str], now: float) -> tuple[float, str]:
        """When the failure of `pids` happened, and the evidence for it."""
        times = [t for t in map(self.members.fault_time, pids) if t is not None]
        if times:
            return min(times), "injected fault stamp"
        lost = [self.lost_at[p] for p in pids if p in self.lost_at]
        if lost:
            return min(lost), "the earlier coordinator's last answer (lost with its node)"
        seen = [t for t in map(self.beats.last_change, pids) if t is not None]
        if seen:  # on the coordinator's monotonic clock: convert to its wall clock
            return now - (time.monotonic() - max(seen)), "last heartbeat (failure at or after it)"
        return now, "coordinator's notice (never beat)"

    def _plan(self, dead: set[int], now: float) -> None:
        rec = self.recovery
        if rec is not None and rec.t_agreed is not None:  # decided; not everyone joined yet
            for rank in sorted(dead & rec.needy):  # a newcomer lost: nobody may wait for it
                self.members.give_up_slot(rec.generation, rank)
        base = rec.slots if rec else self.roster.slots
        all_dead = (rec.dead if rec else set()) | dead
        slots = dict(base)
        needy = set(rec.needy) if rec else set()
        no_spare = rec.no_spare if rec else ""
        for rank in sorted(dead):
            needy.add(rank)
            if self.spares and not no_spare:
                slots[rank] = self.spares.pop(0)
            else:  # nothing can take the slot: agree anyway, to save what survives
                no_spare = f"no spare left to replace rank(s) {sorted(all_dead)}"
        generation = self.next_generation
        self.next_generation += 1
        dead_pids = [base[r] for r in dead]
        t_failure, evidence = (
            (rec.t_failure, rec.failure_evidence) if rec else self._failure_time(dead_pids, now)
        )
        self.recovery = PendingRecovery(
            generation=generation,
            dead=all_dead,
            slots=slots,
            needy=needy,
            t_failure=t_failure,
            failure_evidence=evidence,
            t_detect=rec.t_detect if rec else now,
            t_plan=now,
            prev_last_iteration=self._last_iteration(),
            no_spare=no_spare,
        )
        plan = {
            "generation": generation,
            "dead": sorted(all_dead),
            "needy": sorted(needy),
            "slots": {str(r): p for r, p in slots.items()},
        }
        # What every survivor reads: the changes to the published roster, not all the slots
        # (16,384 survivors reading 200 KB each would keep the store busy for seconds).
        published = self.roster.slots
        self.members.publish_plan(
            generation,
            {
                "generation": generation,
                "base": self.roster.generation,
                "world_size": self.world,
                "dead": plan["dead"],
                "needy": plan["needy"],
                "replaced": {str(r): p for r, p in slots.items() if published[r] != p},
            },
        )
        # Survivors report without waiting for the plan: some reports may be in already.
        self.members.expect_reports(generation, self.world - len(needy))
        if rec is not None:  # survivors waiting on the old plan move on to this one
            self.members.decide(rec.generation, {"superseded": generation})
        self.events("plan", **plan)
        replaced = ", ".join(
            f"rank {r} <- {slots[r]}" if slots[r] != base[r] else f"rank {r}: no spare"
            for r in sorted(dead)
        )
        self.on_event(
            f"recovery: generation {generation}, dead ranks {sorted(all_dead)}; {replaced}"
        )

    def _end(self, dead: set[int], completed: int) -> None:
        """Ranks lost after training completed: no recovery (nothing to recompute); the
        survivors are told who died and who holds each dead rank's final state, to save it."""
        all_dead = sorted(set((self.ended or {}).get("dead_ranks", [])) | dead)
        self.after_training.update(self.roster.slots[r] for r in dead)
        placement = self._placement()
        sources: dict[str, int] = {}
        for rank in all_dead:
            holders = placement.holders[rank] if placement else ()
            alive = [h for h in holders if h not in all_dead]
            if alive:
                sources[str(rank)] = alive[0]
        lost = [r for r in all_dead if str(r) not in sources]
        self.ended = {
            "reason": f"rank(s) {all_dead} lost after training completed at iteration {completed}",
            "completed_iteration": completed,
            "dead_ranks": all_dead,
            "lost_ranks": lost,
            "save": {
                "iteration": completed,
                "sources": sources,
                "complete": not lost,
                "missing": lost,
            },
        }
        self.members.publish_end(self.ended)
        self.events("lost_after_training", **self.ended)
        self.on_event(
            f"rank(s) {sorted(dead)} lost after training completed at iteration {completed}: "
            "nothing to recompute"
            + (f"; the final state of rank(s) {lost} is gone with them" if lost else "")
        )

    def _placement(self) -> Placement | None:
        """The job's placement; a cluster coordinator learns the layout from rank 0 (None
        until rank 0 published it: no rank got as far as replicating)."""
        if self.placement is None:
            d = self.members.layout()
            if d is None:
                return None
            layout = Layout(d["tp"], d["pp"], d["dp"], d["ranks_per_node"])
            self.placement = place_replicas(layout, d["replicas"])
        return self.placement

    def _last_iteration(self) -> int:
        return self.members.progress()

    def _try_agree(self, now: float) -> None:
        rec = self.recovery
        assert rec is not None
        g = rec.generation
        survivors = [r for r in range(self.world) if r not in rec.needy]
        holdings = None  # read in full once the store counted enough reports
        if self.members.reports_missing(g) <= 0:
            holdings = self.members.all_holdings(g, survivors)
        if holdings is None:
            if now - rec.t_plan > self.agree_timeout:
                missing = [r for r in survivors if self.members.holdings(g, r) is None]
                self.events("agree_timeout", generation=g, missing=missing)
                for r in missing:
                    self._mark_dead(rec.slots[r], "did not report for recovery (presumed dead)")
            return
        last = max(
            [rec.prev_last_iteration] + [h.get("last_completed", 0) for h in holdings.values()]
        )
        rec.prev_last_iteration = last
        holds = {r: h["holds"] for r, h in holdings.items()}
        placement = self._placement()
        if placement is None:  # failed during start-up: nothing was ever replicated
            self._abort(
                now,
                f"rank(s) {sorted(rec.dead)} failed before replication started: nothing in "
                "memory to recover from (see their logs)",
                lost_ranks=sorted(rec.dead),
            )
            return
        plan = plan_restore(placement, holds, rec.needy)
        if rec.no_spare or not plan.ok:
            self._abort(
                now,
                rec.no_spare or plan.reason,
                lost_ranks=plan.lost_ranks,
                dead=sorted(rec.dead),
                save=self._salvage(placement, plan, holds, rec.needy),
            )
            return
        rec.t_agreed = time.time()
        rec.restore_iteration = plan.iteration
        roster = Roster(g, self.world, rec.slots, restore_iteration=plan.iteration)
        self.members.publish_sources(g, plan.sources)
        self.members.publish_roster(roster)
        self.members.decide(g, {"roster": plan.iteration})
        self.roster = roster
        self.events(
            "agreed",
            generation=g,
            restore_iteration=plan.iteration,
            sources=plan.sources,
            last_completed=last,
        )
        self.on_event(
            f"agreed: restore iteration {plan.iteration}, shards from "
            + ", ".join(f"rank {h} -> rank {n}" for n, h in plan.sources.items())
        )

    def _salvage(
        self,
        placement: Placement,
        plan: Any,
        holds: dict[int, dict[str, list[int]]],
        needy: set[int],
    ) -> dict[str, Any] | None:
        """What survivors write before stopping: one common iteration, and who writes what."""
        salvage = plan_salvage(placement, holds, needy, plan)
        if salvage is None:
            return None
        return {
            "iteration": salvage.iteration,
            "sources": salvage.sources,
            "complete": salvage.complete,
            "missing": salvage.missing(needy),
        }

    def _abort(
        self,
        now: float,
        reason: str,
        *,
        lost_ranks: list[int],
        dead: list[int] | None = None,
        save: dict[str, Any] | None = None,
    ) -> None:
        placement = self._placement()
        holders = placement.holders if placement is not None else None
        shards = {str(r): list(holders[r]) if holders else [] for r in lost_ranks}
        self.aborted = {
            "reason": reason,
            "dead_ranks": dead if dead is not None else lost_ranks,
            "lost_ranks": lost_ranks,
            "lost_shards_holders": shards,
            "save": save and {**save, "sources": {str(k): v for k, v in save["sources"].items()}},
        }
        generation = self.next_generation
        self.members.publish_abort(generation, self.aborted)
        if self.recovery is not None:  # survivors waiting on its plan see the abort
            self.members.decide(self.recovery.generation, {"abort": True})
        self.events("out_of_redundancy", **self.aborted)
        self.on_event(f"OUT OF REDUNDANCY: {reason}")

    def _track_phases(self) -> None:
        rec = self.recovery
        assert rec is not None and rec.t_agreed is not None
        g, ranks, m = rec.generation, list(range(self.world)), self.members
        if m.stamp_count(g, "first_iteration") < 1 or any(  # one round trip while waiting
            m.stamp_count(g, phase) < self.world for phase in ("restored", "joined")
        ):
            return
        joined = max(m.stamp_times(g, "joined", ranks))
        restored = max(m.stamp_times(g, "restored", ranks))
        first = m.stamp_times(g, "first_iteration", [0])[0]
        phases = {
            "detect": rec.t_detect - rec.t_failure,
            "agree": rec.t_agreed - rec.t_detect,
            "reconstruct": joined - rec.t_agreed,
            "restore": restored - joined,
            "first_iteration": first - restored,
        }
        record = {
            "generation": g,
            "dead_ranks": sorted(rec.dead),
            "replaced_by": {str(r): rec.slots[r] for r in sorted(rec.needy)},
            "restore_iteration": rec.restore_iteration,
            "recomputed_iterations": max(0, rec.prev_last_iteration - rec.restore_iteration),
            "phases_s": {k: round(max(0.0, v), 4) for k, v in phases.items()},
            "failure_time": rec.failure_evidence,
            "stale_group_refs": m.stale_refs(g),
            "total_s": round(first - rec.t_failure, 4),
        }
        self.finished.append(record)
        self.events("recovered", **record)
        self.on_event(
            f"recovered in {record['total_s']:.2f}s: "
            + ", ".join(f"{k} {v:.2f}s" for k, v in record["phases_s"].items())
            + f"; recomputed {record['recomputed_iterations']} iteration(s)"
        )
        self.recovery = None
