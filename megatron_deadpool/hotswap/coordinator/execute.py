"""The coordinator's executor: it performs what the decisions (`decide.py`) came to.

Each action becomes the coordinator's store writes (through its `CoordinatorView`), an order to a
node's agent, its events and the lines the user reads - in the order of the actions, as the
coordinator made them before its decisions were split from its acts - and updates
`CoordinatorState`, the coordinator's record of the job (its roster, spares, recovery under
way, outcome). Nothing is chosen here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...errors import ExitCode
from ..protocol.coordinator_view import CoordinatorView
from ..protocol.messages import Decision, EndReport, JobError, OutOfRedundancy, Roster, Sources
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
from .clock import Clock
from .decide import RespawnOutcome
from .detector import FailureDetector
from .events import EventLog
from .respawn import NodeAgents, RespawnBudget


@dataclass
class CoordinatorState:
    """What the coordinator's decisions made of the job so far."""

    roster: Roster
    """The newest published roster."""
    spares: list[str]
    """The spares still waiting, in the order they take slots."""
    next_generation: int = 1
    recovery: PendingRecovery | None = None
    replaced: dict[str, str] = field(default_factory=dict)
    """Newcomer -> the member whose slot it took."""
    respawned: set[str] = field(default_factory=set)
    """Members a node's agent started in a failed one's place."""
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    out_of_redundancy: OutOfRedundancy | None = None
    ended: EndReport | None = None
    job_error: JobError | None = None


