"""Where Megatron-LM's survivors stand in a recovery, and the step they all go on at.

Each survivor adds a `SurvivorReport` to its holdings report: the step it is about to return
to Megatron (its *target*), Megatron's counters and its `training_log` sums. Survivors normally
report one target. They can report two, one step apart, when a peer dies inside the last
collective of step n (the replication round's agreement, a world all-reduce) and that
collective completes on some ranks only (a ring cut part-way): a rank it completed on finishes
step n, meets the failure in the next world collective - `training_log`'s barrier, between the
steps - and defers it to step n+1; a rank it failed on recovers inside step n. Both restore the
same iteration, so their states agree; only their place in Megatron's loop differs.

The job then goes on at the later step (`resume_step`): a rank one step behind runs step n as
usual and skips step n's between-step work (`MegatronSession.skips_between_steps`) - the ranks
ahead left it behind in the old generation, and its collectives would meet nobody - and takes
the running sums of a rank ahead (`peer_ahead`), as a newcomer, which starts at the later step,
does. A newcomer's start-up is planned from the same reports (`newcomer_plan`). Pure functions
over the reports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import DeadpoolRuntimeError
from ..hotswap.protocol.messages import Roster


@dataclass(frozen=True)
class SurvivorReport:
    """What a Megatron-LM survivor adds to its holdings report in a recovery
    (`JobAdapter.recovery_report`): what a newcomer's start-up needs to stand where it does."""

    target: int | None
    """The step this survivor is about to return to Megatron."""
    counters: dict[str, dict[str, float]]
    """step -> Megatron's sample/FLOP counters after it."""
    flags: tuple[bool, bool, bool]
    """Megatron's args.do_train, do_valid, do_test."""
    log_state: dict[str, Any] | None
    """Its `training_log` running sums."""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "flags": list(self.flags)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SurvivorReport:
        try:
            flags = tuple(bool(f) for f in d["flags"])
            return cls(
                target=None if d["target"] is None else int(d["target"]),
                counters={str(k): dict(v) for k, v in d["counters"].items()},
                flags=(flags[0], flags[1], flags[2]),
                log_state=d["log_state"],
            )
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise DeadpoolRuntimeError(f"a survivor's report is not Megatron-LM's: {exc}") from None


def resume_step(reports: Mapping[int, SurvivorReport]) -> int:
    """The step the job goes on at: the latest survivor's target. Survivors at most one step
    behind it can follow (they skip that step's between-step work); anything else is an error."""
    targets = {r.target for r in reports.values()}
    if not targets or None in targets:
        raise DeadpoolRuntimeError("survivors report no step to resume")
    steps = {t for t in targets if t is not None}
    if max(steps) - min(steps) > 1:
        raise DeadpoolRuntimeError(f"survivors report steps to resume too far apart: {steps}")
    return max(steps)


def peer_ahead(
    reports: Mapping[int, SurvivorReport], step: int, preferred: Iterable[int] = ()
) -> SurvivorReport:
    """The report of a survivor at `step`: the first of `preferred` there (a data-parallel peer
    at the same position holds the same `training_log` sums), else the lowest rank there."""
    ahead = {r: report for r, report in reports.items() if report.target == step}
    if not ahead:
        raise DeadpoolRuntimeError(f"no survivor reports step {step}")
    return next((ahead[r] for r in preferred if r in ahead), ahead[min(ahead)])


@dataclass
class NewcomerPlan:
    """What a spare taking a slot must know before Megatron's start-up."""

    roster: Roster
    target: int  # the step every survivor is about to return to Megatron
    counters: dict[str, dict[str, float]]  # step -> Megatron's sample/FLOP counters after it
    flags: tuple[bool, bool, bool]  # Megatron's args.do_train, do_valid, do_test
    log_state: dict[str, Any] | None = None  # a same-position survivor's training_log sums


def newcomer_plan(
    roster: Roster, reports: Mapping[int, SurvivorReport], holder: int | None
) -> NewcomerPlan:
    """A newcomer of `roster` starts at the survivors' resume step with the counters, flags
    and `training_log` sums of a survivor there: `holder` (the rank it restores from) if it
    is, else the lowest rank there."""
    target = resume_step(reports)
    ahead = peer_ahead(reports, target, () if holder is None else (holder,))
    return NewcomerPlan(roster, target, ahead.counters, ahead.flags, ahead.log_state)
