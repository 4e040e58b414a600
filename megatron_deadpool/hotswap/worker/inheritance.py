"""What a process respawned in place inherits: its predecessor's segment files.

A process its node's agent starts in a dead one's place (`respawn.py`) waits for its slot as a
spare does. Its node keeps the dead process's snapshots and replicas in segment files
(`replication.segments`). While it waits, once the coordinator's plan that names it is out (the
plan wakes it), it reads what those files hold, verified, and reports it as a survivor reports
(`Inheritance.report`), so that the coordinator's decision counts its own snapshot and the
replicas it held; again for a plan that supersedes that one. When it takes its slot, its own
snapshot restores it unless the coordinator named a holder for it (`Inheritance.take`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ...replication.segments import SegmentHoldings
from ..protocol.messages import HoldingsReport
from ..protocol.worker_view import WorkerView

log = logging.getLogger("megatron_deadpool.driver")


class Inheritance:
    """A waiting process's view of its node's segment files (`where`: None, none)."""

    def __init__(self, where: Path | None) -> None:
        self.where = where
        self.holdings: SegmentHoldings | None = None
        self.reported = 0  # the newest plan they were reported for

    def report(self, membership: WorkerView, member: str) -> None:
        """Report what the files hold for the newest plan, if it names `member` for a slot it
        restores (once per plan; nothing without files): a slot the plan gives it, or the one an
        earlier plan gave it that this plan - a death before it restored - keeps (a plan based
        on a roster that has it already lists it as needy, not as a replacement, and the
        coordinator waits for its report all the same)."""
        if self.where is None:
            return
        g = membership.latest_plan()
        if g <= self.reported:
            return
        plan = membership.plan(g)
        if plan is None:
            return
        rank = next((r for r, m in plan.replaced.items() if m == member), None)
        if rank is None:
            rank = membership.roster(plan.base).rank_of(member)
            if rank not in plan.needy:
                return
        if self.holdings is None or self.holdings.rank != rank:
            self.holdings = SegmentHoldings(self.where, rank)
        holds = {k: tuple(v) for k, v in self.holdings.holdings().items()}
        membership.report_holdings(g, rank, HoldingsReport(member, 0, holds))
        if not any(holds.values()):  # nothing inherited (a spare's empty folder): nothing held
            self.holdings = None
        self.reported = g
        log.info("reported the segments of rank %d for generation %d: %s", rank, g, holds)

    def take(self, rank: int, sources: dict[int, int]) -> SegmentHoldings | None:
        """What restores `rank` as it takes its slot: the files, unless the coordinator named a
        holder for it (`sources`: needy rank -> holder). Kept - what a recovery before the
        restore reports (`Driver.recover`) - until the restore made its replicator (`restored`:
        the files become its slots)."""
        held = self.holdings
        return held if held is not None and held.rank == rank and rank not in sources else None

    def restored(self) -> None:
        """The process restored: the files are its replicator's slots from now on."""
        self.holdings = None
