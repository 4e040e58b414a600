"""Pure planning of a recovery and of an out-of-redundancy save (`restore_plan.py`).

TP2 x DP2 on two nodes of two ranks: the replica of rank r lives on its data-parallel peer on
the other node (holders 0->2, 1->3, 2->0, 3->1).
"""

from __future__ import annotations

import pytest

from megatron_deadpool.hotswap.coordinator.restore_plan import plan_restore, plan_salvage
from megatron_deadpool.replication.placement import Layout, place_replicas


@pytest.fixture(scope="module")
def placement():
    p = place_replicas(Layout(tp=2, pp=1, dp=2, ranks_per_node=2), 1)
    assert p.holders == ((2,), (3,), (0,), (1,))
    return p


def _holds(local: list[int], **held: list[int]) -> dict[str, list[int]]:
    return {"local": local, **{k.lstrip("r"): v for k, v in held.items()}}


def _rank_2_dead_after_round_3() -> dict[int, dict[str, list[int]]]:
    """The survivors' holdings when rank 2 died after its round 3 reached every holder."""
    return {
        0: _holds([2, 3], r2=[2, 3]),
        1: _holds([2, 3], r3=[2, 3]),
        3: _holds([2, 3], r1=[2, 3]),
    }


def test_restore_takes_the_newest_iteration_every_party_has(placement) -> None:
    holdings = _rank_2_dead_after_round_3()
    plan = plan_restore(placement, holdings, needy={2})
    assert plan.ok and plan.iteration == 3 and plan.sources == {2: 0}
    holdings[0] = _holds([2, 3], r2=[2])  # rank 2's round 3 never reached its holder
    assert plan_restore(placement, holdings, needy={2}).iteration == 2


def test_salvage_of_a_recoverable_plan_is_a_complete_set(placement) -> None:
    """No spare left, but every shard survives: a complete set of the restore iteration."""
    holdings = _rank_2_dead_after_round_3()
    restore = plan_restore(placement, holdings, needy={2})
    save = plan_salvage(placement, holdings, {2}, restore)
    assert save is not None and save.iteration == 3 and save.complete
    assert save.sources == {2: 0} and save.missing({2}) == []


def test_salvage_names_the_shards_no_survivor_holds(placement) -> None:
    """Node 0 (ranks 0 and 1) died: rank 0's shard survives on rank 2, rank 1's on rank 3;
    with rank 3 also dead, rank 1's shard and rank 3's own are gone."""
    holdings = {2: _holds([4, 5], r0=[4, 5])}
    needy = {0, 1, 3}
    restore = plan_restore(placement, holdings, needy)
    assert not restore.ok and restore.lost_ranks == [1, 3]
    save = plan_salvage(placement, holdings, needy, restore)
    assert save is not None and save.iteration == 5 and not save.complete
    assert save.sources == {0: 2} and save.missing(needy) == [1, 3]


def test_an_incomplete_salvage_keeps_the_survivors_newest_iteration(placement) -> None:
    """Ranks 1 and 3 (each other's holders) and rank 2 died; rank 2's copy on rank 0 is one
    round older than rank 0's own snapshot. The set cannot be complete, so it keeps the
    survivors' newest state and names every shard it lacks."""
    holdings = {0: _holds([4, 5], r2=[4])}
    needy = {1, 2, 3}
    restore = plan_restore(placement, holdings, needy)
    assert not restore.ok and restore.lost_ranks == [1, 3]
    save = plan_salvage(placement, holdings, needy, restore)
    assert save is not None and save.iteration == 5 and save.sources == {}
    assert not save.complete and save.missing(needy) == [1, 2, 3]


def test_no_salvage_without_a_common_iteration(placement) -> None:
    holdings = {0: _holds([4]), 1: _holds([5]), 3: _holds([])}
    assert plan_salvage(placement, holdings, {2}) is None


