"""The coordinator's view of the job's redundancy, published for the ranks (`JobStatus`).

Megatron-LM's ranks write DeadPool's scalars through Megatron's TensorBoard/W&B writers, but
only the coordinator knows how many spares are left, how many failed processes were respawned
in place, how many shards a recovery left short of replicas and whether its standby
coordinators answer. `publish_status` follows the coordinator's event log and rewrites
`job/status` in the store whenever one of those changes; the last rank reads it once per
TensorBoard interval (`megatron_lm/session.py`) and counts the short shards 0 once it
committed a round after the recovery's restore iteration (`replica_deficit.replicated_again`).
"""

from __future__ import annotations

from typing import Any

from ..coordinator.coordinator import Coordinator
from ..coordinator.events import EventLog
from ..protocol.messages import JobStatus
from .replica_deficit import ReplicaDeficit

CHANGES = (
    "recovered",
    "respawned",
    "spare_lost",
    "plan",
    "agreed",
    "standby_lost",
    "standby_back",
)
"""The events after which the status is published again."""


def status_of(
    coord: Coordinator, standbys: int, lost: int, deficit: ReplicaDeficit | None = None
) -> JobStatus:
    """The job's status as `coord` knows it; `standbys` configured, `lost` of them silent;
    `deficit`: the shards short of replicas (none: 0)."""
    recoveries = coord.recoveries
    deficit = deficit or ReplicaDeficit()
    return JobStatus(
        spares_available=len(coord.spares),
        recoveries=len(recoveries),
        respawns=sum(len(r.get("respawned") or {}) for r in recoveries),
        standbys=standbys,
        standbys_reachable=max(0, standbys - lost),
        under_replicated=deficit.count,
        agreed_generation=deficit.generation,
        restore_iteration=deficit.restore_iteration,
    )


def publish_status(events: EventLog, coord: Coordinator, standbys: int) -> None:
    """Publish the job's status now and after each event of `CHANGES` in `events`;
    `standbys`: the standby coordinators configured after this one."""
    lost: set[str] = set()
    deficit = ReplicaDeficit()

    def listener(entry: dict[str, Any]) -> None:
        kind = entry.get("event")
        deficit.on_event(entry)
        if kind not in CHANGES:
            return
        if kind == "standby_lost":
            lost.add(str(entry.get("standby")))
        elif kind == "standby_back":
            lost.discard(str(entry.get("standby")))
        coord.membership.publish_job_status(status_of(coord, standbys, len(lost), deficit))

    coord.membership.publish_job_status(status_of(coord, standbys, 0))
    events.listeners.append(listener)
