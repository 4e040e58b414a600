"""What a job reports and reads through its driver: the one door from a job to the store.

A job's adapter (`embedded.job`, `megatron_lm.session`) never reaches the store's keys itself:
the driver answers its questions (a stop requested, the survivors' reports after a recovery,
the job's redundancy) and carries its reports (an iteration's record, a checkpoint not written,
the end, the load time), each decided once here - who reports (rank 0) included. `JobChannel`
is a part of `Driver` (`driver.py`), kept apart for its size.
"""

from __future__ import annotations

import threading
from typing import Any

from ...replication.replicator import Replicator
from ..protocol.messages import IterationRecord, JobStatus, Roster
from ..protocol.worker_view import WorkerView


class JobChannel:
    """The driver's methods a job reports and reads through (a part of `Driver`)."""

    rank: int | None
    sigterm: threading.Event
    replicator: Replicator | None
    committed: int | None

    @property
    def membership(self) -> WorkerView:
        """This process's store access (`Driver.membership`)."""
        raise NotImplementedError

    def _rank(self) -> int:
        raise NotImplementedError

    def stop_requested(self) -> bool:
        """This rank votes to stop after its step: SIGTERM, or (rank 0) the launcher asked."""
        return self.sigterm.is_set() or (self.rank == 0 and self.membership.preempt_requested())

    def report_iteration(self, record: IterationRecord) -> None:
        """Rank 0's record of an iteration, for the launcher (other ranks publish none)."""
        if self.rank == 0:
            self.membership.publish_metrics(record)

    def report_checkpoint_failure(self, iteration: int, line: str) -> None:
        """The job's checkpoint of `iteration` was not written (every rank alike): rank 0 tells
        the launcher (`line`)."""
        if self.rank == 0:
            self.membership.publish_checkpoint_failure(iteration, line)

    def report_end(self, preempted: tuple[int, bool, str] | None) -> None:
        """Training is over (rank 0 reports for the launcher): the last committed iteration,
        and (`preempted`: iteration, saved, why not) a stop on request."""
        if self.rank != 0:
            return
        if self.replicator is not None:
            self.membership.publish_final_replication(self.committed)
        if preempted is not None:
            self.membership.publish_preempted(*preempted)

    def report_load_time(self, seconds: float) -> None:
        """How long loading the job's checkpoint took on this rank."""
        self.membership.record_load_time(self._rank(), seconds)

    def job_status(self) -> JobStatus | None:
        """The job's redundancy now, as the coordinator last published it."""
        return self.membership.job_status()

    def survivor_reports(self, roster: Roster) -> dict[int, dict[str, Any]]:
        """The job fields (`JobAdapter.recovery_report`) each rank that keeps its slot in
        `roster` published with its holdings, by rank."""
        plan = self.membership.plan(roster.generation)
        needy = set(plan.needy) if plan else set()
        out = {}
        for r in range(roster.world_size):
            report = None if r in needy else self.membership.holdings(roster.generation, r)
            if report is not None:
                out[r] = report.job
        return out

    def restore_source(self, roster: Roster) -> int | None:
        """The rank that sends this rank its shard in `roster`'s recovery (None: none)."""
        return self.membership.sources(roster.generation).holders.get(self._rank())
