"""Which simultaneous node failures a replica placement survives, without losing any shard.

Pure functions over a `Placement`. A set D of dead nodes loses state exactly when some owner
r on a node in D has every holder on a node in D (`Placement.lost_owners`). Since no holder
shares its owner's node, that happens iff {node(r)} and r's holder nodes all lie in D. So:

- D is fatal iff D contains, for some owner r, the set S(r) = {node(r)} u holder_nodes(r);
- any f nodes are survivable iff f < min_r |S(r)| (`guaranteed_node_failures`);
- a pair {A, B} is fatal iff some owner on A has all its holders on B (or the other way
  round), i.e. |S(r)| = 2 and S(r) = {A, B} (`fatal_node_pairs`): O(ranks x k) instead of
  trying all O(nodes^2) pairs, which `fatal_node_pairs_brute_force` does for checking.

Whether enough spares are left to replace the dead ranks is a separate question, answered by
the planner.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..replication.placement import Placement

BRUTE_FORCE_MAX_NODES = 64
"""Layouts up to this many nodes are checked pair by pair; larger ones use the rule."""


@dataclass(frozen=True, kw_only=True)
class NodeCoverage:
    """What node failures a placement survives with all optimizer state intact."""

    nodes: int
    """Failure domains (nodes) of the active ranks."""

    single_node: bool
    """Losing any one node keeps every shard in some survivor's memory."""

    node_pairs: int
    """Distinct pairs of nodes."""

    fatal_pairs: tuple[tuple[int, int], ...]
    """Node pairs whose simultaneous loss destroys some shard (sorted)."""

    guaranteed_node_failures: int
    """Any this many simultaneous node failures keep all state."""

    method: str
    """How the pairs were checked: 'brute force' or 'rule'."""

    @property
    def any_two_nodes(self) -> bool:
        """Losing any two nodes at once keeps every shard."""
        return not self.fatal_pairs


def state_nodes(placement: Placement) -> list[frozenset[int]]:
    """S(r) for every owner r: its own node and its holders' nodes."""
    layout = placement.layout
    return [
        frozenset({layout.domain(r), *(layout.domain(h) for h in holders)})
        for r, holders in enumerate(placement.holders)
    ]


def guaranteed_node_failures(placement: Placement) -> int:
    """The largest f such that every set of f dead nodes keeps all state."""
    return min(len(s) for s in state_nodes(placement)) - 1


def fatal_node_pairs(placement: Placement) -> set[tuple[int, int]]:
    """Node pairs whose loss destroys a shard, by the rule |S(r)| = 2."""
    return {tuple(sorted(s)) for s in state_nodes(placement) if len(s) == 2}  # type: ignore


def fatal_node_pairs_brute_force(placement: Placement) -> set[tuple[int, int]]:
    """Node pairs whose loss destroys a shard, by asking `lost_owners` for every pair."""
    layout = placement.layout
    nodes = layout.world_size // layout.ranks_per_node
    return {
        (a, b)
        for a, b in itertools.combinations(range(nodes), 2)
        if placement.lost_owners(layout.domain_ranks(a) + layout.domain_ranks(b))
    }


def node_coverage(
    placement: Placement, *, brute_force_max_nodes: int = BRUTE_FORCE_MAX_NODES
) -> NodeCoverage:
    """Single-node and node-pair coverage of `placement` (brute force for small layouts)."""
    layout = placement.layout
    nodes = layout.world_size // layout.ranks_per_node
    single = all(placement.survivable(layout.domain_ranks(n)) for n in range(nodes))
    if nodes <= brute_force_max_nodes:
        fatal, method = fatal_node_pairs_brute_force(placement), "brute force"
    else:
        fatal, method = fatal_node_pairs(placement), "rule"
    return NodeCoverage(
        nodes=nodes,
        single_node=single,
        node_pairs=nodes * (nodes - 1) // 2,
        fatal_pairs=tuple(sorted(fatal)),
        guaranteed_node_failures=min(guaranteed_node_failures(placement), nodes),
        method=method,
    )
