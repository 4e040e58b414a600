"""What a standby coordinator that took over rebuilds from the processes' re-registrations.

Pure planning, no communication (the standby's communication is `standby.py`). When the primary
coordinator is lost, its store goes with it; every surviving process knows its own part of the
job's state and says so once it found the standby (`Registration`, published by
`failover.CoordinatorLink`). From those, `rebuild` recovers the current roster (the newest
generation anyone reports), the layout, the spares still waiting, progress and the end of
training, and names the ranks of that roster that never re-registered: their processes are gone
(their node, usually the primary's), so an ordinary recovery replaces them - in a generation above
any a survivor has seen, since survivors only follow plans newer than their own generation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .roster import Roster


@dataclass(frozen=True)
class Registration:
    """What one process knows of the job when it re-registers with a standby."""

    pid: str
    host: str = ""
    """hostname:os pid of the process."""
    rank: int | None = None
    """Its rank in the newest roster it joined (None: a spare still waiting)."""
    generation: int = -1
    """The generation of that roster (-1: none)."""
    world_size: int | None = None
    slots: dict[int, str] | None = None
    """That roster's slots, rank -> pid."""
    restore_iteration: int | None = None
    last_completed: int = 0
    """The last training step it completed."""
    completed: int | None = None
    """The iteration training completed at, once its last step was done and replicated."""
    done: bool = False
    """It finished its work (digest published)."""
    layout: dict[str, int] | None = None
    """{"tp", "pp", "dp", "ranks_per_node", "replicas"} once it placed replicas."""
    plan_seen: int = 0
    """The newest planned generation it saw (a recovery it may have reported for)."""
    recovering: bool = False
    """It was inside a recovery (between a failed collective and its restore)."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if self.slots is not None:
            d["slots"] = {str(r): p for r, p in self.slots.items()}
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Registration:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        if known.get("slots") is not None:
            known["slots"] = {int(r): p for r, p in known["slots"].items()}
        return cls(**known)

    def dumps(self) -> str:
        return json.dumps(self.to_json())


@dataclass(frozen=True)
class Rebuilt:
    """The job's state as the standby rebuilds it."""

    roster: Roster
    """The current roster: the newest generation a process reported."""
    missing: dict[int, str]
    """Ranks of that roster whose process never re-registered (rank -> pid): presumed dead."""
    spares: list[str]
    """Spares that re-registered and wait for a slot, in spare order."""
    next_generation: int
    """The first generation the standby may plan: above every roster and plan anyone saw."""
    layout: dict[str, int] | None = None
    progress: int = 0
    """The newest step any process completed."""
    completed: int | None = None
    """The iteration training completed at, if any process finished training."""
    finished: dict[int, int] = field(default_factory=dict)
    """rank -> iteration it finished training at."""
    done: list[str] = field(default_factory=list)
    """Processes that had finished their work."""
    recovering: list[str] = field(default_factory=list)
    """Processes that were inside a recovery."""


def rebuild(
    registrations: Mapping[str, Registration], world_size: int, spares: list[str]
) -> Rebuilt | None:
    """The job's state from the re-registrations (pid -> record); None when no process that
    ever held a rank re-registered (nothing to rebuild from). `spares` are the job's spare pids
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
    missing = {r: p for r, p in sorted(roster.slots.items()) if p not in registrations}
    order = {p: i for i, p in enumerate(spares)}
    waiting = sorted(
        (p for p, r in registrations.items() if p not in active and r.rank is None and not r.done),
        key=lambda p: (order.get(p, len(order)), p),
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
            if r.rank is not None and r.completed is not None and r.pid in active
        },
        done=sorted(p for p, r in registrations.items() if r.done),
        recovering=sorted(p for p, r in registrations.items() if r.recovering),
    )
