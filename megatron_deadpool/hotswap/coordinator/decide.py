"""The coordinator's decisions, pure: from what it knows and what it observed to actions.

No store, no clock, no events in here: the coordinator (`coordinator.py`) reads the store and
its clock into plain values, calls one of these functions and hands the actions to its
executor (`execute.py`), which writes, orders and reports them in the order given.
  - `decide_deaths`: members died this tick (`Deaths`: the ranks, the roster or the recovery
    under way, the spares, the error reports, ...). The job's own error ends the job
    (`job_error.judge`); a death after training completed ends it with what was lost
    (`end_after_training`); otherwise a plan of a new generation: the newcomers of a decided
    recovery settled (given up when dead, moved on when alive and not restored), each dead
    rank's slot respawned on its node while the node's agent lives and its budget allows
    (`respawn.py`), else given to a spare - one that beat first - else left empty (no spare:
    the recovery can only save what survives).
  - `decide_agreement`: every planned survivor reported its holdings: the restore iteration,
    sources and roster (`restore_plan.plan_restore`), or out of redundancy with what survivors
    save (`plan_salvage`).
  - `late_newcomers`: newcomers that did not claim their slot within the join timeout.

A respawn is an order whose outcome the decision needs (the new member's name, or why the node
could not start one): `decide_deaths` stops after an `OrderRespawn` whose outcome it is not
given, and the caller, once it has the outcome, calls it again with the same facts and the
outcome: the actions before the order come out the same, and the caller performs only those
after it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ...replication.placement import Placement
from ..protocol.messages import (
    EndReport,
    ErrorReport,
    HoldingsReport,
    OutOfRedundancy,
    Plan,
    Roster,
    SaveOrder,
)
from .actions import (
    Action,
    Agree,
    Condemn,
    EndAfterTraining,
    EndJobError,
    EndOutOfRedundancy,
    GiveUpSlot,
    MoveSlotOn,
    OrderRespawn,
    PendingRecovery,
    PublishPlan,
    RefuseRespawn,
    TakeSpare,
)
from .job_error import judge
from .restore_plan import RestorePlan, plan_restore, plan_salvage
from .under_replicated import replicas_lost, short_of_replicas


@dataclass(frozen=True)
class NodeState:
    """A node as the coordinator sees it when it plans: whether its agent can start a process
    now, and how many respawns it made within the respawn window (those of a coordinator this
    one replaced included: `RespawnBudget.recall`)."""

    alive: bool
    recent: int = 0


@dataclass(frozen=True)
class Respawning:
    """What in-place respawn can do while planning: at most `limit` respawns per node within
    `window` seconds; `node_of`: the node of each dead member; `nodes`: those nodes' states."""

    limit: int
    window: float
    node_of: Mapping[str, int]
    nodes: Mapping[int, NodeState]


@dataclass(frozen=True)
class RespawnOutcome:
    """What an `OrderRespawn` came to: the new process's member name, or why the node could
    not start one (`member` None)."""

    member: str | None
    why: str = ""


@dataclass(frozen=True)
class Deaths:
    """What the coordinator knows and observed when members died this tick."""

    dead: frozenset[int]
    """The ranks whose members died (with their silent node mates), not planned for yet."""
    world_size: int
    roster: Roster
    """The newest published roster."""
    recovery: PendingRecovery | None
    """The recovery under way, if any (planned, maybe decided)."""
    next_generation: int
    spares: tuple[str, ...] = ()
    """The spares waiting, in the order they take slots."""
    beaten: frozenset[str] = frozenset()
    """Spares whose heartbeat was seen: past their start-up, taken first."""
    errors: Mapping[str, ErrorReport] = field(default_factory=dict)
    """Every member's error report so far (member -> its first)."""
    chain: Mapping[str, str] = field(default_factory=dict)
    """Newcomer -> the member whose slot it took, respawned newcomers left out (an error
    repeated on the same node proves nothing about the job)."""
    completed: int | None = None
    """The iteration training completed at, when it did and no recovery is under way."""
    restored: frozenset[int] = frozenset()
    """Newcomers of the decided recovery under way (by rank) that restored already."""
    respawning: Respawning | None = None
    """None: every dead rank takes a spare (no agents, or no layout yet)."""
    placement: Placement | None = None
    ended: EndReport | None = None
    """The end report of ranks lost after training earlier, if any."""
    failure: tuple[float, str] = (0.0, "")
    """When the first failure of a new recovery happened (wall clock) and the evidence."""
    now: float = 0.0
    """Wall clock when the deaths were noticed (the plan's detection time)."""
    monotonic: float = 0.0
    """Monotonic clock as the plan is made (the agreement timeout runs from it)."""
    progress: int = 0
    """The newest iteration the job reported complete."""


