"""Replica placement: never in the owner's failure domain, balanced, among data-parallel peers.

Under both of Megatron's rank orders (`RankOrder`: the default tp-dp-pp and
`--use-tp-pp-dp-mapping`'s tp-pp-dp), with the groups checked against Megatron's own
`RankGenerator` and the coordinates of the closed-form layout of each order.
Small layouts are checked exhaustively against an independent oracle: a placement with every
rank holding exactly k replicas exists iff a max-flow (owners -> allowed holders -> sink,
capacities k, 1, k) saturates; `place_replicas` must succeed exactly then and raise a
`PlacementError` saying what to change otherwise. Loss of state after a failure is checked by
brute force over every small set of dead ranks.
"""

from __future__ import annotations

import itertools
from collections import deque

import pytest
from megatron.core.parallel_state import RankGenerator

from megatron_deadpool.errors import ConfigError, PlacementError
from megatron_deadpool.replication.placement import Layout, Placement, RankOrder, place_replicas

ORDERS = pytest.mark.parametrize("order", list(RankOrder), ids=lambda o: o.short)


def _coords(rank: int, layout: Layout) -> tuple[int, int, int]:
    """(tp, dp, pp) index of `rank`, written out for each order (cp=ep=1): tp-cp-ep-dp-pp
    numbers ranks tp fastest, then dp, then pp; tp-cp-ep-pp-dp tp, then pp, then dp."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    if layout.order is RankOrder.TP_DP_PP:
        return rank % tp, (rank // tp) % dp, rank // (tp * dp)
    return rank % tp, rank // (tp * pp), (rank // tp) % pp


def _max_flow_feasible(group: list[int], domain: dict[int, int], k: int) -> bool:
    """Oracle: can every rank of `group` give k replicas and hold k, never in its domain?"""
    n = len(group)
    src, sink = 2 * n, 2 * n + 1
    cap: dict[tuple[int, int], int] = {}
    adj: dict[int, set[int]] = {v: set() for v in range(2 * n + 2)}

    def edge(u: int, v: int, c: int) -> None:
        cap[(u, v)] = cap.get((u, v), 0) + c
        cap.setdefault((v, u), 0)
        adj[u].add(v)
        adj[v].add(u)

    for i in range(n):
        edge(src, i, k)
        edge(n + i, sink, k)
        for j in range(n):
            if domain[group[i]] != domain[group[j]]:
                edge(i, n + j, 1)
    flow = 0
    while True:
        parent = {src: src}
        queue = deque([src])
        while queue and sink not in parent:
            u = queue.popleft()
            for v in adj[u]:
                if v not in parent and cap[(u, v)] > 0:
                    parent[v] = u
                    queue.append(v)
        if sink not in parent:
            return flow == n * k
        v = sink
        while v != src:
            u = parent[v]
            cap[(u, v)] -= 1
            cap[(v, u)] += 1
            v = u
        flow += 1


def _small_cases() -> list[tuple[int, int, int, int, int]]:
    cases = []
    for tp, pp, dp in itertools.product((1, 2, 4), (1, 2, 3), (1, 2, 3, 4, 6)):
        world = tp * pp * dp
        for rpn in (d for d in range(1, world + 1) if world % d == 0):
            for k in (1, 2, 3):
                cases.append((tp, pp, dp, rpn, k))
    return cases


def _check_placement(placement: Placement, k: int, groups: list[list[int]] | None = None) -> None:
    """Every rank gives and holds k replicas, each on another node, held by a data-parallel
    peer (the closed-form coordinates) or, given `groups` (Megatron's), by a rank of the
    owner's group."""
    layout = placement.layout
    world = layout.world_size
    assert len(placement.holders) == world
    group_of = {r: g for g in groups or [] for r in g}
    for owner, holders in enumerate(placement.holders):
        assert len(holders) == k and len(set(holders)) == k, (owner, holders)
        for h in holders:
            if groups is None:
                o_tp, o_dp, o_pp = _coords(owner, layout)
                h_tp, h_dp, h_pp = _coords(h, layout)
                assert (h_tp, h_pp) == (o_tp, o_pp) and h_dp != o_dp, (owner, h)
            else:
                assert h in group_of[owner] and h != owner, (owner, h)
            assert layout.domain(h) != layout.domain(owner), (owner, h)
    held = placement.held_by
    assert all(len(x) == k for x in held), "every rank must hold exactly k replicas"
    assert sorted(o for x in held for o in x) == sorted(list(range(world)) * k)


@pytest.mark.timeout(120)
@ORDERS
def test_small_layouts_exhaustively_against_a_max_flow_oracle(order: RankOrder) -> None:
    placed = refused = 0
    for tp, pp, dp, rpn, k in _small_cases():
        layout = Layout(tp=tp, pp=pp, dp=dp, ranks_per_node=rpn, order=order)
        domain = {r: r // rpn for r in range(layout.world_size)}
        feasible = dp >= 2 and all(_max_flow_feasible(g, domain, k) for g in layout.dp_groups)
        case = f"tp={tp} pp={pp} dp={dp} ranks_per_node={rpn} k={k} order={order}"
        if feasible:
            try:
                placement = place_replicas(layout, k)
            except PlacementError as exc:
                pytest.fail(f"{case}: a placement exists but place_replicas refused: {exc}")
            _check_placement(placement, k)
            placed += 1
        else:
            with pytest.raises(PlacementError) as info:
                place_replicas(layout, k)
            assert "lower" in str(info.value) or "dp >= 2" in str(info.value), case
            refused += 1
    assert placed > 100 and refused > 100  # the grid really covers both outcomes


@pytest.mark.timeout(60)
@ORDERS
@pytest.mark.parametrize(
    "tp,pp,dp", [(1, 1, 8), (2, 1, 4), (2, 2, 2), (1, 4, 2), (4, 2, 3), (2, 3, 2)]
)
def test_dp_groups_are_megatrons(tp: int, pp: int, dp: int, order: RankOrder) -> None:
    layout = Layout(tp=tp, pp=pp, dp=dp, ranks_per_node=tp, order=order)
    ours = sorted(sorted(g) for g in layout.dp_groups)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order.value)
    assert ours == sorted(sorted(g) for g in gen.get_ranks("dp"))
    # ... and equal to the groups of the closed-form rank layout.
    by_position: dict[tuple[int, int], list[int]] = {}
    for r in range(layout.world_size):
        t, _, p = _coords(r, layout)
        by_position.setdefault((t, p), []).append(r)
    assert ours == sorted(by_position.values())


@pytest.mark.timeout(60)
@ORDERS
def test_rank_groups_are_megatrons_for_every_token_in_order(order: RankOrder) -> None:
    """`Layout.groups` computes what Megatron's `RankGenerator` does, order included, for
    every combination of dimensions (the coordinator and the planner never import Megatron)."""
    tokens = ["tp", "pp", "dp", "cp", "tp-pp", "tp-dp", "dp-pp", "tp-dp-pp", "tp-cp", "dp-cp"]
    for tp, cp, pp, dp in itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 3], [1, 2, 3, 5]):
        layout = Layout(tp=tp, pp=pp, dp=dp, ranks_per_node=1, order=order, cp=cp)
        gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order.value)
        for token in tokens:
            assert layout.groups(token) == gen.get_ranks(token), (tp, cp, pp, dp, token)
        assert layout.dp_cp_groups == gen.get_ranks("dp-cp"), (tp, cp, pp, dp)


