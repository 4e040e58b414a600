"""What the coordinator records of a recovery, and the actions its decisions come to.

The decisions (`decide.py`) are pure: they return these actions, and the executor
(`execute.py`) performs them - the store writes through the coordinator's `CoordinatorView`, the
orders to the nodes' agents, the events and the lines for the user - in the order given.
`PendingRecovery` is the coordinator's record of the recovery under way: a plan makes a new
one, the agreement and the phase stamps fill it in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..protocol.messages import EndReport, JobError, OutOfRedundancy, Plan, Roster


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


# ---------------------------------------------------------------------- the job ends
@dataclass(frozen=True)
class EndJobError:
    """The deaths are the job's own error (`job_error.judge`): publish the verdict; no plan,
    no spare spent."""

    verdict: JobError


@dataclass(frozen=True)
class EndAfterTraining:
    """Ranks lost after training completed: no recovery; the survivors are told who died and
    who holds each dead rank's final state. `members` are gone after their work (no failure);
    `fresh` the ranks that died this tick."""

    report: EndReport
    members: tuple[str, ...]
    fresh: tuple[int, ...]


@dataclass(frozen=True)
class EndOutOfRedundancy:
    """Memory cannot recover the failure: publish the report to the survivors waiting on
    `generations` (they save what survives and stop). `last_completed`: the newest iteration
    any survivor completed (recorded on the recovery, when there is one)."""

    report: OutOfRedundancy
    generations: tuple[int, ...]
    last_completed: int | None = None


# ---------------------------------------------------------------------- a plan
@dataclass(frozen=True)
class GiveUpSlot:
    """A decided newcomer died before it claimed `rank`'s slot of `generation`: the survivors
    stop waiting for its claim."""

    generation: int
    rank: int


@dataclass(frozen=True)
class MoveSlotOn:
    """A decided newcomer, alive, had not claimed `rank`'s slot of `generation` when a death
    continued its recovery: it takes the slot in the next plan instead."""

    generation: int
    rank: int


@dataclass(frozen=True)
class RefuseRespawn:
    """`rank`'s node `node` does not respawn its process (`why`); the rank takes a spare.
    `used`: the node's respawns within the window, when its limit is why."""

    rank: int
    node: int
    why: str
    used: int | None = None


@dataclass(frozen=True)
class OrderRespawn:
    """Ask node `node`'s agent for a new process in the place of `replaces`, which held
    `rank`. Its outcome - the new member, or why it could not start one - goes into the next
    call of the decision (`decide.RespawnOutcome`)."""

    rank: int
    node: int
    replaces: str


@dataclass(frozen=True)
class TakeSpare:
    """Spare `member` leaves the pool for `rank`'s slot, held by `replaces` until it died."""

    rank: int
    member: str
    replaces: str


@dataclass(frozen=True)
class PublishPlan:
    """Publish `plan` and make `recovery` the one under way; `supersedes`: the generation of
    the plan it replaces (its survivors move on); `expect_reports`: how many holdings reports
    the store counts for it. `fresh`, `base`: the ranks that died this tick and who held their
    slots (for the line the user reads)."""

    plan: Plan
    recovery: PendingRecovery
    supersedes: int | None
    expect_reports: int
    fresh: tuple[int, ...]
    base: Mapping[int, str]
    replicas_lost: tuple[int, ...] = ()
    """The owners with a holder among the dead (`under_replicated.replicas_lost`)."""


# ---------------------------------------------------------------------- agreement
@dataclass(frozen=True)
class Agree:
    """Every planned survivor reported: publish where each needy rank's shard comes from, the
    new roster and its decision (restore iteration `roster.restore_iteration`)."""

    roster: Roster
    sources: Mapping[int, int]
    last_completed: int
    under_replicated: tuple[int, ...] = ()
    """The owners short of replicas at the restore iteration (`short_of_replicas`)."""


@dataclass(frozen=True)
class Condemn:
    """Name live `member` dead, killed where the launcher can (a newcomer too late to claim
    its slot): the next plan gives its slot to another."""

    member: str
    why: str


Action = (
    EndJobError
    | EndAfterTraining
    | EndOutOfRedundancy
    | GiveUpSlot
    | MoveSlotOn
    | RefuseRespawn
    | OrderRespawn
    | TakeSpare
    | PublishPlan
    | Agree
    | Condemn
)
"""Every action a decision can come to."""