def decide_deaths(
    seen: Deaths, respawns: Mapping[int, RespawnOutcome] | None = None
) -> list[Action]:
    """What to do about the ranks that died (`seen.dead`, not empty); `respawns`: the outcomes
    of the respawn orders made so far this tick (rank -> outcome)."""
    slots = seen.recovery.slots if seen.recovery else seen.roster.slots
    verdict = judge({r: slots[r] for r in seen.dead}, seen.errors, seen.chain)
    if verdict is not None:
        return [EndJobError(verdict)]
    if seen.completed is not None:
        return [end_after_training(seen)]
    return _plan(seen, respawns or {})


def end_after_training(seen: Deaths) -> EndAfterTraining:
    """Ranks lost after training completed at `seen.completed`: who died (with those lost
    earlier), and which live holder keeps each dead rank's final state."""
    completed = seen.completed
    assert completed is not None
    earlier = seen.ended
    all_dead = sorted(set(earlier.dead_ranks if earlier else ()) | seen.dead)
    placement = seen.placement
    sources: dict[int, int] = {}
    for rank in all_dead:
        holders = placement.holders[rank] if placement else ()
        alive = [h for h in holders if h not in all_dead]
        if alive:
            sources[rank] = alive[0]
    lost = tuple(r for r in all_dead if r not in sources)
    report = EndReport(
        reason=f"rank(s) {all_dead} lost after training completed at iteration {completed}",
        completed_iteration=completed,
        dead_ranks=tuple(all_dead),
        lost_ranks=lost,
        save=SaveOrder(iteration=completed, sources=sources, complete=not lost, missing=lost),
    )
    fresh = tuple(sorted(seen.dead))
    return EndAfterTraining(report, tuple(seen.roster.slots[r] for r in fresh), fresh)


