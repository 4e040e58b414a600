"""The coordinator: watches processes and heartbeats, assigns spares, drives agreement.

It runs inside `deadpool train`'s launcher (where it can also see process exits and kill a
hung process) or on its own on a cluster's batch host (`deadpool coordinator`), where
heartbeats are its only signal. Each `tick()`:
  1. notices dead actives (exit, or heartbeat older than the heartbeat timeout: a hung
     process is killed where the coordinator can, so its sockets close and peers unblock);
  2. publishes a plan for a new generation: the dead set and the spares taking their slots;
  3. waits for every planned survivor's holdings, computes the restore iteration
     (`restore_plan.plan_restore`) and publishes the new roster - or, when memory cannot
     recover the failure, an abort naming the lost ranks and shards;
  4. records each phase's wall time from the timestamps ranks publish.
Every decision is appended to the event log (JSON lines).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..replication.placement import Layout, Placement, place_replicas
from .membership import Membership, Roster
from .restore_plan import plan_restore, plan_salvage

log = logging.getLogger("megatron_deadpool.hotswap.coordinator")


class Liveness(Protocol):
    """What the coordinator can learn about (and do to) a process beyond its heartbeat."""

    def exited(self, pid: str) -> int | None: ...

    def kill(self, pid: str) -> bool: ...


class ProcessLiveness:
    """A launcher on the same machine sees its children exit and can kill a hung one."""

    def __init__(self, procs: dict[str, subprocess.Popen]) -> None:
        self.procs = procs

    def exited(self, pid: str) -> int | None:
        proc = self.procs.get(pid)
        return None if proc is None else proc.poll()

    def kill(self, pid: str) -> bool:
        proc = self.procs.get(pid)
        if proc is None or proc.poll() is not None:
            return False
        os.killpg(proc.pid, signal.SIGKILL)
        return True


def kill_groups(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILL every child's whole process group, exited or not, and reap the children.

    A child that ended may have left helpers behind (data-loader workers, megatron-core's
    checkpoint writer and its resource tracker); they share its group.
    """
    procs = list(procs)
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail
            pass


class HeartbeatOnly:
    """A coordinator on a cluster sees no processes: heartbeats are everything."""

    def exited(self, pid: str) -> int | None:
        return None

    def kill(self, pid: str) -> bool:
        return False


