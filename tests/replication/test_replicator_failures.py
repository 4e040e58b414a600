"""The replicator around a failure, on gloo worlds of real processes.

- Abort first, then only completed receives: three ranks each hold the other two's replicas
  (k=2); rank 2 stops itself (SIGSTOP) before round 2. Ranks 0 and 1 post round 2, wait
  until each other's bytes arrived, call `abort_groups()` and `abandon()`: the replica that
  arrived is kept (verified), the stopped owner's is not, the previous round's stays, and
  nothing waits on the stopped rank (the group timeout is 60 s).
- A peer seen lost as a round is posted fails the round where it is waited for, not as it is
  posted.
- A survivor's plan waiter waits for the in-flight round's transfers to end before it aborts
  (`Replicator.wait_in_flight`): a round that ended is kept after the abort; a stopped owner's
  transfer bounds the wait.
- A replicator built after a recovery takes over its predecessor's buffers: no second set.
- A recovery's shard exchange (one table all-reduce, one batched round): needy ranks receive
  exactly the bytes their holders send, of different sizes.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from typing import Any

import pytest
from mp import run_world
from procs import wait_stopped, wait_until

PG_TIMEOUT = datetime.timedelta(seconds=60)


def _replicator(
    rank: int, world_size: int, replicas: int, seed: int, previous: Any = None, segments: Any = None
):
    import torch.distributed as dist
    from optimizers import stepped_state

    from megatron_deadpool.devices.base import Device
    from megatron_deadpool.devices.memory import ReplicaMemory
    from megatron_deadpool.replication.placement import Layout, place_replicas
    from megatron_deadpool.replication.replicator import Replicator
    from megatron_deadpool.replication.snapshot import Snapshotter

    state = stepped_state(seed)
    layout = Layout(tp=1, pp=1, dp=world_size, ranks_per_node=1)
    group = dist.new_group(backend="gloo", timeout=PG_TIMEOUT)
    memory = ReplicaMemory("cpu", Device("cpu", "gloo"), segments)
    placement = place_replicas(layout, replicas)
    return Replicator(Snapshotter(state, rank), placement, rank, group, memory, previous)


def _abandon_rank(*, rank: int, world_size: int, store: Any) -> dict[str, Any]:
    from megatron_deadpool.devices import p2p
    from megatron_deadpool.devices.abort import abort_groups

    # Only the aborted connections may end the wait on the stopped owner's receive: with this
    # bound, a wait that did not return at once would take 30 s.
    p2p.GLOO_SETTLE_S = 30.0
    repl = _replicator(rank, world_size, replicas=2, seed=rank)
    repl.start_round(1)
    committed = repl.finish_round()
    if rank == 2:
        store.set("stopping", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # never continued: the harness kills it
    store.wait(["stopping"])
    wait_stopped(int(store.get("stopping")))
    repl.start_round(2)
    peer = 1 - rank
    wait_until(lambda: _landed(repl, peer, 2), 60, f"rank {peer}'s replica of round 2")
    t0 = time.monotonic()
    ended = repl.wait_in_flight(0.5)  # the stopped owner's receive has not ended
    waited = time.monotonic() - t0
    t0 = time.monotonic()
    abort_groups()
    salvaged = repl.abandon()
    seconds = time.monotonic() - t0
    return {
        "committed": committed,
        "salvaged": salvaged,
        "seconds": seconds,
        "holdings": repl.holdings(),
        "ended": ended,
        "waited": waited,
    }


def _landed(repl: Any, owner: int, iteration: int) -> bool:
    """Whether `owner`'s replica of `iteration` is wholly in this rank's receive buffer (its
    checksum verifies), read without waiting on the transfer (on gloo a wait would consume
    the receive's completion, which `abandon` must find)."""
    from megatron_deadpool.replication.snapshot import CorruptReplicaError, verify

    try:
        verify(repl.held[owner].buffers[repl._held_slots[owner]], owner=owner, iteration=iteration)
    except CorruptReplicaError:
        return False
    return True


@pytest.mark.timeout(150)
def test_abandon_after_abort_keeps_only_completed_receives() -> None:
    results = run_world("test_replicator_failures:_abandon_rank", 3, timeout=120, optional=(2,))
    for rank in (0, 1):
        r = results[rank]
        peer = 1 - rank
        assert r["committed"] == 1, r
        assert r["salvaged"] == [peer], r
        assert r["seconds"] < 5.0, r  # never waited on the stopped owner
        assert r["ended"] is False and 0.5 <= r["waited"] < 5.0, r  # the plan waiter's bound
        assert r["holdings"] == {"local": [1, 2], str(peer): [1, 2], "2": [1]}, r


def _settled_rank(*, rank: int, world_size: int, store: Any) -> dict[str, Any]:
    from megatron_deadpool.devices.abort import abort_groups

    repl = _replicator(rank, world_size, replicas=1, seed=rank)
    repl.start_round(1)
    repl.finish_round()
    repl.start_round(2)
    t0 = time.monotonic()
    ended = repl.wait_in_flight(30.0)  # what a survivor's plan waiter does before it aborts
    waited = time.monotonic() - t0
    in_flight = repl._round
    store.set(f"settled{rank}", "1")
    store.wait([f"settled{1 - rank}"])
    abort_groups()
    return {"ended": ended, "waited": waited, "in_flight": in_flight, "kept": repl.abandon()}


@pytest.mark.timeout(150)
def test_a_round_whose_transfers_ended_is_waited_for_and_kept_after_the_abort() -> None:
    """`wait_in_flight` returns once the round's transfers ended (the worker thread verified
    them), leaves the round in flight, and the abort after it keeps the peer's replica."""
    results = run_world("test_replicator_failures:_settled_rank", 2, timeout=120)
    for rank, r in enumerate(results):
        assert r["ended"] is True and r["waited"] < 10.0, r
        assert r["in_flight"] == 2 and r["kept"] == [1 - rank], r


def _lost_peer_rank(*, rank: int, world_size: int, store: Any) -> dict[str, Any]:
    import torch

    from megatron_deadpool.devices.abort import abort_groups
    from megatron_deadpool.devices.failures import is_peer_failure

    repl = _replicator(rank, world_size, replicas=1, seed=rank)
    repl.start_round(1)
    committed = repl.finish_round()
    if rank == 1:
        os._exit(0)  # its connections close
    group = repl.transfer_group

    def send_raises() -> bool:  # a probe: once gloo saw the connection closed, sends raise
        try:
            group.send([torch.zeros(1)], 1, 99)
        except RuntimeError:
            return True
        return False

    wait_until(send_raises, 60, "gloo to see rank 1's connection closed")
    repl.start_round(2)  # posts to the lost peer: must not raise here
    raised = None
    try:
        repl.finish_round()
    except Exception as exc:  # noqa: BLE001 - what the test checks
        raised = is_peer_failure(exc)
    abort_groups()  # the world has lost a rank: no final barrier
    return {"committed": committed, "raised": raised}


@pytest.mark.timeout(150)
def test_a_peer_seen_lost_as_a_round_is_posted_fails_the_round_where_it_is_waited_for() -> None:
    """gloo raises as it posts a send to a peer whose connection it saw closed: that failure
    comes out of `finish_round` (or the step's `settle`), where a failure of the transfers
    does, not out of `start_round` - or a Megatron-LM survivor failed one step before those
    that had not seen the loss yet, and the survivors resumed at different steps (Slurm lab,
    CI)."""
    result, _ = run_world("test_replicator_failures:_lost_peer_rank", 2, timeout=120, optional=(1,))
    assert result == {"committed": 1, "raised": True}, result


def _reuse_rank(*, rank: int, world_size: int, store: Any) -> dict[str, Any]:
    first = _replicator(rank, world_size, replicas=1, seed=rank)
    first.start_round(1)
    first.finish_round()
    before = {b.data_ptr() for pair in (first.local, *first.held.values()) for b in pair.buffers}
    second = _replicator(rank, world_size, replicas=1, seed=rank, previous=first)
    after = {b.data_ptr() for pair in (second.local, *second.held.values()) for b in pair.buffers}
    second.start_round(2)
    return {
        "reused": before == after,
        "first_emptied": all(b.numel() == 0 for b in first.local.buffers) and not first.held,
        "committed": second.finish_round(),
    }


@pytest.mark.timeout(150)
def test_a_new_replicator_takes_over_its_predecessors_buffers() -> None:
    for r in run_world("test_replicator_failures:_reuse_rank", 2, timeout=120):
        assert r == {"reused": True, "first_emptied": True, "committed": 2}, r


def _segments_rank(*, rank: int, world_size: int, store: Any) -> dict[str, Any]:
    import shutil
    import tempfile
    from pathlib import Path

    import torch

    from megatron_deadpool.replication.segments import SegmentHoldings

    where = Path(tempfile.mkdtemp(prefix="deadpool-segments-test-"))
    try:
        first = _replicator(rank, world_size, replicas=1, seed=rank, segments=where)
        first.start_round(1)
        first.finish_round()
        before = {p: b.data_ptr() for p, b in first.files.items()}
        second = _replicator(rank, world_size, 1, rank, previous=first, segments=where)
        second.start_round(2)
        second.finish_round()
        after = {p: b.data_ptr() for p, b in second.files.items()}
        # What a process respawned in this one's place would find in the files.
        found = SegmentHoldings(where, rank)
        own = found.verified_copy(rank, 2)
        mine = second.verified_copy(rank, 2)
        return {
            "files": sorted(p.name for p in where.iterdir()),
            "same_mappings": before == after and len(after) == 4,
            "holdings": found.holdings(),
            "own_copy_equal": own is not None and mine is not None and torch.equal(own, mine),
        }
    finally:
        shutil.rmtree(where)


@pytest.mark.timeout(150)
def test_slots_in_segment_files_outlive_the_replicator_and_are_kept_by_its_successor() -> None:
    """With a node's segment folder (`replication/segments.py`) the slots are files: a
    successor keeps its predecessor's mappings (no second mapping, nor on a GPU a second
    page-locking), and what a respawned process would read there is every verified copy."""
    results = run_world("test_replicator_failures:_segments_rank", 2, timeout=120)
    for rank, r in enumerate(results):
        peer = 1 - rank
        assert r["same_mappings"] and r["own_copy_equal"], r
        # The successor knows nothing verified at first: its round 2 overwrote round 1's slot.
        assert r["holdings"] == {"local": [2], str(peer): [2]}, r
        assert len(r["files"]) == 4 and all(f.startswith(f"r{rank}-o") for f in r["files"]), r


def _exchange_rank(*, rank: int, world_size: int, store: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from megatron_deadpool.replication.shard_exchange import start_shard_exchange

    def flat(owner: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(owner)
        return torch.randint(0, 256, (4096 + 64 * owner,), dtype=torch.uint8, generator=gen)

    sources = {1: 0, 2: 3}  # needy rank -> holder
    group = dist.new_group(backend="gloo", timeout=PG_TIMEOUT)
    sends = {target: flat(target) for target, holder in sources.items() if holder == rank}
    pending = start_shard_exchange(
        group, rank=rank, world_size=world_size, sends=sends, source=sources.get(rank)
    )
    received = pending.wait()
    return {
        "exact": received is None or torch.equal(received, flat(rank)),
        "got": received is not None,
    }


@pytest.mark.timeout(150)
def test_shard_exchange_delivers_each_needy_rank_its_snapshot() -> None:
    results = run_world("test_replicator_failures:_exchange_rank", 4, timeout=120)
    assert [r["got"] for r in results] == [False, True, True, False]
    assert all(r["exact"] for r in results)
