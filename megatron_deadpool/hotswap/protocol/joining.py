"""Processes that join a running job as spares (`--deadpool-join`): how they are named, and how the
coordinator finds them.

A joining process - on a repaired node, or a node of another allocation - connects to the
coordinator's store with the job's secret, takes the next spare name from the counter
`spares/next` (`StoreView.claim_spare_name`) and announces itself as that member, sealed; then
it waits like any spare. The coordinator looks at the counter at most every `LOOK_S` seconds
(one round trip while nobody joins) and adds a claimed name to the spare pool once its sealed
announcement is there. The counter cannot be sealed (it is a counter): a stranger who bumps it
only makes names that never announce, which are given up after `WAIT_S` seconds; at most
`MAX_PENDING` names are waited for at once, the oldest given up first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from .messages import member_of
from .store_view import StoreView

log = logging.getLogger("megatron_deadpool.driver")

LOOK_S = 1.0
"""Seconds between two looks at the counter."""

WAIT_S = 120.0
"""How long a claimed name may take to announce itself (a joining process claims its name
and announces it right after connecting: seconds, unless it died in between)."""

MAX_PENDING = 256
"""Claimed names waited for at once."""


@dataclass
class JoinOutcome:
    """What one look found: members to add to the pool, names given up (and why)."""

    joined: list[str] = field(default_factory=list)
    abandoned: dict[str, str] = field(default_factory=dict)


@dataclass
class Joiners:
    """The coordinator's view of the names handed out through `spares/next`."""

    seen: int
    """Names s0 .. s{seen-1} are accounted for (the initial spares, or looked at already)."""
    pending: dict[str, float] = field(default_factory=dict)
    """Claimed names not announced yet -> when they were first seen (monotonic seconds)."""
    last_look: float | None = None

    def look(self, membership: StoreView, now: float, known: Callable[[str], bool]) -> JoinOutcome:
        """At most every `LOOK_S`: the names claimed since the last look, and which of the
        pending ones announced themselves (`known`: members the coordinator has already, e.g.
        a spare a local launcher added itself)."""
        out = JoinOutcome()
        if self.last_look is not None and now - self.last_look < LOOK_S:
            return out
        self.last_look = now
        claimed = membership.spare_names_claimed()
        first = max(self.seen, claimed - 2 * MAX_PENDING)  # (a stranger's add: one line)
        if first > self.seen:
            out.abandoned[f"s{self.seen}..s{first - 1}"] = "too many names claimed at once"
        for i in range(first, claimed):
            self.pending[f"s{i}"] = now
        self.seen = max(self.seen, claimed)
        while len(self.pending) > MAX_PENDING:
            oldest = next(iter(self.pending))
            del self.pending[oldest]
            out.abandoned[oldest] = f"more than {MAX_PENDING} names claimed and not announced"
        for member, since in list(self.pending.items()):
            if known(member):
                del self.pending[member]
            elif membership.announced(member):
                del self.pending[member]
                out.joined.append(member)
            elif now - since > WAIT_S:
                del self.pending[member]
                out.abandoned[member] = (
                    f"claimed its name but did not announce itself in {WAIT_S:g}s"
                )
        return out


def member_name(membership: StoreView, task: int | None, world: int) -> str:
    """A process's member name once it knows the job's world size: from its task index
    (actives first, then spares), or, for a process joining the running job (no task), the
    next spare name from the job's store."""
    if task is not None:
        return member_of(task, world)
    name = membership.claim_spare_name()
    log.info("joined the running job as spare %s", name)
    return name


def unnamed(task: int | None) -> str:
    """What a process is called before it has a member name."""
    return "joining" if task is None else f"task{task}"


def next_spare_number(members: list[str]) -> int:
    """The first spare number after every spare name in `members` (s{i}; 0 with none)."""
    numbers = [int(m[1:]) for m in members if m.startswith("s") and m[1:].isdigit()]
    return max(numbers, default=-1) + 1
