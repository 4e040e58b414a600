"""Failure detection for the coordinator: which members are dead, and why.

Four signals, looked at once per `look()` (the coordinator's tick):
  - error reports: a member that reported the error it ends with (`messages.ErrorReport`) is
    dead at once, with or without a launcher that sees its exit (one round trip per look: the
    report counter); the reports are kept for the coordinator's verdict (`job_error.py`);
  - exits the launcher saw (`liveness.Liveness`; none on a cluster): a member that exits with an
    error before it finished its work is dead; one that finished first is noted as lost after
    its work, which needs no recovery;
  - heartbeats: every watched member's beat number, read in one batched sweep every
    `sweep_interval` and timed on the coordinator's own monotonic clock (`heartbeats.py`); a
    member silent for the heartbeat timeout is hung (killed where the launcher can, so that its
    sockets close and its peers unblock);
  - failure reports: once a survivor reported a failed collective, the members in the slots at
    that moment are suspects for a heartbeat timeout, and a suspect silent for `suspect_after`
    (shorter) is named dead too - unless it reported the failure itself (it is alive). The
    report counter is only a hint (anyone can add to it): a move of it opens suspicion once the
    newest report, sealed, confirms it - its number within the move (one read; a stranger's
    add opens none, a report copied back or landing late is numbered below it).
A lost node's other ranks are named together (`silent_node_mates`), so that they go into one
plan instead of one plan each as their beats age. Pure bookkeeping over the store reads: the
decisions that follow are the coordinator's (`coordinator.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..protocol.coordinator_view import CoordinatorView
from ..protocol.messages import ErrorReport
from ..protocol.numbered import numbers_to_read
from .clock import Clock
from .events import EventLog
from .heartbeats import HeartbeatClock
from .liveness import Liveness


@dataclass(frozen=True)
class SweepCost:
    """What one heartbeat sweep cost the coordinator."""

    members: int
    cpu_s: float
    """CPU time of the coordinator's thread."""
    process_cpu_s: float
    """CPU time of its whole process (with the store server's part, where it hosts it)."""
    wall_s: float


class SweepObserver(Protocol):
    def swept(self, cost: SweepCost) -> None: ...