def test_a_rank_and_its_holder_respawned_in_place_restore_from_their_segments(placement) -> None:
    """Ranks 0 and 2 (each the other's holder) die together; each node's agent respawns its
    process, which reports what its predecessor's segment files hold: no shard is lost, and
    neither needs a transfer. Without those reports the shards of 0 and 2 are gone."""
    holdings = {
        1: _holds([2, 3], r3=[2, 3]),
        3: _holds([2, 3], r1=[2, 3]),
    }
    lost = plan_restore(placement, holdings, needy={0, 2})
    assert not lost.ok and lost.lost_ranks == [0, 2]
    holdings[0] = _holds([2, 3], r2=[2, 3])
    holdings[2] = _holds([2, 3], r0=[2, 3])
    plan = plan_restore(placement, holdings, needy={0, 2}, respawned={0, 2})
    assert plan.ok and plan.iteration == 3 and plan.sources == {}


def test_a_respawned_rank_without_its_own_copy_takes_the_holders(placement) -> None:
    """Its predecessor died before its own snapshot of T was complete (or kept replicas in
    GPU memory): the holder's copy restores it; what the respawned process holds for others
    still counts."""
    holdings = _rank_2_dead_after_round_3()
    holdings[2] = _holds([2], r0=[2, 3])  # its own round 3 was being written when it died
    plan = plan_restore(placement, holdings, needy={2}, respawned={2})
    assert plan.ok and plan.iteration == 3 and plan.sources == {2: 0}
    # Rank 0 dies too and takes a spare (needy, no segments): its shard comes from rank 2's
    # segments, the respawned process; rank 2's own copy of 3 is not there, so both go to 2.
    del holdings[0]
    plan = plan_restore(placement, holdings, needy={0, 2}, respawned={2})
    assert plan.ok and plan.iteration == 2 and plan.sources == {0: 2}


def test_a_respawned_rank_that_restores_from_a_holder_is_no_source_of_another() -> None:
    """dp 3, two replicas each. Rank 1 respawned in place without its own snapshot of 3 (corrupt
    at rest) but with its copy of rank 0's; rank 0 died and takes a spare. At 3 rank 1 restores
    from a holder, and a rank that receives its shard sends nothing (`exchange_shards`): rank
    0's shard of 3 comes from rank 2, the other holder - not from rank 1, which would leave
    rank 0 waiting for a send nobody posts."""
    placement = place_replicas(Layout(tp=1, pp=1, dp=3, ranks_per_node=1), 2)
    assert placement.holders == ((1, 2), (2, 0), (0, 1))
    holdings = {
        1: _holds([2], r0=[2, 3], r2=[2, 3]),
        2: _holds([2, 3], r0=[2, 3], r1=[2, 3]),
    }
    plan = plan_restore(placement, holdings, needy={0, 1}, respawned={1})
    assert plan.ok and plan.iteration == 3 and plan.sources == {0: 2, 1: 2}
    # Where it has its own snapshot of 3, it restores itself and is rank 0's first holder.
    holdings[1] = _holds([2, 3], r0=[2, 3], r2=[2, 3])
    plan = plan_restore(placement, holdings, needy={0, 1}, respawned={1})
    assert plan.ok and plan.iteration == 3 and plan.sources == {0: 1}


def test_a_salvage_counts_only_what_survivors_write_not_a_respawned_process(placement) -> None:
    """Ranks 0 and 2 (each the other's holder) died, rank 2 respawned in place and its segment
    files hold its own snapshot and rank 0's copy: recoverable, had a spare been left for rank
    0. A respawned process never salvages (it waits for its slot), so the save cannot write
    either shard: it says so instead of calling the set complete."""
    holdings = {
        1: _holds([2, 3], r3=[2, 3]),
        3: _holds([2, 3], r1=[2, 3]),
        2: _holds([2, 3], r0=[2, 3]),
    }
    restore = plan_restore(placement, holdings, needy={0, 2}, respawned={2})
    assert restore.ok and restore.iteration == 3 and restore.sources == {0: 2}
    save = plan_salvage(placement, holdings, {0, 2}, restore)
    assert save is not None and save.iteration == 3 and save.sources == {}
    assert not save.complete and save.missing({0, 2}) == [0, 2]
