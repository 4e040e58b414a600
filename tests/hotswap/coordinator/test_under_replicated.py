"""Counting the shards short of replicas (`hotswap/coordinator/under_replicated.py`).

TP2 x DP2 on two nodes of two ranks, k=1: holders 0->2, 1->3, 2->0, 3->1 (as
`test_restore_plan.py`); with k=2 a DP4 group over four nodes.
"""

from __future__ import annotations

import time

from decisions_job import Job

from megatron_deadpool.hotswap.coordinator.events import EVENTS
from megatron_deadpool.hotswap.coordinator.under_replicated import (
    replicas_lost,
    short_of_replicas,
)
from megatron_deadpool.replication.placement import Layout, place_replicas

DEMO = place_replicas(Layout(tp=2, pp=1, dp=2, ranks_per_node=2), 1)


def test_a_dead_holder_takes_its_owners_copies_not_its_own_shard() -> None:
    assert DEMO.holders == ((2,), (3,), (0,), (1,))
    assert replicas_lost(DEMO, []) == []
    assert replicas_lost(DEMO, [2]) == [0]  # rank 2 held rank 0's copy; its own is on rank 0
    assert replicas_lost(DEMO, [2, 3]) == [0, 1]  # node 1


def test_short_at_the_restore_iteration_from_what_the_reporters_hold() -> None:
    full = {0: {"local": [3], "2": [2, 3]}, 1: {"local": [3], "3": [3]},
            2: {"local": [3], "0": [3]}, 3: {"local": [3], "1": [2, 3]}}  # fmt: skip
    assert short_of_replicas(DEMO, full, 3) == []
    assert short_of_replicas(DEMO, full, 2) == [0, 3]  # ranks 2 and 1 kept no round 2 copy
    # Rank 2 died: a spare in its slot reports nothing, so owner 0 has no copy.
    survivors = {r: h for r, h in full.items() if r != 2}
    assert short_of_replicas(DEMO, survivors, 3) == [0]
    # A process respawned in place reports its predecessor's copies: none short.
    assert short_of_replicas(DEMO, {**survivors, 2: {"local": [3], "0": [3]}}, 3) == []


def test_k_replicas_count_each_holder() -> None:
    p = place_replicas(Layout(tp=1, pp=1, dp=4, ranks_per_node=1), 2)
    held = {h: {str(o): [5] for o in p.held_by[h]} for h in range(4)}
    assert short_of_replicas(p, held, 5) == []
    one_down = {h: v for h, v in held.items() if h != 1}
    assert short_of_replicas(p, one_down, 5) == replicas_lost(p, [1])
    assert len(replicas_lost(p, [1])) == 2  # rank 1 holds two owners' copies


def test_counting_a_large_job_is_quick() -> None:
    """16,384 ranks (tp 8, dp 2,048, 8 per node), every copy reported but one node's."""
    p = place_replicas(Layout(tp=8, pp=1, dp=2048, ranks_per_node=8), 1)
    dead = set(range(8, 16))
    held = {h: {str(o): [7] for o in p.held_by[h]} for h in range(p.layout.world_size)}
    for h in dead:
        del held[h]
    t0 = time.perf_counter()
    short = short_of_replicas(p, held, 7)
    assert time.perf_counter() - t0 < 2.0
    assert short == replicas_lost(p, dead) and len(short) == 8


# ---------------------------------------------------------------------- the coordinator's events
def test_the_coordinators_plan_and_agreement_name_the_short_shards() -> None:
    """A real coordinator on an in-memory store (`decisions_job.Job`: dp 4, one rank a node,
    k=1): rank 2's death takes the copy it held; a spare in its slot holds nothing, so the
    agreement counts that shard short too."""
    job = Job(world=4, spares=1)
    job.decided("a2")
    [plan] = job.events.of("plan")
    [agreed] = job.events.of("agreed")
    owner = [o for o in range(4) if 2 in job.placement.holders[o]]
    assert plan["replicas_lost"] == owner and agreed["under_replicated"] == owner
    assert set(EVENTS["plan"].fields) >= plan.keys() - {"v", "job", "t", "event"}
    assert set(EVENTS["agreed"].fields) >= agreed.keys() - {"v", "job", "t", "event"}


def test_a_process_respawned_in_place_keeps_its_predecessors_copies() -> None:
    """With node agents, the new process reads its predecessor's segment files: it reports
    their copies, and no shard is short at the agreement (the plan still names the copies the
    dead process held)."""
    for segments, short in ((True, []), (False, [1])):
        job = Job(world=4, per_node=2, spares=1, respawn_limit=2)
        job.die("a3")
        job.tick()
        job.report(1, [0, 1, 2], segments=segments)
        job.tick()
        assert job.events.of("plan")[0]["replicas_lost"] == [1] == replicas_lost(job.placement, [3])
        assert job.events.of("agreed")[0]["under_replicated"] == short