def _plan(seen: Deaths, respawns: Mapping[int, RespawnOutcome]) -> list[Action]:
    """The plan of the next generation: the decided recovery's newcomers settled, each dead
    rank's slot respawned, given a spare or left empty, then `PublishPlan` (a recovery under way
    is continued: its dead, needy and first failure carry over)."""
    rec, dead = seen.recovery, seen.dead
    base = rec.slots if rec else seen.roster.slots
    all_dead = (rec.dead if rec else set()) | dead
    slots = dict(base)
    needy = set(rec.needy) if rec else set()
    no_spare = rec.no_spare if rec else ""
    respawned = dict(rec.respawned) if rec else {}
    restored_earlier = dict(rec.restored_earlier) if rec else {}
    actions: list[Action] = []
    if rec is not None and rec.t_agreed is not None:  # decided; not everyone joined yet
        # Its survivors wait for every newcomer's claim (`wait_newcomers`); it will not be
        # joined now: settle every slot not claimed yet, so that they move on to this plan
        # - a newcomer lost is given up, a live one takes its slot in this plan instead.
        # A newcomer that restored already holds its state and its owners' replicas: it
        # survives into this plan and reports (one restoring after the coordinator looked stays
        # needy: it claims its slot again as it agrees, `Recovery.agree`).
        for rank in sorted(rec.needy):
            if rank in dead:
                actions.append(GiveUpSlot(rec.generation, rank))
            elif rank in seen.restored:
                needy.discard(rank)
                restored_earlier[rank] = respawned.pop(rank, None)
            else:
                actions.append(MoveSlotOn(rec.generation, rank))
    spares = list(seen.spares)
    spent: dict[int, int] = {}  # node -> respawns ordered in this plan
    for rank in sorted(dead):
        needy.add(rank)
        respawned.pop(rank, None)
        restored_earlier.pop(rank, None)
        if not no_spare and seen.respawning is not None:
            respawn = _respawn(rank, base[rank], seen.respawning, spent, respawns, actions)
            if isinstance(respawn, _Awaiting):  # the order's outcome decides what follows
                return actions
            if respawn is not None:
                slots[rank], respawned[rank] = respawn
                continue
        if spares and not no_spare:
            slots[rank] = _take_spare(spares, seen.beaten)
            actions.append(TakeSpare(rank, slots[rank], base[rank]))
        else:  # nothing can take the slot: agree anyway, to save what survives
            no_spare = f"no spare left to replace rank(s) {sorted(all_dead)}"
    generation = seen.next_generation
    if rec is not None:
        t_failure, evidence, t_detect = rec.t_failure, rec.failure_evidence, rec.t_detect
    else:
        (t_failure, evidence), t_detect = seen.failure, seen.now
    recovery = PendingRecovery(
        generation=generation,
        dead=all_dead,
        slots=slots,
        needy=needy,
        t_failure=t_failure,
        failure_evidence=evidence,
        t_detect=t_detect,
        t_plan=seen.now,
        planned_at=seen.monotonic,
        prev_last_iteration=seen.progress,
        no_spare=no_spare,
        respawned=respawned,
        restored_earlier=restored_earlier,
    )
    # What every survivor reads: the changes to the published roster, not all the slots
    # (16,384 survivors reading 200 KB each would keep the store busy for seconds).
    published = seen.roster.slots
    plan = Plan(
        generation=generation,
        base=seen.roster.generation,
        world_size=seen.world_size,
        dead=tuple(sorted(all_dead)),
        needy=tuple(sorted(needy)),
        replaced={r: m for r, m in slots.items() if published[r] != m},
    )
    actions.append(
        PublishPlan(
            plan=plan,
            recovery=recovery,
            supersedes=rec.generation if rec is not None else None,
            # The survivors report, and the processes respawned in place (from their segment
            # files).
            expect_reports=seen.world_size - len(needy) + len(respawned),
            fresh=tuple(sorted(dead)),
            base=base,
            replicas_lost=(
                tuple(replicas_lost(seen.placement, plan.dead)) if seen.placement else ()
            ),
        )
    )
    return actions


class _Awaiting:
    """`_respawn`'s answer while the outcome of its order is not known yet."""


_AWAIT = _Awaiting()


def _respawn(
    rank: int,
    dead: str,
    can: Respawning,
    spent: dict[int, int],
    outcomes: Mapping[int, RespawnOutcome],
    actions: list[Action],
) -> tuple[str, int] | _Awaiting | None:
    """A new process in the place of `dead` (which held `rank`) on its node, when that node's
    agent is alive and its budget allows one: (its member name, the node) once the order's
    outcome is known, `_AWAIT` before; None: take a spare. Appends the actions it takes."""
    node = can.node_of[dead]
    state = can.nodes.get(node, NodeState(alive=False))
    if not state.alive:
        actions.append(RefuseRespawn(rank, node, "node lost"))
        return None
    used = state.recent + spent.get(node, 0)
    if used >= can.limit:
        actions.append(RefuseRespawn(rank, node, "respawn limit reached", used=used))
        return None
    actions.append(OrderRespawn(rank, node, dead))
    outcome = outcomes.get(rank)
    if outcome is None:
        return _AWAIT
    if outcome.member is None:  # the node cannot start a process (fork server, limits)
        actions.append(RefuseRespawn(rank, node, f"cannot start one: {outcome.why}"))
        return None
    spent[node] = spent.get(node, 0) + 1
    return outcome.member, node


def _take_spare(spares: list[str], beaten: frozenset[str]) -> str:
    """The first spare whose heartbeat was seen, else the first (removed from `spares`): a
    spare still starting up (a refill, a joining one) would make the survivors wait for its
    start-up - and for ever if it never ends, as no heartbeat judges a process that never
    beat."""
    member = next((s for s in spares if s in beaten), spares[0])
    spares.remove(member)
    return member


