"""The coordinator's view of the job's redundancy, published for the ranks (`JobStatus`).

Megatron-LM's ranks write DeadPool's scalars through Megatron's TensorBoard/W&B writers, but
only the coordinator knows how many spares are left, how many failed processes were respawned
in place and whether its standby coordinators answer. `publish_status` follows the
coordinator's event log and rewrites `job/status` in the store whenever one of those changes;
the last rank reads it once per TensorBoard interval (`megatron_lm/session.py`).
"""

from __future__ import annotations

from typing import Any

from ..coordinator.coordinator import Coordinator
from ..coordinator.events import EventLog
from ..protocol.messages import JobStatus

CHANGES = ("recovered", "respawned", "spare_lost", "plan", "standby_lost", "standby_back")
"""The events after which the status is published again."""


def status_of(coord: Coordinator, standbys: int, lost: int) -> JobStatus:
    """The job's status as `coord` knows it; `standbys` configured, `lost` of them silent."""
    recoveries = coord.recoveries
    return JobStatus(
        spares_available=len(coord.spares),
        recoveries=len(recoveries),
        respawns=sum(len(r.get("respawned") or {}) for r in recoveries),
        standbys=standbys,
        standbys_reachable=max(0, standbys - lost),
    )


def publish_status(events: EventLog, coord: Coordinator, standbys: int) -> None:
    """Publish the job's status now and after each event of `CHANGES` in `events`;
    `standbys`: the standby coordinators configured after this one."""
    lost: set[str] = set()

    def listener(entry: dict[str, Any]) -> None:
        kind = entry.get("event")
        if kind not in CHANGES:
            return
        if kind == "standby_lost":
            lost.add(str(entry.get("standby")))
        elif kind == "standby_back":
            lost.discard(str(entry.get("standby")))
        coord.membership.publish_job_status(status_of(coord, standbys, len(lost)))

    coord.membership.publish_job_status(status_of(coord, standbys, 0))
    events.listeners.append(listener)