class FailureDetector:
    """Which members are dead, from exits, heartbeats and survivors' failure reports."""

    def __init__(
        self,
        membership: CoordinatorView,
        liveness: Liveness,
        *,
        heartbeat_timeout: float,
        suspect_after: float | None,
        sweep_interval: float | None,
        clock: Clock,
        events: EventLog,
        say: Callable[[str], None],
        observer: SweepObserver | None = None,
    ) -> None:
        """`sweep_interval`: seconds between heartbeat sweeps (default: the heartbeat timeout /
        20, so a hang is named at most 5% after the timeout). `suspect_after`: once a survivor
        reported a failed collective, a suspect silent this long (default and at most: the
        heartbeat timeout) is dead - a crashed process's peers see its connections close at
        once, and its heartbeat has stopped."""
        self.membership = membership
        self.liveness = liveness
        self.heartbeat_timeout = heartbeat_timeout
        self.suspect_after = min(suspect_after or heartbeat_timeout, heartbeat_timeout)
        self.sweep_interval = heartbeat_timeout / 20 if sweep_interval is None else sweep_interval
        self.clock = clock
        self.events = events
        self.say = say
        self.observer = observer
        self.beats = HeartbeatClock()
        self._dead: dict[str, str] = {}  # member -> why
        self._finished: set[str] = set()  # finished their work: silent on purpose
        self._after_work: set[str] = set()  # exited after their work was done
        self._watched: set[str] = set()  # members whose heartbeat key exists
        self._next_sweep = 0.0
        self._failures_seen = 0
        self._suspicion_base = 0  # failure reports seen before the current suspicion
        self._suspicious_until = 0.0  # (monotonic) while a reported failure is unexplained
        self._suspects: set[str] = set()  # who a reported failure can be explained by
        self._lost_at: dict[str, float] = {}  # member -> wall time it was lost, known otherwise
        self._errors: dict[str, ErrorReport] = {}  # member -> the first error it reported
        self._errors_counted = 0  # error reports counted by the store so far
        self._errors_unread: set[int] = set()  # counted, not published yet when last looked
        self._errors_read: set[int] = set()  # the numbers a report was read at

    # ------------------------------------------------------------------ what it knows
    @property
    def dead(self) -> frozenset[str]:
        """Every member named dead so far."""
        return frozenset(self._dead)

    @property
    def after_work(self) -> frozenset[str]:
        """Members that exited (or were lost) after their work was done: no failure."""
        return frozenset(self._after_work)

    def is_dead(self, member: str) -> bool:
        return member in self._dead

    # ------------------------------------------------------------------ looking
    def look(self, live: Callable[[], Sequence[str]], slots: Mapping[int, str]) -> None:
        """One look at every signal: `live()` are the members watched (spares and the members
        of the current or planned slots, not dead ones; asked only when a sweep is due, since
        it takes O(world) and the coordinator ticks 20 times a second), `slots` the current or
        planned slots (rank -> member: who a reported failure may concern)."""
        now = self.clock.monotonic()
        self._watch_failure_reports(now, slots)
        self._notice_errors()
        self._notice_exits()
        if now >= self._next_sweep:
            self._next_sweep = now + self.sweep_interval
            self._sweep(live(), now)

    def has_beaten(self, member: str) -> bool:
        """Whether `member`'s heartbeat was seen (a process past its start-up)."""
        return self.beats.last_change(member) is not None

    def condemn(self, member: str, why: str) -> None:
        """Name a live `member` dead, killed where the launcher can (the coordinator's verdict
        on a process that is no use alive: hung, or too late)."""
        killed = self.liveness.kill(member)
        self.mark_dead(member, why + ("; killed" if killed else ""))

    def mark_dead(self, member: str, why: str) -> None:
        """Name `member` dead (the coordinator's own verdicts: a survivor that never reported
        for a recovery, a member that never re-registered with a standby)."""
        self._dead[member] = why
        self.events("process_dead", member=member, why=why)
        self.say(f"process {member} {why}")

    def mark_after_work(self, member: str) -> None:
        """`member` is gone after its work was done (its loss costs no recovery)."""
        self._after_work.add(member)

    def watch(self, members: Sequence[str]) -> None:
        """Make sure `members`' heartbeat keys exist (read in every sweep from now on)."""
        new = [m for m in members if m not in self._watched]
        if new:
            self.membership.watch_heartbeats(new)
            self._watched.update(new)

    def expect(self, members: Sequence[str], grace: float = 0.0) -> None:
        """Judge `members` by their beats from `grace` seconds from now on, even if their
        counters never move (they re-registered with a standby taking the job over)."""
        start = self.clock.monotonic() + grace
        for member in members:
            self.beats.expect(member, start)
        self.watch(members)

    def lost_at(self, members: Sequence[str], when: float) -> None:
        """`members` were lost at or after wall time `when` (the earlier coordinator's last
        answer: most likely with its node)."""
        self._lost_at.update({m: when for m in members})

    def error_reports(self) -> dict[str, ErrorReport]:
        """Every member's error report so far (member -> its first), read up to now (a report
        is published before its process exits, so an exit seen is read with its report); the
        members of reports new since the last look are named dead, as `look` does."""
        self._notice_errors()
        return dict(self._errors)

    def _read_errors(self) -> list[ErrorReport]:
        """The reports published since the last read (one round trip when there are none; a
        counter a stranger moved back is read from there on: `numbered.py`)."""
        count = self.membership.error_count()
        numbers = numbers_to_read(self._errors_counted, count, self._errors_unread)
        numbers = [n for n in numbers if n not in self._errors_read]
        self._errors_unread &= set(numbers)  # (the newest few: `numbered.py`)
        self._errors_counted = max(count, 0)
        new = []
        for number in numbers:
            report = self.membership.error_report(number)
            if report is None:  # counted by the store, not published yet: look again later
                self._errors_unread.add(number)
                continue
            self._errors_read.add(number)
            self._errors_unread.discard(number)
            self._errors.setdefault(report.member, report)
            new.append(report)
        return new

    def _notice_errors(self) -> None:
        """A member that reported the error it ends with is dead (after its work: no failure)."""
        for report in self._read_errors():
            member = report.member
            if member in self._dead or member in self._after_work:
                continue
            self.events("error_reported", **report.to_dict())
            if self.membership.is_done(member):
                self._after_work.add(member)
            else:
                self.mark_dead(member, f"ended with an error: {report.cause()}")

    def _notice_exits(self) -> None:
        for member, code in self.liveness.exits().items():
            if code == 0 or member in self._dead or member in self._after_work:
                continue  # 0: finished its work, not a failure
            if self.membership.is_done(member):  # its work was done: nothing to recover
                self._after_work.add(member)
                self.events("exited_after_done", member=member, code=code)
                self.say(f"process {member} exited with code {code} after finishing its work")
            else:
                self.mark_dead(member, f"exited with code {code}")

    def _sweep(self, live: Sequence[str], now: float) -> None:
        """Read every watched heartbeat (batched) and name the silent members: silent
        for the heartbeat timeout, or - while a reported failure is unexplained - for
        `suspect_after`, unless the member itself reported the failure (it is alive)."""
        cpu0, proc0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
        members = list(live)
        self.watch(members)
        counts = self.membership.heartbeat_counts(members)
        suspicious = now < self._suspicious_until
        limit = self.suspect_after if suspicious else self.heartbeat_timeout
        for member, age in self.beats.sweep(members, counts, now, limit):
            if age > self.heartbeat_timeout:
                self._silent(member, f"silent for {age:.1f}s (hung)")
            elif member in self._suspects and not self._reported_failure(member):
                self._silent(member, f"silent for {age:.1f}s after a peer's collective failed")
        if self.observer is not None:
            self.observer.swept(
                SweepCost(
                    members=len(members),
                    cpu_s=time.thread_time() - cpu0,
                    process_cpu_s=time.process_time() - proc0,
                    wall_s=time.perf_counter() - t0,
                )
            )

    def _silent(self, member: str, why: str) -> bool:
        """`member`'s heartbeat has not moved for too long: dead (killed where the launcher
        can), unless it ended; whether it was named dead."""
        if member in self._finished or self.liveness.exited(member) is not None:
            return False  # exited: its exit code decides
        if self.membership.is_done(member):  # finished; its heartbeat stopped on purpose
            self._finished.add(member)
            return False
        self.condemn(member, why)
        return True

    def _watch_failure_reports(self, now: float, slots: Mapping[int, str]) -> None:
        """A survivor saw a collective fail: suspect silent members for a heartbeat timeout.
        (Nothing to read where suspicion changes nothing: the local launchers.)"""
        if self.suspect_after >= self.heartbeat_timeout:
            return
        count = self.membership.failure_count()
        if count > self._failures_seen:
            latest = self.membership.latest_failure()
            if latest is None or not self._failures_seen < latest.number <= count:
                return  # not confirmed (yet: a report lands after its count; or a stranger's add)
            if now >= self._suspicious_until:
                self._suspicion_base = self._failures_seen
                self._suspects = set()
            # Suspects: the members in the slots when the failure was reported - its peers.
            # Not the spares, nor the newcomers of a recovery planned later: those are busy
            # starting (a newcomer's Megatron start-up can starve its heartbeat for seconds),
            # and no collective of theirs failed.
            self._suspects |= set(slots.values())
            self._failures_seen = count
            self._suspicious_until = now + self.heartbeat_timeout
            self._next_sweep = now  # sweep at once
            self.events("failure_reported", count=count)

    def _reported_failure(self, member: str) -> bool:
        """`member` itself reported a failed collective since the suspicion began: it is alive,
        only its heartbeat may lag (a busy or starved process), so only the heartbeat timeout
        can condemn it."""
        return self.membership.failure_number(member) > self._suspicion_base

    # ------------------------------------------------------------------ what follows a death
    def silent_node_mates(
        self,
        dead_ranks: set[int],
        slots: Mapping[int, str],
        node_ranks: Callable[[int], list[int]],
        skip: set[str],
    ) -> set[int]:
        """Ranks on a dead rank's node (`node_ranks(rank)`) that are silent too (longer than
        the suspicion window), named dead now; members in `skip` are already accounted for."""
        now = self.clock.monotonic()
        mates = set()
        for rank in dead_ranks:
            for mate in node_ranks(rank):
                member = slots.get(mate)
                if mate in dead_ranks or member is None or member in skip or member in self._dead:
                    continue
                age = self.beats.age(member, now)
                if age is not None and age > self.suspect_after:
                    why = f"silent for {age:.1f}s, on the node of dead rank {rank}"
                    if self._silent(member, why):
                        mates.add(mate)
        return mates

    def failure_time(self, members: Sequence[str]) -> tuple[float, str]:
        """When the failure of `members` happened (wall clock), and the evidence for it."""
        times = [t for t in map(self.membership.fault_time, members) if t is not None]
        if times:
            return min(times), "injected fault stamp"
        lost = [self._lost_at[m] for m in members if m in self._lost_at]
        if lost:
            return min(lost), "the earlier coordinator's last answer (lost with its node)"
        now = self.clock.time()
        seen = [t for t in map(self.beats.last_change, members) if t is not None]
        if seen:  # on the monotonic clock: convert to the wall clock
            return (
                now - (self.clock.monotonic() - max(seen)),
                "last heartbeat (failure at or after it)",
            )
        return now, "coordinator's notice (never beat)"

    def silent_among(self, members: Sequence[str]) -> set[str]:
        """Which of `members` have not beaten for the heartbeat timeout (or never did): one
        sweep of their counters now, no verdict."""
        now = self.clock.monotonic()
        self.beats.sweep(members, self.membership.heartbeat_counts(members), now, 0.0)
        silent = set()
        for member in members:
            age = self.beats.age(member, now)
            if age is None or age > self.heartbeat_timeout:
                silent.add(member)
        return silent
