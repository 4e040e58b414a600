"""Placement with expert parallelism (replication/placement.py): Megatron's expert rank layout,
the groups of ranks holding the same weights, and replicas of the expert optimizer's shard
placed on a rank that holds the same experts on another node.

Megatron builds the expert layers' groups with a second `RankGenerator` (expert tp x ep x
expert dp x pp, context size 1, in the same order: context parallelism folds into expert data
parallelism); `Layout.expert_groups` must name the same groups without importing Megatron, and
`Layout.peer_groups` - dense data-parallel peers (with context parallelism: 'dp-cp' peers)
that are expert data-parallel peers too - are where a rank's dense *and* expert shards may go.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from megatron.core.parallel_state import RankGenerator

from megatron_deadpool.digest import final_digest
from megatron_deadpool.errors import PlacementError
from megatron_deadpool.hotswap.protocol.messages import LayoutRecord
from megatron_deadpool.replication.placement import Layout, RankOrder, place_replicas

ORDERS = pytest.mark.parametrize("order", list(RankOrder))


def _expert_layouts(order: RankOrder) -> list[Layout]:
    """Every small layout Megatron accepts: expert tp x ep x pp divides the world, and (its
    assertion) a rank order that does not end in pp has pp 1 or equal dense and expert dp."""
    out = []
    sizes = itertools.product([1, 2], [1, 2], [1, 2], [1, 2, 4], [1, 2, 4], [1, 2])
    for tp, cp, pp, dp, ep, etp in sizes:
        world = tp * cp * pp * dp
        if world % (etp * ep * pp):
            continue
        layout = Layout(tp, pp, dp, 1, order, ep=ep, etp=etp, cp=cp)
        if order is RankOrder.TP_PP_DP and pp > 1 and layout.expert_dp != dp:
            continue
        out.append(layout)
    return out


@pytest.mark.timeout(60)
@ORDERS
def test_expert_groups_are_megatrons_expert_rank_generators(order: RankOrder) -> None:
    for layout in _expert_layouts(order):
        gen = RankGenerator(
            tp=layout.expert_tp,
            ep=layout.ep,
            dp=layout.expert_dp,
            pp=layout.pp,
            cp=1,
            order=order.value,
        )
        for token in ("ep", "dp", "tp", "tp-ep", "tp-ep-pp", "pp"):
            assert layout.expert_groups(token) == gen.get_ranks(token), (layout, token)


@pytest.mark.timeout(60)
@ORDERS
def test_peer_groups_are_the_ranks_that_share_both_data_parallel_groups(order: RankOrder) -> None:
    for layout in _expert_layouts(order):
        dense = {r: set(g) for g in layout.dp_cp_groups for r in g}
        expert = {r: set(g) for g in layout.expert_groups("dp") for r in g}
        groups = layout.peer_groups
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
        for g in groups:
            assert set(g) == dense[g[0]] & expert[g[0]], (layout, g)
        if not layout.has_experts:
            assert groups == layout.dp_cp_groups


@pytest.mark.timeout(60)
def test_replicas_go_to_a_rank_holding_the_same_experts_on_another_node() -> None:
    """TP1 x DP4 with EP2, one rank per node: experts [0, 2] on ranks 0 and 2, [1, 3] on 1 and
    3. A dense placement's ring would put rank 0's replica on rank 1, which holds the other
    experts; here it goes to rank 2 (and the expert data-parallel group spans nodes)."""
    layout = Layout(1, 1, 4, 1, ep=2)
    assert layout.peer_groups == [[0, 2], [1, 3]]
    assert place_replicas(Layout(1, 1, 4, 1), 1).holders == ((1,), (2,), (3,), (0,))
    placement = place_replicas(layout, 1)
    assert placement.holders == ((2,), (3,), (0,), (1,))
    assert "(experts: etp 1 x ep 2 x expert dp 2)" in placement.describe()
    assert "data-parallel peers of dense and expert layers" in placement.describe()


@pytest.mark.timeout(60)
def test_placement_with_experts_keeps_every_rank_within_its_peer_group_on_other_nodes() -> None:
    placed = 0
    for order in RankOrder:
        for layout in _expert_layouts(order):
            for per_node in (1, 2, 4):
                if layout.world_size % per_node:
                    continue
                lay = dataclasses.replace(layout, ranks_per_node=per_node)
                try:
                    placement = place_replicas(lay, 1)
                except PlacementError:
                    continue
                placed += int(lay.has_experts)
                for owner, holders in enumerate(placement.holders):
                    for h in holders:
                        assert h in lay.peer_group_of[owner] and lay.domain(h) != lay.domain(owner)
    assert placed >= 10


@pytest.mark.timeout(60)
def test_an_expert_data_parallel_size_of_one_is_refused_with_the_fix() -> None:
    with pytest.raises(PlacementError, match=r"expert data-parallel size 1\).*lower "
                       r"--expert-model-parallel-size"):  # fmt: skip
        place_replicas(Layout(1, 1, 4, 2, ep=4), 1)


@pytest.mark.timeout(60)
def test_expert_peers_inside_one_node_are_refused_with_the_fix() -> None:
    with pytest.raises(PlacementError, match=r"the peer group \[0, 2\] .* lies entirely in "
                       r"failure domain 0; .*same experts"):  # fmt: skip
        place_replicas(Layout(1, 1, 4, 4, ep=2), 1)


@pytest.mark.timeout(60)
def test_expert_sizes_must_divide_the_world() -> None:
    with pytest.raises(PlacementError, match="must divide the world size"):
        Layout(1, 1, 6, 1, ep=4)


@pytest.mark.timeout(60)
def test_the_layout_record_carries_the_expert_sizes_and_reads_an_older_record() -> None:
    for layout in (Layout(2, 1, 4, 2, ep=2, etp=1), Layout(1, 1, 2, 2, ep=2, cp=2)):
        record = LayoutRecord.of(layout, 1)
        assert LayoutRecord.decode("job/layout", record.encode()).layout() == layout
    old = '{"tp": 2, "pp": 1, "dp": 2, "ranks_per_node": 2, "replicas": 1}'
    assert LayoutRecord.decode("job/layout", old).layout() == Layout(2, 1, 2, 2)


@pytest.mark.timeout(60)
def test_digests_are_compared_only_among_ranks_holding_the_same_experts() -> None:
    """EP2 over DP4: ranks 0 and 1 are data-parallel peers of the dense part but hold
    different experts, so their digests differ; the job's weights agree."""
    layout = Layout(1, 1, 4, 2, ep=2)
    digests = {0: "a", 1: "b", 2: "a", 3: "b"}
    digest, identical = final_digest(layout.peer_groups, digests)
    assert identical and digest is not None
    assert final_digest(layout.dp_groups, digests)[1] is False
    assert final_digest(layout.peer_groups, {**digests, 2: "c"})[1] is False