@dataclass
class PendingRecovery:
    """One recovery in progress (re-planned with a larger dead set if more ranks die)."""

    generation: int
    dead: set[int]
    slots: dict[int, str]
    needy: set[int]
    t_failure: float
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
        suspect_after: float | None = None,
    ) -> None:
        """`suspect_after`: once a survivor reported a failed collective, a rank silent this
        long (default: the heartbeat timeout) is declared dead - a crashed process's peers
        see its connections close at once, and its heartbeat has stopped."""
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
        self.suspect_after = min(suspect_after or heartbeat_timeout, heartbeat_timeout)
        self.failures_seen = 0
        self.suspicion_base = 0  # failure reports seen before the current suspicion
        self.suspicious_until = 0.0  # while a reported failure is unexplained
        self.ended: dict[str, Any] | None = None  # processes lost after training completed
        self.after_training: set[str] = set()  # processes gone after their work was done
        self._hb_read: dict[str, float] = {}  # pid -> when its heartbeat was last read
        self.watching_since = 0.0  # wall time it took the job over (`adopt`)

    def start(self) -> None:
        self.members.publish_roster(self.roster)
        self.events("roster", generation=0, slots=self.roster.slots)

    def adopt(
        self, roster: Roster, spares: list[str], next_generation: int, dead: dict[str, str]
    ) -> None:
        """Instead of `start`: go on with a job another coordinator ran (a standby taking over,
        `standby.py`) - its current roster, the spares still waiting, plans from
        `next_generation` on, and the processes known dead (pid -> why), recovered next tick."""
        self.roster = roster
        self.spares = list(spares)
        self.next_generation = next_generation
        self.watching_since = time.time()
        self.members.publish_roster(roster)
        self.events("roster", generation=roster.generation, slots=roster.slots, adopted=True)
        for pid, why in dead.items():
            self._mark_dead(pid, why)

    # ------------------------------------------------------------------ liveness
    def _heartbeat_age(self, pid: str, now: float) -> float | None:
        """Seconds since `pid`'s last beat, counted from when this coordinator took the job at
        the earliest (a beat retried after a takeover carries its old time)."""
        beat = self.members.heartbeat_time(pid)
        return None if beat is None else now - max(beat, self.watching_since)

    def _is_dead(self, pid: str, now: float) -> bool:
        if pid in self.dead_pids:
            return True
        code = self.liveness.exited(pid)
        if code is not None and code != 0:  # 0: finished its work, not a failure
            if self.members.is_done(pid):  # its work was done: nothing to recover
                self._note_exit_after_done(pid, code)
                return False
            self._mark_dead(pid, f"exited with code {code}")
            return True
        suspicious = now < self.suspicious_until and not self._reported_failure(pid)
        limit = self.suspect_after if suspicious else self.heartbeat_timeout
        if not suspicious and now - self._hb_read.get(pid, 0.0) < self.heartbeat_timeout / 20:
            return False  # read heartbeats a little more often than the timeout resolves
        self._hb_read[pid] = now
        age = self._heartbeat_age(pid, now)
        if age is not None and age > limit and code is None:
            if self.members.is_done(pid):  # finished; its heartbeat stopped on purpose
                return False
            killed = self.liveness.kill(pid)
            why = "after a peer's collective failed" if suspicious else "(hung)"
            self._mark_dead(pid, f"silent for {age:.1f}s {why}" + ("; killed" if killed else ""))
            return True
        return False

    def _note_exit_after_done(self, pid: str, code: int) -> None:
        if pid not in self.handled:
            self.handled.add(pid)
            self.after_training.add(pid)
            self.events("exited_after_done", pid=pid, code=code)
            self.on_event(f"process {pid} exited with code {code} after finishing its work")

    def _watch_failure_reports(self, now: float) -> None:
        """A survivor saw a collective fail: suspect silent ranks for a heartbeat timeout."""
        count = self.members.failure_count()
        if count > self.failures_seen:
            if now >= self.suspicious_until:
                self.suspicion_base = self.failures_seen
            self.failures_seen = count
            self.suspicious_until = now + self.heartbeat_timeout
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
        now = time.time()
        self._watch_failure_reports(now)
        for pid in list(self.spares):
            if self._is_dead(pid, now):
                self.spares.remove(pid)
                self.events("spare_lost", pid=pid, spares_left=len(self.spares))
        current = self.recovery.slots if self.recovery else self.roster.slots
        dead = {
            r for r, pid in current.items() if pid not in self.handled and self._is_dead(pid, now)
        }
        self.handled.update(current[r] for r in dead)
        if dead and self.aborted is None:
            completed = self.members.training_complete() if self.recovery is None else None
            if completed is None:
                self._plan(dead, now)
            else:
                self._end(dead, completed)
        if self.recovery is not None and self.recovery.t_agreed is None:
            self._try_agree(now)
        if self.recovery is not None and self.recovery.t_agreed is not None:
            self._track_phases()

    def _failure_time(self, pids: list[str], default: float) -> float:
        times = [t for t in map(self.members.fault_time, pids) if t is not None]
        return min(times) if times else default

    def _plan(self, dead: set[int], now: float) -> None:
        rec = self.recovery
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
        t_failure = rec.t_failure if rec else self._failure_time(dead_pids, now)
        self.recovery = PendingRecovery(
            generation=generation,
            dead=all_dead,
            slots=slots,
            needy=needy,
            t_failure=t_failure,
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
        self.members.publish_plan(generation, plan)
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
        holdings: dict[int, dict[str, list[int]]] = {}
        for r in survivors:
            report = self.members.holdings(g, r)
            if report is not None:
                holdings[r] = report
        if len(holdings) < len(survivors):
            if now - rec.t_plan > self.agree_timeout:
                missing = [r for r in survivors if r not in holdings]
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
        self.events("out_of_redundancy", **self.aborted)
        self.on_event(f"OUT OF REDUNDANCY: {reason}")

    def _stamp(self, g: int, what: str, ranks: list[int]) -> float | None:
        values = [self.members.stamp_time(g, what, r) for r in ranks]
        return None if None in values else max(values)  # type: ignore[type-var]

    def _stale_refs(self, g: int) -> int:
        """Old-generation group handles survivors found after rebinding (must be 0)."""
        return sum(self.members.stale_refs(g, r) for r in range(self.world))

    def _track_phases(self) -> None:
        rec = self.recovery
        assert rec is not None and rec.t_agreed is not None
        g, ranks = rec.generation, list(range(self.world))
        joined = self._stamp(g, "joined", ranks)
        restored = self._stamp(g, "restored", ranks) if joined else None
        first = self._stamp(g, "first_iteration", [0]) if restored else None
        if first is None:
            return
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
            "stale_group_refs": self._stale_refs(g),
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
