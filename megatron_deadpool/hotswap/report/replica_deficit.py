"""The shards short of replicas right now, as the coordinator's events and rank 0 tell.

The coordinator counts at a recovery (`coordinator/under_replicated.py`): its `plan` event names
the shards whose copies died with the dead ranks (`replicas_lost`), its `agreed` event the shards
of which fewer than deadpool-replicas ranks hold a copy of the restore iteration T
(`under_replicated`: the newcomers in the dead ranks' slots hold none yet). They stay short
until a replication round after T commits in that generation: every holder, the newcomers
too, verified its copy of it. That commit is what rank 0 reports (its iteration record, or
`Progress`), and what every rank knows itself (`replicated_again`). `ReplicaDeficit` follows
both, for the metrics file and the job status the ranks' scalars read.

A placement always gives each shard k holders (or the job does not start), so no shard is
short for good; a job that ended out of redundancy keeps its last count. Before the first
committed round nothing is replicated yet: the count is 0 then, and
`deadpool_committed_iteration` absent (-1 in the scalars) says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def replicated_again(
    generation: int, committed: int | None, agreed_generation: int, restore_iteration: int | None
) -> bool:
    """Whether a round after the restore iteration of the recovery agreed in generation
    `agreed_generation` committed: `committed`, the committed iteration of a rank in
    `generation` (None: none yet), is newer; False while a recovery is not agreed yet
    (`restore_iteration` None)."""
    return (
        restore_iteration is not None
        and committed is not None
        and generation >= agreed_generation
        and committed > restore_iteration
    )


@dataclass
class ReplicaDeficit:
    """The owners whose shards are short of replicas, from the coordinator's events and the
    committed iterations reported since."""

    owners: frozenset[int] = frozenset()
    generation: int = 0
    """The generation of the last recovery planned or agreed."""
    restore_iteration: int | None = None
    """Its restore iteration; None while it is planned, not agreed."""

    @property
    def count(self) -> int:
        return len(self.owners)

    def on_event(self, entry: Mapping[str, Any]) -> bool:
        """Follow a coordinator event (`EventLog` entry); True when the count changed."""
        before = self.count
        kind = entry.get("event")
        if kind == "plan":  # these copies went too (earlier ones may not be back yet)
            self.owners = self.owners | frozenset(entry.get("replicas_lost") or ())
            self.generation, self.restore_iteration = int(entry["generation"]), None
        elif kind == "agreed":  # what the reporting ranks hold: the exact count
            self.owners = frozenset(entry.get("under_replicated") or ())
            self.generation = int(entry["generation"])
            self.restore_iteration = int(entry["restore_iteration"])
        return self.count != before

    def on_committed(self, generation: int, committed: int | None) -> bool:
        """Rank 0 in `generation` reports `committed`; True when that cleared the count."""
        if self.owners and replicated_again(
            generation, committed, self.generation, self.restore_iteration
        ):
            self.owners = frozenset()
            return True
        return False
