"""Replication work kept off the training's critical path, on gloo worlds of real processes.

- Host replicas are verified on a worker thread (`replication.verifier`), never on the main
  thread, and what counts as verified does not change: a bit flipped in transit still blocks
  that round's commit on every rank, the next round commits again.
- The verdict posted ahead (`devices.groups.verdict_ahead`, CUDA's path; here on gloo, where
  the logic is the same): settled and posted before the next "optimizer step", read after it -
  the same commits, round by round, as the blocking all-reduce of the CPU path.
- Host replicas travel on their own group when one is given (CUDA: the data-parallel peers'
  gloo group), the world group carrying only the collectives; a recovery's shard exchange too.
- A replicator rebuilt after a recovery votes the memory its predecessor's buffers are in.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import pytest
from mp import run_world

PG_TIMEOUT = datetime.timedelta(seconds=60)
ROUNDS = 5
FLIP_ROUND = 2  # rank 1 damages rank 0's replica of this round as it arrives


def _run(repl: Any, rank: int, ahead: bool) -> list[Any]:
    """Rounds 1..ROUNDS as the Megatron-LM hooks drive them: per step, the optimizer step's
    guard (`before_step`), then `finish_round` and `start_round`."""
    repl.verdict_ahead = ahead
    committed = []
    repl.start_round(1)
    for it in range(2, ROUNDS + 1):
        if it == FLIP_ROUND + 1 and rank == 1:
            repl.flip_bit_on_arrival(0, byte=repl.sizes[0] // 3, bit=5)
        repl.before_step()  # the next step's optimizer step begins
        committed.append(repl.finish_round())
        repl.start_round(it)
    committed.append(repl.finish_round())
    return committed


def _paths_rank(*, rank: int, world_size: int, store: Any) -> dict[str, Any]:
    import torch.distributed as dist
    from optimizers import stepped_state

    from megatron_deadpool.devices.base import Device
    from megatron_deadpool.devices.groups import new_host_group
    from megatron_deadpool.devices.memory import ReplicaMemory
    from megatron_deadpool.replication import replicator as replicator_module
    from megatron_deadpool.replication import verifier
    from megatron_deadpool.replication.placement import Layout, place_replicas
    from megatron_deadpool.replication.replicator import Replicator
    from megatron_deadpool.replication.snapshot import Snapshotter

    verified_on: list[tuple[str, bool]] = []
    real_verify = verifier.verify

    def recording_verify(*args: Any, **kwargs: Any) -> Any:
        verified_on.append((threading.current_thread().name, kwargs.get("one_core", False)))
        return real_verify(*args, **kwargs)

    verifier.verify = recording_verify  # type: ignore[assignment]
    posted_on: list[int] = []
    real_post = replicator_module.post

    def recording_post(transfers: Any, group: Any, **kwargs: Any) -> Any:
        posted_on.append(id(group))
        return real_post(transfers, group, **kwargs)

    replicator_module.post = recording_post  # type: ignore[assignment]

    layout = Layout(tp=1, pp=1, dp=world_size, ranks_per_node=1)
    placement = place_replicas(layout, 1)
    world = dist.new_group(backend="gloo", timeout=PG_TIMEOUT)
    host = new_host_group(layout.dp_group_of[rank], PG_TIMEOUT)
    memory = ReplicaMemory("cpu", Device("cpu", "gloo"))
    out: dict[str, Any] = {}
    state = stepped_state(seed=rank)
    for name, ahead, host_group in (
        ("sync", False, None),
        ("ahead", True, None),
        ("host-group", True, host),
    ):
        verified_on.clear()
        posted_on.clear()
        repl = Replicator(Snapshotter(state, rank), placement, rank, world, memory,
                          host_group=host_group)  # fmt: skip
        committed = _run(repl, rank, ahead)
        out[name] = {
            "committed": committed,
            "corrupt": [(o, it) for o, it, _ in repl.corrupt_seen],
            "holdings": repl.holdings(),
            "verify_threads": sorted(set(verified_on[: (ROUNDS) * len(repl.owners)])),
            "verify_count": len(verified_on),
            "posted_on_host_group": bool(posted_on) and set(posted_on) == {id(host)},
            "posted_on_world": bool(posted_on) and set(posted_on) == {id(world)},
            "transfer_group_is_host": repl.transfer_group is host,
        }
        repl.retire()
    return out


@pytest.mark.timeout(240)
def test_verified_off_the_main_thread_and_verdicts_posted_ahead_commit_the_same() -> None:
    results = run_world("test_off_critical_path:_paths_rank", 2, timeout=200)
    expected = [1, 1, 3, 4, 5]  # round 2 damaged in transit at rank 1: not committed anywhere
    for rank, result in enumerate(results):
        for name in ("sync", "ahead", "host-group"):
            run = result[name]
            assert run["committed"] == expected, (rank, name, run)
            assert run["corrupt"] == ([[0, FLIP_ROUND]] if rank == 1 else []), (rank, name)
            # Every round's replica was checked on the worker thread, none on the main one, on
            # DeadPool's checksum threads (`parallel_checksum`: no OpenMP team beside the
            # training's; not the calling thread alone); the damaged one again on the main
            # thread (the injection happens there).
            assert run["verify_threads"] == [["deadpool-verify", False]], (rank, name, run)
            assert run["holdings"]["local"] == [4, 5] and len(run["holdings"]) == 2
        assert result["host-group"]["transfer_group_is_host"]
        assert result["host-group"]["posted_on_host_group"]
        assert result["ahead"]["posted_on_world"] and not result["ahead"]["transfer_group_is_host"]


def _rebuilt_rank(*, rank: int, world_size: int, store: Any) -> dict[str, Any]:
    import torch.distributed as dist
    from optimizers import stepped_state
    from voting_memory import VotingMemory

    from megatron_deadpool.replication.placement import Layout, place_replicas
    from megatron_deadpool.replication.replicator import Replicator
    from megatron_deadpool.replication.snapshot import Snapshotter

    layout = Layout(tp=1, pp=1, dp=world_size, ranks_per_node=1)
    placement = place_replicas(layout, 1)
    group = dist.new_group(backend="gloo", timeout=PG_TIMEOUT)
    memory = VotingMemory("host")  # records the vote's inputs
    state = stepped_state(seed=rank)
    first = Replicator(Snapshotter(state, rank), placement, rank, group, memory)  # type: ignore[arg-type]
    first.start_round(1)
    first.finish_round()
    buffers = {b.data_ptr() for b in first.buffers()}
    second = Replicator(Snapshotter(state, rank), placement, rank, group, memory, previous=first)  # type: ignore[arg-type]
    reused = {b.data_ptr() for b in second.buffers()} == buffers
    return {"asked": memory.asked, "choice": second.choice, "reused": reused}


@pytest.mark.timeout(180)
def test_a_rebuilt_replicator_votes_where_its_predecessors_buffers_are() -> None:
    for result in run_world("test_off_critical_path:_rebuilt_rank", 2, timeout=150):
        assert result["asked"] == [
            {"previous": None, "reusable": 0},
            {"previous": "host", "reusable": 0},  # host buffers: nothing of the GPU's to reuse
        ]
        assert result["choice"] == "host" and result["reused"]
