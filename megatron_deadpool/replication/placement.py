"""Pure planning over rank lists: Megatron's rank layout, failure domains, replica placement.

Nothing here communicates, and nothing imports torch or Megatron. The layout is
Megatron-Core's own: its `RankGenerator`'s rank order (`RankOrder`: the default tp-cp-ep-dp-pp,
or tp-cp-ep-pp-dp under Megatron-LM's `--use-tp-pp-dp-mapping`), computed by `rank_groups`, so
a rank's data-parallel peers here are exactly the ranks `parallel_state` puts in its
data-parallel group. A replica of rank r's optimizer shard is held by a peer with the same
(tp, pp) position - a data-parallel peer, which owns the same parameters' shards' neighbours
and so has the same shapes - in another failure domain. Failure domains are consecutive ranks
whatever the order; the order decides which ranks are data-parallel peers, so it decides
whether they span nodes (TP1 x PP2 x DP2 on nodes of 2: under tp-dp-pp a node holds a
data-parallel group, under tp-pp-dp a pipeline, and the peers are on the other node).

Placement is a set of k permutations of each data-parallel group, so every rank holds exactly
k replicas (balanced) and no owner-holder pair shares a failure domain. Rings with a fixed
shift are tried first (O(n) each); layouts where no shift works fall back to bipartite
matching. A layout that cannot be placed raises `PlacementError` saying what to change.

Mixture-of-experts with expert parallelism (`ep` > 1, and expert tensor parallelism `etp`):
Megatron lays the expert layers out with a second `RankGenerator` (expert tp x ep x expert dp x
pp in the same order, expert dp = world / (etp * ep * pp)) and builds a second distributed
optimizer over the expert data-parallel group (a `ChainedOptimizer`). A rank's snapshot holds
both shards, so one placement serves both if a holder is a data-parallel peer of the dense
part *and* of the expert part: the ranks that share both are `Layout.peer_groups` (the
intersection of the two data-parallel groups, i.e. the ranks that hold the same weights; with
expert tp = tp the expert data-parallel group itself). Replicas are placed within those; two
separate placements would need two holders (and twice the replica memory) for nothing.

Context parallelism (`cp` > 1): the ranks of a tensor- and pipeline-parallel position split
each sequence cp ways and hold the same weights; Megatron's distributed optimizer shards them
over the data-parallel group *with* context parallelism (its 'dp-cp' group, cp x dp ranks), so
each of those ranks owns a different shard. Replicas are placed within the 'dp-cp' groups
(`Layout.dp_cp_groups`): a context-parallel peer on another node is as good a holder as a
data-parallel one. The expert layout has no context dimension (Megatron's expert
`RankGenerator` folds it into expert data parallelism: expert dp = world / (etp * ep * pp)).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

from ..errors import PlacementError


class RankOrder(Enum):
    """Megatron's rank order: the `order` `initialize_model_parallel` builds its groups in, the
    fastest-varying dimension first (a rank is the mixed-radix number of its coordinates)."""

    TP_DP_PP = "tp-cp-ep-dp-pp"
    """Megatron's default: data-parallel peers tp ranks apart, pipeline stages tp*dp apart."""
    TP_PP_DP = "tp-cp-ep-pp-dp"
    """Megatron-LM's `--use-tp-pp-dp-mapping`: pipeline stages tp ranks apart, data-parallel
    peers tp*pp apart."""

    @property
    def dims(self) -> list[str]:
        """The dimensions, fastest first."""
        return self.value.split("-")

    @property
    def short(self) -> str:
        """The order of tp, pp and dp alone, as Megatron's documentation names it
        ("tp-dp-pp", "tp-pp-dp"): what messages say."""
        return "-".join(d for d in self.dims if d in ("tp", "pp", "dp"))

    def __str__(self) -> str:
        return self.short


