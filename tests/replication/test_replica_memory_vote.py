"""Where replicas live under ``auto``: host replicas' GPU staging buffer is counted, and a
newcomer adopts the memory the survivors' buffers are in (`devices.memory`)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from mp import run_world

PG_TIMEOUT = datetime.timedelta(seconds=60)


def test_host_replicas_of_gpu_state_count_their_staging_buffer() -> None:
    from megatron_deadpool.devices.memory import GIB, ReplicaMemoryError, decide

    total = 80 * GIB  # headroom 4 GiB
    need, staging = 60 * GIB, 10 * GIB  # 2 (k + 1) = 6 snapshots vs. one staging buffer
    # GPU replicas do not fit in 20 GiB; the 10 GiB staging buffer of host replicas does.
    assert decide("auto", "cuda", need, (20 * GIB, total), staging=staging) == "host"
    # 12 GiB free: host replicas' captures would run out of GPU memory: refused, naming it.
    with pytest.raises(ReplicaMemoryError, match="staging buffer of 10737418240 B"):
        decide("auto", "cuda", need, (12 * GIB, total), staging=staging)
    # ...and what a rank would take over counts as free for it too.
    assert decide("auto", "cuda", need, (12 * GIB, total), reusable=4 * GIB, staging=staging)
    assert isinstance(ReplicaMemoryError("x"), ValueError)
    # GPU replicas need no staging buffer; the user's settings are not second-guessed.
    assert decide("auto", "cuda", need, (70 * GIB, total), staging=staging) == "gpu"
    assert decide("cpu", "cuda", need, None, staging=staging) == "host"


def test_a_newcomer_adopts_what_the_survivors_hold() -> None:
    from megatron_deadpool.devices.memory import Tally

    def agree(*votes: tuple[str, bool]) -> str:
        total = [0, 0, 0, 0]
        for vote, held in votes:
            total = [a + b for a, b in zip(total, Tally.of(vote, held).counts())]  # type: ignore[arg-type]
        return Tally.from_counts(total).choice()

    # The first replicator: free memory decides, one host vote moves every rank.
    assert agree(("gpu", False), ("gpu", False)) == "gpu"
    assert agree(("gpu", False), ("host", False)) == "host"
    # After a recovery the survivors' buffers decide: a newcomer's host vote does not move them.
    assert agree(("gpu", True), ("gpu", True), ("host", False)) == "gpu"
    assert agree(("host", True), ("gpu", False)) == "host"
    assert Tally.of("host", False, short=True).short == 1


def _replicator(rank: int, world_size: int, memory: Any, previous: Any = None) -> Any:
    """A replicator of rank `rank`'s `stepped_state`, one replica per rank of a world of
    one-rank nodes, its memory `memory`."""
    import torch.distributed as dist
    from optimizers import stepped_state

    from megatron_deadpool.replication.placement import Layout, place_replicas
    from megatron_deadpool.replication.replicator import Replicator
    from megatron_deadpool.replication.snapshot import Snapshotter

    placement = place_replicas(Layout(tp=1, pp=1, dp=world_size, ranks_per_node=1), 1)
    group = dist.new_group(backend="gloo", timeout=PG_TIMEOUT)
    return Replicator(Snapshotter(stepped_state(seed=rank), rank), placement, rank, group,
                      memory, previous=previous)  # fmt: skip


def _newcomer_rank(*, rank: int, world_size: int, store: Any) -> dict[str, Any]:
    from voting_memory import VotingMemory

    first = _replicator(rank, world_size, VotingMemory("gpu"))
    # A recovery: rank 0 survives with its buffers; rank 1's place goes to a newcomer, which
    # reads little free memory (it votes host).
    previous = first if rank == 0 else None
    if rank == 1:
        first.retire()
    second = _replicator(rank, world_size, VotingMemory("host"), previous=previous)
    return {"first": first.choice, "second": second.choice}


@pytest.mark.timeout(180)
def test_a_newcomers_host_vote_does_not_move_the_run() -> None:
    for result in run_world("test_replica_memory_vote:_newcomer_rank", 2, timeout=150):
        assert result == {"first": "gpu", "second": "gpu"}, result


def _short_rank(*, rank: int, world_size: int, store: Any) -> dict[str, Any]:
    from voting_memory import VotingMemory

    from megatron_deadpool.devices.memory import ReplicaMemoryError

    # Rank 1 finds neither GPU replicas nor host replicas' staging buffer fit.
    short = ReplicaMemoryError("rank 1: neither fits (test)") if rank == 1 else "gpu"
    try:
        _replicator(rank, world_size, VotingMemory(short))
    except ReplicaMemoryError as exc:
        return {"refused": str(exc)}
    return {"refused": None}


@pytest.mark.timeout(180)
def test_a_rank_short_of_gpu_memory_makes_every_rank_refuse_together() -> None:
    """One rank's `ReplicaMemoryError` is raised after the exchange, on every rank: none is
    left waiting in the all-reduce for it, and its own message names its figures."""
    results = run_world("test_replica_memory_vote:_short_rank", 2, timeout=150)
    assert "on 1 rank(s) neither GPU replicas" in results[0]["refused"]
    assert results[1]["refused"] == "rank 1: neither fits (test)"
