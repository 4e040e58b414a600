"""Heartbeat ages on the coordinator's own clock.

A process's heartbeat is its beat number, sealed and set one higher each beat
(`WorkerView.heartbeat`; what the coordinator reads is the newest number that opens,
`SealedStore.beat_number`, so a stranger's value is no beat); no clock travels. The coordinator
reads every beat in one batched sweep and notes, on its own monotonic
clock, when it last saw each one change: a process's age is the time since then. Clock skew
between hosts (or a wall clock stepped by NTP) therefore cannot make a live process look hung
nor a hung one alive, and the time of the last change bounds when a silent process stopped.
Pure: the coordinator feeds it the counters it read and the time it read them.
"""

from __future__ import annotations

from collections.abc import Sequence


class HeartbeatClock:
    """When each process's beat counter last changed, on the observer's monotonic clock."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, float]] = {}  # member -> (count, when it changed)

    def observe(self, member: str, count: int, now: float) -> None:
        """`member`'s counter read `count` at `now`. A count of 0 (never beat) starts nothing: a
        process still starting up is not judged by its heartbeat."""
        if count == 0:
            return
        seen = self._seen.get(member)
        if seen is None or seen[0] != count:
            self._seen[member] = (count, now)

    def expect(self, member: str, now: float) -> None:
        """Judge `member` from `now` on even if its counter never moves (a process known to be
        alive, e.g. one that re-registered with a standby coordinator taking the job over); a
        beat seen before counts from `now` too."""
        count, since = self._seen.get(member, (0, now))
        self._seen[member] = (count, max(since, now))

    def sweep(
        self, members: Sequence[str], counts: Sequence[int], now: float, timeout: float
    ) -> list[tuple[str, float]]:
        """`observe` every (member, count) read at `now`; returns (member, age) of those whose
        counter has not changed for more than `timeout` seconds. One pass: a sweep of
        16,384 processes costs a few milliseconds of the coordinator's time."""
        seen, late = self._seen, []
        for member, count in zip(members, counts):
            last = seen.get(member)
            if last is None or last[0] != count:
                if count:  # (a member expected from a later time keeps that time: `expect`)
                    seen[member] = (count, now if last is None else max(now, last[1]))
            elif now - last[1] > timeout:
                late.append((member, now - last[1]))
        return late

    def age(self, member: str, now: float) -> float | None:
        """Seconds since `member`'s counter last changed (None: it never beat)."""
        seen = self._seen.get(member)
        return None if seen is None else now - seen[1]

    def last_change(self, member: str) -> float | None:
        """When `member`'s counter last changed (None: it never beat)."""
        seen = self._seen.get(member)
        return None if seen is None else seen[1]