@dataclass(frozen=True)
class Layout:
    """Megatron's rank layout for tp x cp x pp x dp in `order` (with `ep` x `etp` for the
    expert layers), and its failure domains."""

    tp: int
    pp: int
    dp: int
    ranks_per_node: int
    order: RankOrder = RankOrder.TP_DP_PP
    """The order Megatron numbers ranks in (`initialize_model_parallel(order=...)`)."""
    ep: int = 1
    """Expert-model-parallel size (MoE layers; 1 without expert parallelism)."""
    etp: int | None = None
    """Expert-tensor-parallel size; None: the same as `tp` (Megatron's default)."""
    cp: int = 1
    """Context-parallel size (1 without context parallelism)."""

    def __post_init__(self) -> None:
        if not isinstance(self.order, RankOrder):
            raise TypeError(f"order: expected a RankOrder, got {self.order!r}")
        if self.ep < 1 or (self.etp is not None and self.etp < 1) or self.cp < 1:
            raise PlacementError(f"sizes must be >= 1 (ep {self.ep}, etp {self.etp}, cp {self.cp})")
        expert_mp = self.expert_tp * self.ep * self.pp
        if self.world_size % expert_mp:
            raise PlacementError(
                f"expert-tensor x expert-model x pipeline parallel size ({self.expert_tp} x "
                f"{self.ep} x {self.pp}) must divide the world size {self._product} = "
                f"{self.world_size}"
            )
        if self.world_size % self.ranks_per_node:
            raise PlacementError(
                f"ranks-per-node ({self.ranks_per_node}) must divide the world size "
                f"{self._product} = {self.world_size}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def _product(self) -> str:
        return "tp*cp*pp*dp" if self.cp > 1 else "tp*pp*dp"

    def domain(self, rank: int) -> int:
        """The failure domain (node index) of `rank`."""
        return rank // self.ranks_per_node

    def domain_ranks(self, node: int) -> list[int]:
        """The ranks of failure domain `node`."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def groups(self, token: str) -> list[list[int]]:
        """Megatron's rank groups for `token` ('tp', 'pp', 'dp', 'cp', 'dp-cp', 'tp-pp', ...), as
        Megatron enumerates them (`parallel_state.RankGenerator(order=self.order.value).get_ranks`
        with expert size 1)."""
        return rank_groups(self.sizes, token.split("-"))

    @property
    def expert_tp(self) -> int:
        """The expert layers' tensor-parallel size."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """The expert layers' data-parallel size: world / (expert tp * ep * pp)."""
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    @property
    def has_experts(self) -> bool:
        """Whether the expert layers are laid out differently from the dense ones."""
        return self.ep > 1 or self.expert_tp != self.tp

    @property
    def expert_sizes(self) -> dict[str, int]:
        """Each dimension's size in Megatron's expert rank generator, fastest first."""
        size = {"tp": self.expert_tp, "cp": 1, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}
        return {d: size[d] for d in self.order.dims}

    def expert_groups(self, token: str) -> list[list[int]]:
        """Megatron's expert rank groups for `token` ('ep', 'dp' - the expert data-parallel
        groups -, 'tp' - expert tensor-parallel -, 'tp-ep', ...), as its expert
        `RankGenerator` (context size 1) enumerates them."""
        return rank_groups(self.expert_sizes, token.split("-"))

    @cached_property
    def dp_cp_groups(self) -> list[list[int]]:
        """The data-parallel groups with context parallelism (Megatron's 'dp-cp' groups): the
        ranks with the same tensor- and pipeline-parallel position, which hold the same dense
        weights and among which the distributed optimizer shards them. Without context
        parallelism, the data-parallel groups."""
        return self.groups("dp-cp") if self.cp > 1 else self.dp_groups

    @cached_property
    def peer_groups(self) -> list[list[int]]:
        """The groups of ranks holding the same weights: data-parallel peers (with context
        parallelism: the 'dp-cp' groups) in both the dense and the expert layout (each rank's
        dense group intersected with its expert data-parallel group, in dense order). Without
        experts laid out apart, `dp_cp_groups`. Replicas are placed, and digests compared,
        within these."""
        if not self.has_experts:
            return self.dp_cp_groups
        expert_of: dict[int, set[int]] = {}
        for g in self.expert_groups("dp"):
            members = set(g)  # one set per group, shared by its ranks: O(world), not O(world^2)
            expert_of.update(dict.fromkeys(g, members))
        out: list[list[int]] = []
        seen: set[int] = set()
        for group in self.dp_cp_groups:
            for r in group:
                if r not in seen:
                    peers = [q for q in group if q in expert_of[r]]
                    seen.update(peers)
                    out.append(peers)
        return out

    @cached_property
    def peer_group_of(self) -> dict[int, list[int]]:
        """Each rank's `peer_groups` entry."""
        return {r: g for g in self.peer_groups for r in g}

    @property
    def sizes(self) -> dict[str, int]:
        """Each parallel dimension's size, in the layout's order (fastest first)."""
        size = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        return {d: size[d] for d in self.order.dims}

    @property
    def dp_span(self) -> tuple[str, int]:
        """How many consecutive ranks a data-parallel group (with context parallelism: a
        'dp-cp' group) spans (as a product of sizes, and its value): tp*dp under tp-dp-pp,
        tp*pp*dp under tp-pp-dp (tp*cp*dp, tp*cp*pp*dp with context parallelism). With that
        many ranks per node or more, the group lies in one node."""
        dims = self.order.dims
        shown = ("tp", "cp", "pp", "dp") if self.cp > 1 else ("tp", "pp", "dp")
        names = [d for d in dims[: dims.index("dp") + 1] if d in shown]
        span = 1
        for d in names:
            span *= self.sizes[d]
        return "*".join(names), span

    def describe(self) -> str:
        """tp x pp x dp (and the expert layout), the order and the nodes, for messages."""
        experts = (
            f" (experts: etp {self.expert_tp} x ep {self.ep} x expert dp {self.expert_dp})"
            if self.has_experts
            else ""
        )
        context = f" x cp {self.cp}" if self.cp > 1 else ""
        return (
            f"tp {self.tp}{context} x pp {self.pp} x dp {self.dp}{experts} in rank order "
            f"{self.order}, {self.ranks_per_node} rank(s) per node"
        )

    @cached_property
    def dp_groups(self) -> list[list[int]]:
        return self.groups("dp")

    @cached_property
    def dp_group_of(self) -> dict[int, list[int]]:
        """Each rank's data-parallel group (ranks in dp-rank order)."""
        return {r: g for g in self.dp_groups for r in g}


def rank_groups(sizes: dict[str, int], varying: Sequence[str]) -> list[list[int]]:
    """The groups of ranks that differ only in the `varying` dimensions.

    `sizes` lists every dimension, fastest-varying first (a rank is the mixed-radix number of
    its coordinates). Groups are ordered by their fixed coordinates and the ranks in a group by
    their varying ones, the first dimension fastest in both - as Megatron enumerates them.
    """
    unknown = set(varying) - set(sizes)
    if unknown:
        raise ValueError(f"unknown parallel dimension(s) {sorted(unknown)}")
    stride, strides = 1, {}
    for name, size in sizes.items():
        strides[name] = stride
        stride *= size

    def offsets(names: list[str]) -> list[int]:
        out = [0]
        for name in names:  # the first name varies fastest
            out = [o + i * strides[name] for i in range(sizes[name]) for o in out]
        return out

    inside = offsets([d for d in sizes if d in varying])
    return [[base + o for o in inside] for base in offsets([d for d in sizes if d not in varying])]


@dataclass(frozen=True)
class Placement:
    """holders[r] = the k ranks holding rank r's replicas (in preference order)."""

    layout: Layout
    replicas: int
    holders: tuple[tuple[int, ...], ...]

    @cached_property
    def held_by(self) -> tuple[tuple[int, ...], ...]:
        """held_by[h] = the owners whose replicas rank h holds."""
        out: list[list[int]] = [[] for _ in range(self.layout.world_size)]
        for owner, hs in enumerate(self.holders):
            for h in hs:
                out[h].append(owner)
        return tuple(tuple(sorted(x)) for x in out)

    def lost_owners(self, dead: Iterable[int]) -> list[int]:
        """Dead owners none of whose holders survives: their shard is gone from memory."""
        dead_set = set(dead)
        return [r for r in sorted(dead_set) if all(h in dead_set for h in self.holders[r])]

    def survivable(self, dead: Iterable[int]) -> bool:
        """True when every dead rank's shard survives in some holder's memory."""
        return not self.lost_owners(dead)

    def describe(self, owners: int = 16) -> str:
        """The layout and which ranks hold each rank's replicas (the first `owners` owners),
        for the log."""
        lay = self.layout
        shown = ", ".join(f"{o}->{list(hs)}" for o, hs in enumerate(self.holders[:owners]))
        more = ", ..." if lay.world_size > owners else ""
        peers = "data- and context-parallel peers" if lay.cp > 1 else "data-parallel peers"
        if lay.has_experts:
            peers += " of dense and expert layers"
        return (
            f"{lay.describe()}; owner->holders ({peers} under {lay.order} on other nodes): "
            f"{shown}{more}"
        )


def place_replicas(layout: Layout, replicas: int) -> Placement:
    """Place `replicas` copies of every rank's shard; raise `PlacementError` when impossible."""
    if replicas < 1:
        raise PlacementError("deadpool-replicas: must be >= 1")
    if layout.dp * layout.cp == 1:
        raise PlacementError(
            "cannot place replicas: data-parallel size is 1, so no rank shares a (tp, pp) "
            "position with another; run with dp >= 2 (e.g. halve tp or pp)"
        )
    if len(layout.peer_groups[0]) == 1:
        raise PlacementError(
            f"cannot place replicas: with {layout.describe()} no rank holds the same experts "
            f"and dense shard position as another (expert data-parallel size "
            f"{layout.expert_dp}), so no holder could restore a rank's expert-optimizer "
            "shard; lower --expert-model-parallel-size or raise the number of ranks so that "
            "expert data-parallel size is >= 2"
        )
    holders: list[tuple[int, ...]] = [()] * layout.world_size
    for group in layout.peer_groups:
        for owner, hs in _place_group(group, layout, replicas).items():
            holders[owner] = hs
    return Placement(layout=layout, replicas=replicas, holders=tuple(holders))


def _place_group(group: Sequence[int], layout: Layout, k: int) -> dict[int, tuple[int, ...]]:
    n = len(group)
    domains = [layout.domain(r) for r in group]
    distinct = len(set(domains))
    named = _peers(group, layout)
    if distinct == 1 and layout.has_experts:
        raise PlacementError(
            f"cannot place replicas: {named} lies entirely in failure domain {domains[0]}; "
            "a rank's replica (its dense and its expert-optimizer shard) must be held on "
            "another node by a rank holding the same experts: lower ranks-per-node, raise dp or "
            "lower --expert-model-parallel-size so that expert data-parallel peers span nodes"
        )
    if distinct == 1:
        names, span = layout.dp_span
        other = (
            " (or Megatron-LM's --use-tp-pp-dp-mapping, under which a data-parallel group "
            f"spans tp*pp*dp={layout.world_size} ranks)"
            if layout.order is RankOrder.TP_DP_PP and layout.ranks_per_node < layout.world_size
            else ""
        )
        raise PlacementError(
            f"cannot place replicas: {named} lies entirely in failure domain {domains[0]} "
            f"(ranks-per-node={layout.ranks_per_node} >= {names}={span}, the ranks a "
            f"data-parallel group spans under {layout.order}); lower ranks-per-node or raise dp "
            f"so that data-parallel peers span nodes{other}"
        )
    # Each holder must be in another domain than its owner: an owner in a domain of size m
    # has n - m candidates, so k <= n - max_m is necessary.
    largest = max(Counter(domains).values())
    if k > n - largest:
        raise PlacementError(
            f"cannot place {k} replicas: {named} spans {distinct} failure domains with up to "
            f"{largest} of its {n} ranks in one, so at most {n - largest} replica(s) fit "
            "outside an owner's domain; lower deadpool-replicas to that or spread "
            "data-parallel peers over more nodes"
        )
    perms: list[list[int]] = []
    used: set[tuple[int, int]] = set()
    for shift in range(1, n):
        if len(perms) == k:
            break
        if all(domains[i] != domains[(i + shift) % n] for i in range(n)):
            perm = [(i + shift) % n for i in range(n)]
            perms.append(perm)
            used.update((i, perm[i]) for i in range(n))
    while len(perms) < k:
        matched = _matching(domains, used)
        if matched is None:
            raise PlacementError(
                f"cannot place {k} replicas among {named} with each rank holding exactly "
                f"{k}; lower deadpool-replicas to {len(perms)}"
            )
        perms.append(matched)
        used.update((i, matched[i]) for i in range(n))
    return {group[i]: tuple(group[p[i]] for p in perms) for i in range(n)}


def _matching(domains: list[int], used: set[tuple[int, int]]) -> list[int] | None:
    """A perfect matching owner->holder avoiding same-domain and already used pairs."""
    n = len(domains)
    match_of_holder: list[int] = [-1] * n

    def allowed(i: int, j: int) -> bool:
        return domains[i] != domains[j] and (i, j) not in used

    def augment(i: int, seen: list[bool]) -> bool:
        for j in range(n):
            if allowed(i, j) and not seen[j]:
                seen[j] = True
                if match_of_holder[j] < 0 or augment(match_of_holder[j], seen):
                    match_of_holder[j] = i
                    return True
        return False

    for i in range(n):
        if not augment(i, [False] * n):
            return None
    perm = [0] * n
    for j, i in enumerate(match_of_holder):
        perm[i] = j
    return perm


def _peers(group: Sequence[int], layout: Layout) -> str:
    """`group` in messages: "the data-parallel group [2, 3] (rank 2 and its data-parallel
    peers under tp-pp-dp)"; with experts "the peer group [0, 2] (rank 0 and its data-parallel
    peers in both the dense and the expert layers under tp-dp-pp)"."""
    if layout.has_experts:
        return (
            f"the peer group {_short(group)} (rank {group[0]} and its data-parallel peers in "
            f"both the dense and the expert layers under {layout.order})"
        )
    if layout.cp > 1:
        return (
            f"the data- and context-parallel group {_short(group)} (rank {group[0]} and its "
            f"data- and context-parallel peers under {layout.order})"
        )
    return (
        f"the data-parallel group {_short(group)} (rank {group[0]} and its data-parallel peers "
        f"under {layout.order})"
    )


def _short(ranks: Sequence[int]) -> str:
    text = ", ".join(map(str, ranks[:8]))
    return f"[{text}{', ...' if len(ranks) > 8 else ''}]"