class Executor:
    """Performs actions for one coordinator: its store, agents, detector, events and lines."""

    def __init__(
        self,
        state: CoordinatorState,
        membership: CoordinatorView,
        detector: FailureDetector,
        events: EventLog,
        say: Callable[[str], None],
        clock: Clock,
        agents: NodeAgents | None = None,
        budget: RespawnBudget | None = None,
    ) -> None:
        self.state = state
        self.membership = membership
        self.detector = detector
        self.events = events
        self.say = say
        self.clock = clock
        self.agents = agents
        self.budget = budget

    def __call__(self, action: Action) -> None:
        """Perform `action` (an `OrderRespawn` through `respawn`, which returns its outcome)."""
        m, state = self.membership, self.state
        if isinstance(action, GiveUpSlot):
            m.give_up_slot(action.generation, action.rank)
        elif isinstance(action, MoveSlotOn):
            m.move_slot_on(action.generation, action.rank)
        elif isinstance(action, RefuseRespawn):
            self._refused(action)
        elif isinstance(action, OrderRespawn):
            raise TypeError("an OrderRespawn has an outcome: perform it with respawn()")
        elif isinstance(action, TakeSpare):
            state.spares.remove(action.member)
            state.replaced[action.member] = action.replaces
        elif isinstance(action, PublishPlan):
            self._publish_plan(action)
        elif isinstance(action, Agree):
            self._agree(action)
        elif isinstance(action, Condemn):
            self.detector.condemn(action.member, action.why)
        elif isinstance(action, EndJobError):
            self._job_error(action.verdict)
        elif isinstance(action, EndAfterTraining):
            self._end(action)
        elif isinstance(action, EndOutOfRedundancy):
            self._out_of_redundancy(action)

    def respawn(self, order: OrderRespawn) -> RespawnOutcome:
        """Ask the node's agent for the new process; what it came to."""
        assert self.agents is not None and self.budget is not None
        try:
            member = self.agents.respawn(order.rank, order.replaces, order.node)
        except OSError as exc:  # the node cannot start a process (fork server, limits): a spare
            return RespawnOutcome(None, str(exc))
        self.budget.spend(order.node, self.clock.monotonic())
        self.state.respawned.add(member)
        self.state.replaced[member] = order.replaces
        self.detector.watch([member])
        self.events(
            "respawned", rank=order.rank, node=order.node, member=member, replaces=order.replaces
        )
        return RespawnOutcome(member)

    # ------------------------------------------------------------------ each kind
    def _refused(self, action: RefuseRespawn) -> None:
        self.events("respawn_refused", rank=action.rank, node=action.node, why=action.why)
        if action.used is not None:
            window = self.budget.window if self.budget is not None else 0.0
            self.say(
                f"node {action.node}: {action.used} respawn(s) within {window:g}s "
                f"(deadpool-respawn-limit): no respawn for rank {action.rank}"
            )

    def _publish_plan(self, action: PublishPlan) -> None:
        m, plan, rec = self.membership, action.plan, action.recovery
        self.state.next_generation = plan.generation + 1
        self.state.recovery = rec
        m.publish_plan(plan)
        # The spares and respawned processes it names wait for it: a respawned one reports
        # what its node's files hold, each builds its objects while the survivors agree.
        if plan.replaced:
            m.wake_spares()
        # Then every member of the roster the survivors joined: their plan waiters stop them
        # now, not at their next collective with the dead (most of an iteration at worst).
        m.wake_plan_waiters([plan.generation], self._roster_members())
        # Survivors report without waiting for the plan: some reports may be in already.
        m.expect_reports(plan.generation, action.expect_reports)
        if action.supersedes is not None:  # survivors waiting on the old plan move on to this
            m.decide(action.supersedes, Decision.superseded(plan.generation))
            # Its repair in place may be under way: no one waits for the handles of a rank lost
            # before it published them (a death after: `group_repair.InPlace.on_repair`).
            m.abandon_repair_handles(action.supersedes, action.fresh)
        slots, base = rec.slots, action.base
        self.events(
            "plan",
            generation=plan.generation,
            dead=plan.dead,
            needy=plan.needy,
            slots=slots,
            replicas_lost=list(action.replicas_lost),
        )
        replaced = ", ".join(
            (
                f"rank {r} <- {slots[r]}"
                + (f" (respawned on node {rec.respawned[r]})" if r in rec.respawned else "")
                if slots[r] != base[r]
                else f"rank {r}: no spare"
            )
            for r in action.fresh
        )
        self.say(
            f"recovery: generation {plan.generation}, dead ranks {sorted(rec.dead)}; {replaced}"
        )

    def _roster_members(self) -> list[str]:
        """The members of the newest roster: the processes a plan's wake-up may stop."""
        return sorted(set(self.state.roster.slots.values()))

    def _agree(self, action: Agree) -> None:
        rec, roster, m = self.state.recovery, action.roster, self.membership
        assert rec is not None and roster.restore_iteration is not None
        rec.prev_last_iteration = action.last_completed
        rec.t_agreed, rec.agreed_at = self.clock.time(), self.clock.monotonic()
        rec.restore_iteration = roster.restore_iteration
        m.publish_sources(roster.generation, Sources(dict(action.sources)))
        m.publish_roster(roster)
        m.decide(roster.generation, Decision.roster(roster.restore_iteration))
        self.state.roster = roster
        self.events(
            "agreed",
            generation=roster.generation,
            restore_iteration=roster.restore_iteration,
            sources=dict(action.sources),
            last_completed=action.last_completed,
            under_replicated=list(action.under_replicated),
        )
        self.say(
            f"agreed: restore iteration {roster.restore_iteration}, "
            + (
                "shards from "
                + ", ".join(f"rank {h} -> rank {n}" for n, h in action.sources.items())
                if action.sources
                else "every rank from its own snapshot"
            )
        )

    def _out_of_redundancy(self, action: EndOutOfRedundancy) -> None:
        report = action.report
        if self.state.recovery is not None and action.last_completed is not None:
            self.state.recovery.prev_last_iteration = action.last_completed
        self.state.out_of_redundancy = report
        # Survivors waiting on the current plan, and those that report for the next
        # generation, see the decision.
        self.membership.publish_out_of_redundancy(report, list(action.generations))
        self.membership.wake_plan_waiters(action.generations, self._roster_members())
        self.events("out_of_redundancy", **report.to_dict())
        self.say(f"OUT OF REDUNDANCY: {report.reason}")

    def _job_error(self, verdict: JobError) -> None:
        """The job's own error: no plan, no spare; the job ends (the launchers stop it)."""
        self.state.job_error = verdict
        self.membership.publish_job_error(verdict)
        self.events("job_error", **verdict.to_dict())
        self.say(f"JOB ERROR: {verdict.report.cause()}")
        self.say(f"{verdict.reason}; no spare used: fix the job (exit code {ExitCode.JOB_ERROR:d})")

    def _end(self, action: EndAfterTraining) -> None:
        report = action.report
        self.state.ended = report
        for member in action.members:
            self.detector.mark_after_work(member)
        self.membership.publish_end(report)
        self.events("lost_after_training", **report.to_dict())
        lost = list(report.lost_ranks)
        self.say(
            f"rank(s) {list(action.fresh)} lost after training completed at iteration "
            f"{report.completed_iteration}: nothing to recompute"
            + (f"; the final state of rank(s) {lost} is gone with them" if lost else "")
        )