@pytest.mark.timeout(120)
@ORDERS
def test_context_parallel_layouts_are_placed_among_the_data_and_context_parallel_peers(
    order: RankOrder,
) -> None:
    """With context parallelism the distributed optimizer is sharded over Megatron's 'dp-cp'
    group (cp x dp ranks of one tensor- and pipeline-parallel position, holding the same
    weights): replicas are placed there, checked against the max-flow oracle over those
    groups for every small layout."""
    placed = refused = 0
    for tp, cp, pp, dp, rpn, k in itertools.product(
        [1, 2], [2, 3], [1, 2], [1, 2, 3], [1, 2, 4], [1, 2]
    ):
        if (tp * cp * pp * dp) % rpn:
            continue
        layout = Layout(tp=tp, pp=pp, dp=dp, ranks_per_node=rpn, order=order, cp=cp)
        assert layout.world_size == tp * cp * pp * dp
        assert layout.peer_groups == layout.dp_cp_groups != layout.dp_groups
        domain = {r: r // rpn for r in range(layout.world_size)}
        if all(_max_flow_feasible(g, domain, k) for g in layout.dp_cp_groups):
            placement = place_replicas(layout, k)
            _check_placement(placement, k, layout.dp_cp_groups)
            placed += 1
        else:
            with pytest.raises(PlacementError, match="lower"):
                place_replicas(layout, k)
            refused += 1
    assert placed > 20 and refused > 20


@pytest.mark.timeout(60)
def test_a_context_parallel_peer_holds_the_replica_when_data_parallel_size_is_one() -> None:
    """CP 2 x DP 1, a rank per node: no data-parallel peer exists, but the two
    context-parallel ranks hold the same weights and different optimizer shards, so each holds
    the other's (refused before context parallelism was placed)."""
    layout = Layout(tp=1, pp=1, dp=1, ranks_per_node=1, cp=2)
    placement = place_replicas(layout, 1)
    assert placement.holders == ((1,), (0,))
    assert placement.describe() == (
        "tp 1 x cp 2 x pp 1 x dp 1 in rank order tp-dp-pp, 1 rank(s) per node; owner->holders "
        "(data- and context-parallel peers under tp-dp-pp on other nodes): 0->[1], 1->[0]"
    )
    # TP 1 x CP 2 x DP 2 on nodes of 2: a node holds one context-parallel pair.
    paired = Layout(tp=1, pp=1, dp=2, ranks_per_node=2, cp=2)
    assert paired.groups("cp") == [[0, 1], [2, 3]] and paired.dp_groups == [[0, 2], [1, 3]]
    assert place_replicas(paired, 1).holders == ((2,), (3,), (0,), (1,))
    with pytest.raises(PlacementError) as info:
        place_replicas(Layout(tp=1, pp=1, dp=2, ranks_per_node=4, cp=2), 1)
    text = str(info.value)
    assert "the data- and context-parallel group [0, 1, 2, 3]" in text
    assert "tp*cp*dp=4" in text


@pytest.mark.timeout(60)
def test_the_order_decides_which_ranks_share_a_node_with_their_data_parallel_peers() -> None:
    """TP1 x PP2 x DP2 on nodes of 2 ranks: under tp-dp-pp a node is a data-parallel group
    (refused, naming the order and the way out); under tp-pp-dp a node is a pipeline, and
    each rank's replica goes to its data-parallel peer on the other node."""
    default = Layout(tp=1, pp=2, dp=2, ranks_per_node=2)
    assert default.order is RankOrder.TP_DP_PP and default.dp_groups == [[0, 1], [2, 3]]
    with pytest.raises(PlacementError) as info:
        place_replicas(default, 1)
    text = str(info.value)
    assert "rank 0 and its data-parallel peers under tp-dp-pp" in text
    assert "tp*dp=2" in text and "--use-tp-pp-dp-mapping" in text
    mapped = Layout(tp=1, pp=2, dp=2, ranks_per_node=2, order=RankOrder.TP_PP_DP)
    assert mapped.dp_groups == [[0, 2], [1, 3]] and mapped.groups("pp") == [[0, 1], [2, 3]]
    placement = place_replicas(mapped, 1)
    assert placement.holders == ((2,), (3,), (0,), (1,))
    _check_placement(placement, 1)
    assert placement.describe() == (
        "tp 1 x pp 2 x dp 2 in rank order tp-pp-dp, 2 rank(s) per node; owner->holders "
        "(data-parallel peers under tp-pp-dp on other nodes): 0->[2], 1->[3], 2->[0], 3->[1]"
    )
    # TP2 x PP2 x DP2 on nodes of 2: both orders place, each on its own data-parallel peers.
    holders = {
        order: place_replicas(Layout(tp=2, pp=2, dp=2, ranks_per_node=2, order=order), 1).holders
        for order in RankOrder
    }
    assert holders[RankOrder.TP_DP_PP] == ((2,), (3,), (0,), (1,), (6,), (7,), (4,), (5,))
    assert holders[RankOrder.TP_PP_DP] == ((4,), (5,), (6,), (7,), (0,), (1,), (2,), (3,))


@pytest.mark.timeout(60)
def test_placement_errors_name_the_rank_order_in_use() -> None:
    """Every refusal names the data-parallel peers and the order they are peers under."""
    mapped = RankOrder.TP_PP_DP
    with pytest.raises(PlacementError) as info:
        place_replicas(Layout(tp=2, pp=2, dp=2, ranks_per_node=8, order=mapped), 1)
    text = str(info.value)
    assert (
        "the data-parallel group [0, 4] (rank 0 and its data-parallel peers under tp-pp-dp)" in text
    )
    assert "tp*pp*dp=8" in text and "--use-tp-pp-dp-mapping" not in text
    with pytest.raises(PlacementError, match=r"\[0, 1, 2, 3\] \(rank 0 and its data-parallel peers "
                       r"under tp-pp-dp\) spans 2 failure domains"):  # fmt: skip
        place_replicas(Layout(tp=1, pp=1, dp=4, ranks_per_node=2, order=mapped), 3)
    with pytest.raises(TypeError, match="RankOrder"):
        Layout(tp=1, pp=1, dp=2, ranks_per_node=1, order="tp-pp-dp")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_dp_of_one_is_refused_with_the_fix() -> None:
    with pytest.raises(PlacementError, match=r"data-parallel size is 1.*dp >= 2"):
        place_replicas(Layout(tp=2, pp=2, dp=1, ranks_per_node=2), 1)


@pytest.mark.timeout(60)
def test_dp_group_inside_one_node_is_refused_with_the_fix() -> None:
    with pytest.raises(PlacementError, match=r"entirely in failure domain 0.*lower ranks-per-node"):
        place_replicas(Layout(tp=2, pp=1, dp=2, ranks_per_node=4), 1)


@pytest.mark.timeout(60)
def test_too_many_replicas_is_refused_with_the_fix() -> None:
    with pytest.raises(PlacementError, match=r"cannot place 2 replicas.*lower deadpool-replicas"):
        place_replicas(Layout(tp=2, pp=1, dp=2, ranks_per_node=2), 2)
    with pytest.raises(PlacementError, match="deadpool-replicas"):
        place_replicas(Layout(tp=1, pp=1, dp=4, ranks_per_node=1), 0)


@pytest.mark.timeout(60)
def test_placement_errors_are_config_errors_and_value_errors() -> None:
    assert issubclass(PlacementError, ConfigError) and issubclass(PlacementError, ValueError)
    with pytest.raises(PlacementError, match=r"ranks-per-node \(4\) must divide"):
        Layout(tp=2, pp=1, dp=3, ranks_per_node=4)


@pytest.mark.timeout(120)
def test_16k_ranks_are_placed_correctly() -> None:
    """tp=8 pp=4 dp=512 (16,384 ranks), 4 per node, k=2. Its time (target: under a second) is
    measured by `deadpool bench planning`, not here."""
    placement = place_replicas(Layout(tp=8, pp=4, dp=512, ranks_per_node=4), 2)
    assert placement.layout.world_size == 16384
    held = placement.held_by
    assert all(len(x) == 2 for x in held)
    for owner, holders in enumerate(placement.holders):
        assert len(set(holders)) == 2
        assert all(h // 4 != owner // 4 and h % 8 == owner % 8 for h in holders)
        assert all(h // (8 * 512) == owner // (8 * 512) for h in holders)  # same pp stage


@pytest.mark.timeout(120)
def test_16k_pure_data_parallel_ranks_are_placed() -> None:
    """dp=16,384, one rank per node, k=2 (time: `deadpool bench planning`)."""
    placement = place_replicas(Layout(tp=1, pp=1, dp=16384, ranks_per_node=1), 2)
    assert placement.layout.world_size == 16384
    assert all(len(x) == 2 for x in placement.held_by)
    for owner, holders in enumerate(placement.holders):
        assert len(set(holders)) == 2 and owner not in holders  # one rank per node: elsewhere


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "tp,pp,dp,rpn,k",
    [
        (1, 1, 4, 1, 1),
        (1, 1, 4, 1, 2),
        (2, 1, 3, 2, 2),
        (1, 2, 4, 2, 1),
        (2, 2, 3, 2, 1),
        (1, 1, 6, 2, 3),
    ],
)
def test_lost_owners_and_survivable_by_brute_force(
    tp: int, pp: int, dp: int, rpn: int, k: int
) -> None:
    placement = place_replicas(Layout(tp=tp, pp=pp, dp=dp, ranks_per_node=rpn), k)
    world = placement.layout.world_size
    for size in range(min(world, 4) + 1):
        for dead in itertools.combinations(range(world), size):
            alive = set(range(world)) - set(dead)
            # What survives in memory: each living rank's own shard and the replicas it holds.
            in_memory = set(alive) | {o for s in alive for o in placement.held_by[s]}
            expected = sorted(set(dead) - in_memory)
            assert placement.lost_owners(dead) == expected, dead
            assert placement.survivable(dead) == (not expected), dead
    # Losing any one whole node is always survivable: no replica shares its owner's node.
    for node in range(world // rpn):
        assert placement.survivable(placement.layout.domain_ranks(node))
    # Losing every rank of a DP group loses all of it.
    group = placement.layout.dp_groups[0]
    assert placement.lost_owners(group) == sorted(group)
