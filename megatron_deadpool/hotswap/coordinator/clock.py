"""The coordinator's time: a monotonic clock for timeouts, a wall clock for what it reports.

Passed in (`SystemClock` by default) so that the coordinator's decisions can be unit-tested
on a clock a test moves by hand (`ManualClock`), without sleeping.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (timeouts, heartbeat ages)."""

    def time(self) -> float:
        """Wall-clock seconds since the epoch (what is compared with members' stamps)."""


class SystemClock:
    """The machine's clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told to (`advance`): both readings move together."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
