"""The collective gate on a real gloo group: a closed gate stops its thread before the next
collective call - nothing started - with the error a lost peer's collective raises, once; other
threads' calls pass; and torch's own functions are back whenever the gate is open."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from megatron_deadpool.devices.collective_gate import COLLECTIVES, CollectiveGate
from megatron_deadpool.devices.failures import is_peer_failure


@pytest.fixture
def world() -> Iterator[None]:
    if dist.is_initialized():  # left by another test of this process: used as it is
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _originals() -> dict[str, object]:
    return {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}


def test_a_closed_gate_stops_its_thread_once_before_the_collective(world: None) -> None:
    torch_own = _originals()
    gate = CollectiveGate()
    t = torch.ones(3)
    gate.close(threading.get_ident(), "a recovery was planned during this step")
    with pytest.raises(dist.DistBackendError) as err:
        dist.all_reduce(t)
    assert str(err.value) == (
        "a recovery was planned during this step: stopped before its next collective (all_reduce)"
    )
    assert is_peer_failure(err.value)  # the driver recovers from it like from a lost peer's
    assert not gate.closed and _originals() == torch_own  # opened by the stop
    t.mul_(2)
    dist.all_reduce(t)  # nothing was started before: the group works on
    assert t.tolist() == [2.0, 2.0, 2.0]


def test_another_threads_collectives_pass_and_open_puts_torchs_functions_back(world: None) -> None:
    torch_own = _originals()
    gate = CollectiveGate()
    gate.close(threading.get_ident(), "planned")
    assert _originals() != torch_own  # wrapped while closed
    results: list[list[float]] = []

    def replication_thread() -> None:
        t = torch.full((2,), 5.0)
        dist.all_reduce(t)
        results.append(t.tolist())

    thread = threading.Thread(target=replication_thread)
    thread.start()
    thread.join(60)
    assert results == [[5.0, 5.0]]
    assert gate.closed  # still waiting for its own thread's call
    gate.open()
    assert not gate.closed and _originals() == torch_own
    dist.barrier()  # open: nothing raises


def test_open_leaves_a_function_replaced_since_alone(world: None) -> None:
    gate = CollectiveGate()
    gate.close(threading.get_ident(), "planned")
    gated_barrier = dist.barrier

    def someone_elses(*args: object, **kwargs: object) -> None:
        return None

    dist.barrier = someone_elses
    try:
        gate.open()
        assert dist.barrier is someone_elses
        assert gated_barrier is not someone_elses
    finally:
        dist.barrier = gated_barrier.__wrapped__  # type: ignore[attr-defined]


def test_p2p_ops_built_while_closed_are_torchs_and_their_batch_is_stopped(world: None) -> None:
    """Megatron's pipeline communication builds `P2POp(torch.distributed.isend, ...)`, which
    torch checks by identity: a wrapper in `isend`'s place made it a ValueError (a survivor of a
    pipeline-parallel job stopped mid-compute ended with that error instead of recovering)."""
    gate = CollectiveGate()
    gate.close(threading.get_ident(), "planned")
    assert dist.isend is dist.distributed_c10d.isend and dist.irecv is dist.distributed_c10d.irecv
    ops = [dist.P2POp(dist.isend, torch.ones(2), 0), dist.P2POp(dist.irecv, torch.zeros(2), 0)]
    with pytest.raises(dist.DistBackendError, match=r"\(batch_isend_irecv\)$"):
        dist.batch_isend_irecv(ops)
    assert not gate.closed


def test_a_call_inside_a_coalescing_block_passes_and_the_next_one_after_it_stops(
    world: None,
) -> None:
    """Megatron's DDP without the distributed optimizer all-reduces its buckets inside
    `_coalescing_manager`, which records each call and runs them as the block ends - with no
    `finally`: an error raised in the block left torch's record behind, so the group's later
    collectives were recorded instead of run and its next block raised ValueError."""
    gate = CollectiveGate()
    gate.close(threading.get_ident(), "planned")
    t = torch.ones(2)
    with dist.distributed_c10d._coalescing_manager():
        dist.all_reduce(t)  # recorded: nothing raised inside the block
    assert not dist.distributed_c10d._world.pg_coalesce_state  # the block ended cleanly
    assert gate.closed
    with pytest.raises(dist.DistBackendError, match=r"\(all_reduce\)$"):
        dist.all_reduce(t)
    dist.all_reduce(t)  # the group works on
    assert t.tolist() == [1.0, 1.0]
