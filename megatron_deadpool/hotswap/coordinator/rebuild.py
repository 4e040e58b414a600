"""What a standby coordinator that took over rebuilds from the processes' re-registrations.

Pure planning, no communication (the standby's communication is `standby.py`). When the primary
coordinator is lost, its store goes with it; every surviving process knows its own part of the
job's state and says so once it found the standby (`messages.Registration`, published by
`failover.CoordinatorLink`). From those, `rebuild` recovers the current roster (the newest
generation anyone reports), the layout, the spares still waiting, progress and the end of
training, and names the ranks of that roster that never re-registered: their processes are gone
(their node, usually the primary's), so an ordinary recovery replaces them - in a generation above
any a survivor has seen, since survivors only follow plans newer than their own generation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..protocol.messages import LayoutRecord, Registration, Roster


@dataclass(frozen=True)
class Rebuilt:
    """The job's state as the standby rebuilds it."""

    roster: Roster
    """The current roster: the newest generation a process reported."""
    missing: dict[int, str]
    """Ranks of that roster whose process never re-registered (rank -> member): presumed dead."""
    spares: list[str]
    """Spares that re-registered and wait for a slot, in spare order."""
    next_generation: int
    """The first generation the standby may plan: above every roster and plan anyone saw or
    reported for."""
    layout: LayoutRecord | None = None
    progress: int = 0
    """The newest step any process completed."""
    completed: int | None = None
    """The iteration training completed at, if any process finished training."""
    finished: dict[int, int] = field(default_factory=dict)
    """rank -> iteration it finished training at."""
    done: list[str] = field(default_factory=list)
    """Members that had finished their work."""
    recovering: list[str] = field(default_factory=list)
    """Members that were inside a recovery."""


def rebuild(
    registrations: Mapping[str, Registration], world_size: int, spares: list[str]
) -> Rebuilt | None:
    """The job's state from the re-registrations (member -> record); None when no process that
    ever held a rank re-registered (nothing to rebuild from). `spares` are the job's spare members
    in order (a re-registered spare keeps its place)."""
    with_roster = [r for r in registrations.values() if r.slots is not None]
    if not with_roster:
        return None
    newest = max(with_roster, key=lambda r: r.generation)
    roster = Roster(
        newest.generation,
        newest.world_size or world_size,
        dict(newest.slots or {}),
        newest.restore_iteration,
    )
    active = set(roster.slots.values())
    missing = {r: m for r, m in sorted(roster.slots.items()) if m not in registrations}
    order = {m: i for i, m in enumerate(spares)}
    waiting = sorted(
        (m for m, r in registrations.items() if m not in active and r.rank is None and not r.done),
        key=lambda m: (order.get(m, len(order)), m),
    )
    seen = [r.generation for r in registrations.values()]
    seen += [r.plan_seen for r in registrations.values()]
    completed = [r.completed for r in registrations.values() if r.completed is not None]
    return Rebuilt(
        roster=roster,
        missing=missing,
        spares=waiting,
        next_generation=max(seen) + 1,
        layout=next((r.layout for r in with_roster if r.layout is not None), None),
        progress=max(r.last_completed for r in registrations.values()),
        completed=max(completed) if completed else None,
        finished={
            r.rank: r.completed
            for r in registrations.values()
            if r.rank is not None and r.completed is not None and r.member in active
        },
        done=sorted(m for m, r in registrations.items() if r.done),
        recovering=sorted(m for m, r in registrations.items() if r.recovering),
    )
