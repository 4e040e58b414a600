"""The store stays bounded: rank 0's per-iteration records keep a window, and the keys of
finished generations (ours and torch's rendezvous keys) are deleted once a later generation is
complete - while every key a process may still read stays (`hotswap/protocol/retention.py`).

The generations run through the real coordinator on the in-memory store, as the decision table
does (`test_decisions.py`); `bench store-state` shows the same on a real store server over
100,000 iterations, with its memory."""

from __future__ import annotations

import time

from decisions_job import Job
from stores import SEAL

from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.messages import IterationRecord, Keys
from megatron_deadpool.hotswap.protocol.retention import (
    RETAINED_CHECKPOINT_FAILURES,
    RETAINED_ITERATIONS,
    generation_keys,
    key_generation,
    member_keys,
    wake_up_keys,
)

GENERATIONS = 20
ITERATIONS = 1000


def record(iteration: int, generation: int) -> IterationRecord:
    return IterationRecord(
        iteration=iteration,
        time=time.time(),
        loss=1.0,
        grad_norm=None,
        lr=0.1,
        iter_time_s=0.01,
        replication_s=0.0,
        generation=generation,
        committed_iteration=iteration - 1 or None,
        replica_bytes_sent=0,
        replication_parts_s={},
    )


def torch_rendezvous(job: Job, generation: int) -> None:
    """What torch writes when generation g's groups rendezvous (a gloo group: one key per
    rank, `gen{g}/{group}//cpu//0/{rank}`)."""
    for rank in range(job.world):
        job.store.set(f"gen{generation}/0//cpu//0/{rank}", "address")


def recover(job: Job, generation: int) -> None:
    """One rank crashes and generation g runs to completion: plan, reports, roster, every rank
    joined and restored, rank 0's first iteration."""
    victim = generation % job.world
    job.die(job.coord.roster.slots[victim])
    job.tick()
    plan = job.m().plan(generation)
    assert plan is not None
    job.report(generation, [r for r in range(job.world) if r not in plan.needy])
    job.tick()
    roster = job.coord.roster
    assert roster.generation == generation
    torch_rendezvous(job, generation)
    for rank, member in roster.slots.items():
        job.m(member).stamp(generation, "joined", rank)
        job.m(member).stamp(generation, "restored", rank)
    job.m(roster.slots[0]).stamp(generation, "first_iteration", 0)
    job.tick()
    assert not job.coord.recovering


def test_keys_stay_bounded_over_iterations_and_generations() -> None:
    job = Job(world=4, spares=GENERATIONS)
    torch_rendezvous(job, 0)
    per_generation = ITERATIONS // GENERATIONS
    counts = []
    it = 0
    for g in range(GENERATIONS + 1):
        if g:
            recover(job, g)
        rank0 = job.m(job.coord.roster.slots[0])
        for _ in range(per_generation):
            it += 1
            rank0.publish_metrics(record(it, g))
            rank0.set_progress(it)
            job.tick()  # the coordinator deletes a batch per tick
        counts.append(job.store.num_keys())
        # What a process may still read stays: this generation's and the previous one's keys,
        # generation 0's roster (the job's world size), the display's current records.
        seen = Membership(job.store.clone(), "reader", SEAL)
        assert seen.roster(0).world_size == job.world
        assert seen.metrics(g, it) is not None
        if g:
            assert seen.roster(g - 1) is not None and seen.plan(g) is not None
            assert seen.holdings(g, (g + 1) % job.world) is not None
            assert seen.metrics(g - 1, it - per_generation) is not None
        if g >= 2:
            assert seen.plan(g - 2) is None and seen.metrics(g - 2, it - 2 * per_generation) is None
    # Two generations' keys at most: the count stops growing once there are two behind.
    assert max(counts[3:]) <= counts[2], counts


