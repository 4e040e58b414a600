"""A recovery's newcomer claims its slot: once its objects are built, right before it joins.

The survivors of generation g wait for every newcomer's claim (`WorkerView.wait_newcomers`),
where the coordinator can release them, not inside the generation's rendezvous, which nothing
but the process-group timeout ends: a newcomer lost while building its objects would hold them
there past the next plan's agreement timeout (out of redundancy). The coordinator settles a
slot first when it plans again before the newcomer claimed it (`Coordinator._plan`): a lost
newcomer's slot is given up - the newcomer, had it lived, stops with an error -, a live one's
is moved on: the slot is this process's in the next generation, whose roster it waits for and
claims there (it must keep the rank and restore iteration its objects were built for), or the
job ended meanwhile and it leaves with exit code 0. `claim_slot` is the claim itself, which a
survivor the plan counts as a newcomer makes too (`Recovery.agree`).

A newcomer whose job builds its own objects (Megatron-LM's `pretrain`) starts building as soon
as a plan names it for a slot, before the survivors agree on the restore iteration; its job then
waits for the agreed roster where it first needs it (`agreed`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ...errors import DeadpoolRuntimeError, ExitCode
from ..protocol.messages import CLAIMED, MOVED_ON, Roster
from ..protocol.worker_view import WorkerView
from .injection import FaultInjector
from .newcomer_build import planned_roster

log = logging.getLogger(__name__)


def claim_slot(membership: WorkerView, g: int, rank: int) -> bool:
    """Claim `rank`'s slot of generation g: True, claimed (and stamped `claimed`); False, moved
    on (the next plan holds it); given up (the coordinator took this process for lost): an
    error."""
    held = membership.claim_slot(g, rank)
    if held not in (CLAIMED, MOVED_ON):
        raise DeadpoolRuntimeError(
            f"the coordinator gave up rank {rank} of generation {g} before this process claimed "
            "it (it took this process for lost)"
        )
    if held == CLAIMED:  # when: the recovery's record tells the newcomer's build from the repair
        membership.stamp(g, "claimed", rank)
    return held == CLAIMED


def claim(
    membership: WorkerView,
    faults: FaultInjector,
    member: str,
    roster: Roster,
    wait_for_slot: Callable[[int], Roster | None],
) -> Roster:
    """Claim `member`'s slot of `roster` (a recovery's generation); returns the roster it joins.
    `wait_for_slot(g)`: the next roster after generation g that names it (None: the job
    ended)."""
    g, rank = roster.generation, roster.rank_of(member)
    if rank is None:
        raise DeadpoolRuntimeError(f"generation {g}'s roster names no slot of {member}")
    faults.on_assignment(member, rank, g)  # `spare:I@recovery`
    if claim_slot(membership, g, rank):
        return roster
    log.info("generation %d will not be joined: waiting for the next one's roster", g)
    later = _or_released(wait_for_slot(g))
    if later.rank_of(member) != rank or later.restore_iteration != roster.restore_iteration:
        raise DeadpoolRuntimeError(
            f"generation {later.generation} gives this newcomer rank {later.rank_of(member)} at "
            f"iteration {later.restore_iteration}, not rank {rank} at "
            f"{roster.restore_iteration} as it built its objects for"
        )
    return claim(membership, faults, member, later, wait_for_slot)


def _or_released(later: Roster | None) -> Roster:
    """`later`, the roster a newcomer waited for; None - the job ended meanwhile - ends the
    process with exit code 0."""
    if later is None:
        log.info("released: the job ended before this newcomer joined")
        raise SystemExit(ExitCode.OK)
    return later


def slot_roster(membership: WorkerView, member: str, after: int, planned: bool) -> Roster | None:
    """The roster of a generation after `after` that names `member` (`Driver.wait_for_slot`):
    the newest published one, else (`planned`) the one the newest plan leads to, its restore
    iteration not agreed yet (`newcomer_build.planned_roster`); None when neither does."""
    g = membership.generation()
    roster = membership.roster(g) if g > after else None
    if roster is not None and roster.rank_of(member) is not None:
        return roster
    ahead = planned_roster(membership, member) if planned else None
    return ahead if ahead is not None and ahead.generation > after else None


def agreed(
    roster: Roster,
    member: str,
    wait_for_slot: Callable[[int, Callable[[WorkerView, str], None]], Roster | None],
) -> Roster:
    """The agreed roster a newcomer joins, when it started building at the plan of `roster`'s
    generation (its restore iteration not agreed yet; otherwise `roster` itself): that
    generation's roster once agreed, or a later plan's that superseded it before the agreement
    - with the same rank (a later plan keeps the slots of live newcomers: `coordinator.decide`).
    A later plan that names it no more (the coordinator took it for lost) is an error, as is a
    roster with another rank or no restore iteration. `wait_for_slot(g, meanwhile)` as for
    `claim`, `meanwhile` called each time it looks; the job ended meanwhile: exit code 0."""
    if roster.restore_iteration is not None:
        return roster

    def still_named(membership: WorkerView, member: str) -> None:
        latest = membership.latest_plan()
        if latest > roster.generation and planned_roster(membership, member, latest) is None:
            raise DeadpoolRuntimeError(
                f"plan {latest} gave rank {roster.rank_of(member)} to another process before "
                f"the survivors agreed on generation {roster.generation} (the coordinator took "
                "this newcomer for lost)"
            )

    later = _or_released(wait_for_slot(roster.generation - 1, still_named))
    if later.rank_of(member) != roster.rank_of(member) or later.restore_iteration is None:
        raise DeadpoolRuntimeError(
            f"generation {later.generation} gives this newcomer rank {later.rank_of(member)} at "
            f"iteration {later.restore_iteration}, not rank {roster.rank_of(member)} at an "
            "agreed iteration as its plan did when it began to build"
        )
    return later
