"""Which shards have fewer replicas in memory than the job asked for (pure counting).

Every rank owns one optimizer shard, and `Placement` names the k ranks that hold its replicas.
After every committed round each of them holds a verified copy; a failure takes the copies its
dead ranks held, and the processes that take their slots hold none until the next round
commits. The coordinator counts at two moments, and says so in its events (`plan`: the shards
that lost a copy with the dead ranks; `agreed`: the shards short of copies of the restore
iteration, from what the reporting ranks hold); the metrics file and the ranks' scalars follow
them until a round after the restore iteration commits (`report/replica_deficit.py`).

Algorithm (`short_of_replicas`): owner o is short when fewer than k of `holders[o]` reported a
verified copy of iteration T. Example: tp 2 x dp 2, two ranks per node, k=1: holders 0->[2],
1->[3], 2->[0], 3->[1]. Rank 2 dies and a spare takes its slot; the survivors 0, 1, 3 report;
owner 0's holder, rank 2, has nothing: [0] is short. Rank 2's own shard is not: rank 0 holds
its copy (the newcomer restores from it).
"""

from __future__ import annotations

from collections.abc import Iterable

from ...replication.placement import Placement
from .restore_plan import Holdings


def replicas_lost(placement: Placement, dead: Iterable[int]) -> list[int]:
    """The owners (sorted) with a holder among `dead`: the copies held there went with them."""
    gone = set(dead)
    return [o for o, holders in enumerate(placement.holders) if gone.intersection(holders)]


def short_of_replicas(placement: Placement, holdings: Holdings, iteration: int) -> list[int]:
    """The owners (sorted) of whose shard of `iteration` fewer than `placement.replicas` of its
    holders hold a verified copy, as `holdings` (rank -> what it reported: "{owner}" ->
    verified iterations) says; a rank that did not report holds nothing."""
    return [
        owner
        for owner, holders in enumerate(placement.holders)
        if sum(iteration in holdings.get(h, {}).get(str(owner), ()) for h in holders)
        < placement.replicas
    ]