def test_rank_0_keeps_a_window_of_its_records() -> None:
    job = Job(world=2, spares=0)
    rank0 = job.m("a0")
    last = 3 * RETAINED_ITERATIONS
    for it in range(1, last + 1):
        rank0.publish_metrics(record(it, 0))
    records = [k for k in job.store.list_keys() if k.startswith("metrics/")]
    assert len(records) == RETAINED_ITERATIONS
    # A reader up to the window behind still finds every record it has not shown.
    assert all(
        rank0.metrics(0, it) is not None for it in range(last - RETAINED_ITERATIONS + 1, last + 1)
    )
    assert rank0.metrics(0, last - RETAINED_ITERATIONS) is None
    # The old behaviour, for `bench store-state`: every record stays.
    for it in range(last + 1, last + 11):
        rank0.publish_metrics(record(it, 0), retain=None)
    assert (
        rank0.metrics(0, last + 1) is not None
        and rank0.metrics(0, last + 10 - RETAINED_ITERATIONS) is not None
    )


def test_failed_checkpoints_keep_a_window_of_lines() -> None:
    """A disk that stays full fails every periodic checkpoint: `checkpoint/failures` keeps the
    newest lines, not one per interval for the life of the job."""
    rank0 = Job(world=2, spares=0).m("a0")
    last = 3 * RETAINED_CHECKPOINT_FAILURES
    for it in range(1, last + 1):
        rank0.publish_checkpoint_failure(it, f"checkpoint of iteration {it} not saved: disk full")
    failures = rank0.checkpoint_failures()
    assert failures is not None
    assert sorted(failures.lines) == list(range(last - RETAINED_CHECKPOINT_FAILURES + 1, last + 1))


def test_which_keys_belong_to_a_generation() -> None:
    keys = [
        Keys.GENERATION,
        Keys.ROSTER.format(g=0),
        Keys.ROSTER.format(g=1),
        Keys.PLAN.format(g=12),
        Keys.HOLDINGS.format(g=3, rank=7),
        "gen2/0//cpu//0/5",
        Keys.METRICS.format(g=2, iteration=40),
        Keys.METRICS.format(g=5, iteration=41),
        Keys.LATEST_PLAN,
        Keys.PROGRESS,
        Keys.HEARTBEAT.format(member="a1"),
        Keys.SPARE_EPOCH_N.format(n=3),
        "gen0/default_pg/5/reconfigure/4/1",  # generation 4's repair of a group of generation 0
        "gen0/reconfigure/3/0",  # generation 3's repair of the default group
    ]
    assert wake_up_keys(2, 4) == [Keys.SPARE_EPOCH_N.format(n=n) for n in (2, 3)]
    assert [key_generation(k) for k in keys] == [
        *(None, 0, 1, 12, 3, 2, 2, 5),
        *(None, None, None, None),
        *(4, 3),
    ]
    assert generation_keys(keys, 0, 3) == [
        Keys.ROSTER.format(g=1),
        "gen2/0//cpu//0/5",
        Keys.METRICS.format(g=2, iteration=40),
    ]  # generation 0's roster is kept for good; its groups' later repairs are not generation 0's
    assert generation_keys(keys, 3, 5) == [
        Keys.HOLDINGS.format(g=3, rank=7),
        "gen0/default_pg/5/reconfigure/4/1",
        "gen0/reconfigure/3/0",
    ]


def test_a_dead_members_keys_go_with_its_generations_keys() -> None:
    """Every failure of a long run is a new member (a spare, a respawn, a joined spare): the
    keys only a member writes go once the generation planned for its death is two behind, as
    that generation's own keys do."""
    job = Job(world=4, spares=3)
    for member in ("a0", "a1", "s0"):
        job.m(member).report_failure("a peer died")  # a survivor's report: failure/{member}
    dead = []
    for g in (1, 2, 3):
        dead.append(job.coord.roster.slots[g % job.world])
        recover(job, g)
        for _ in range(5):
            job.tick()  # the deletes: a batch per tick
    first, second, third = dead  # a1 (generation 1), a2 (2), a3 (3)
    keys = set(job.store.list_keys())
    assert not keys & set(member_keys(first)), sorted(keys & set(member_keys(first)))
    assert {Keys.HEARTBEAT.format(member=m) for m in (second, third)} <= keys
    assert {Keys.READY.format(member=m) for m in (second, third)} <= keys
    # The living keep theirs.
    assert {Keys.FAILURE.format(member=m) for m in ("a0", "s0")} <= keys
    assert Keys.HEARTBEAT.format(member="a0") in keys