def decide_agreement(
    rec: PendingRecovery,
    holdings: Mapping[int, HoldingsReport],
    placement: Placement | None,
    world_size: int,
    next_generation: int,
) -> Agree | EndOutOfRedundancy:
    """Every reporter of `rec` reported (`holdings`: rank -> its report): the roster of the
    restore iteration and the shards' sources, or - when memory cannot recover the failure - out
    of redundancy with what survivors save. `placement` None: the layout never arrived."""
    last = max([rec.prev_last_iteration] + [h.last_completed for h in holdings.values()])
    holds = {r: h.holds for r, h in holdings.items()}
    generations = (next_generation, rec.generation)
    if placement is None:  # failed during start-up: nothing was ever replicated
        return EndOutOfRedundancy(
            out_of_redundancy(
                f"rank(s) {sorted(rec.dead)} failed before replication started: nothing in "
                "memory to recover from (see their logs)",
                None,
                lost_ranks=sorted(rec.dead),
            ),
            generations,
            last,
        )
    plan = plan_restore(placement, holds, rec.needy, rec.respawned)
    if rec.no_spare or not plan.ok:
        survivors = {r: h for r, h in holds.items() if r not in rec.needy}  # they save
        report = out_of_redundancy(
            rec.no_spare or plan.reason,
            placement,
            lost_ranks=plan.lost_ranks,
            dead=sorted(rec.dead),
            save=save_order(placement, plan, survivors, rec.needy),
        )
        return EndOutOfRedundancy(report, generations, last)
    assert plan.iteration is not None
    roster = Roster(rec.generation, world_size, rec.slots, restore_iteration=plan.iteration)
    short = tuple(short_of_replicas(placement, holds, plan.iteration))
    return Agree(roster, plan.sources, last, under_replicated=short)


def out_of_redundancy(
    reason: str,
    placement: Placement | None,
    *,
    lost_ranks: Sequence[int],
    dead: Sequence[int] | None = None,
    save: SaveOrder | None = None,
) -> OutOfRedundancy:
    """The report of a failure memory cannot recover: why, the dead and lost ranks (`dead`
    None: the lost ones), the holders each lost shard had, what survivors save."""
    holders = placement.holders if placement is not None else None
    return OutOfRedundancy(
        reason=reason,
        dead_ranks=tuple(dead if dead is not None else lost_ranks),
        lost_ranks=tuple(lost_ranks),
        lost_shards_holders={r: tuple(holders[r]) if holders else () for r in lost_ranks},
        save=save,
    )


def save_order(
    placement: Placement,
    plan: RestorePlan,
    holds: Mapping[int, Mapping[str, Sequence[int]]],
    needy: set[int],
) -> SaveOrder | None:
    """What survivors write before stopping: one common iteration, and who writes what."""
    salvage = plan_salvage(placement, holds, needy, plan)
    if salvage is None:
        return None
    return SaveOrder(
        iteration=salvage.iteration,
        sources=dict(salvage.sources),
        complete=salvage.complete,
        missing=tuple(salvage.missing(needy)),
    )


def late_newcomers(
    rec: PendingRecovery,
    waited: float,
    join_timeout: float,
    dead: frozenset[str],
    claimed: frozenset[int],
) -> list[Condemn]:
    """The newcomers of decided `rec` that have not claimed their slot (`claimed`: the ranks
    whose slot was claimed) `waited` seconds after the decision, past `join_timeout`: taken for
    lost. The survivors wait for every claim, so one stuck in its build - alive, beating -
    would hold them for ever; the next plan gives its slot to another spare."""
    if waited <= join_timeout:
        return []
    return [
        Condemn(
            rec.slots[rank],
            f"did not take rank {rank}'s slot within {join_timeout:g}s of the "
            "decision (deadpool-join-timeout)",
        )
        for rank in sorted(rec.needy)
        if rec.slots[rank] not in dead and rank not in claimed
    ]
