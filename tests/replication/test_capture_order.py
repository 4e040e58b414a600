"""The next forward pass cannot write a model buffer before the side-stream capture read it.

On a GPU the capture runs on a side stream; the Megatron-LM path orders only the next optimizer
step after it (`before_step`, through the step guard), and Megatron's MoE router writes buffers
in the forward pass in between. On an H200 a buffer written right after `start_round` was
captured with the new value in 12 of 12 rounds. CPU work is always in program order, so these
tests run the real `Replicator` under a stand-in of CUDA's stream semantics (`cuda_streams`)
that records every kernel's stream and every wait and event, and check happens-before.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_streams import StreamModel
from mp import run_world

ROUNDS = 3


@pytest.mark.timeout(60)
def test_the_stand_in_flags_what_cuda_would_not_order() -> None:
    model = StreamModel()
    data = torch.zeros(16)
    with model.installed():
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            data.sum()  # read on the side stream, nothing ordered
        data.fill_(1.0)  # main stream: write-after-read, unordered
    assert [v.split(":")[0] for v in model.violations()] == ["write-after-read unordered"]

    model = StreamModel()
    with model.installed():
        data.fill_(2.0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            data.sum()
            done = torch.cuda.Event()
            done.record()
        torch.cuda.current_stream().wait_event(done)
        data.fill_(3.0)
    assert model.violations() == []


class _Stepped:
    """Megatron's optimizer as the step guard sees it: `optimizer`, `step()`."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.optimizer = opt
        self.param_groups = opt.param_groups
        self.grad_scaler = None

    def step(self) -> None:
        self.optimizer.step()


class _Router(torch.nn.Module):
    """The MoE router's buffers: a counter the forward pass fills, a bias the step changes."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("tokens", torch.zeros(4096), persistent=False)
        self.register_buffer("expert_bias", torch.zeros(8))


def _rank(*, rank: int, world_size: int, store: Any, ahead: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from optimizers import Scheduler, make_optimizer, set_grads

    from megatron_deadpool.devices.base import Device
    from megatron_deadpool.devices.memory import ReplicaMemory
    from megatron_deadpool.replication.placement import Layout, place_replicas
    from megatron_deadpool.replication.replicator import Replicator
    from megatron_deadpool.replication.snapshot import RankState, Snapshotter

    params, adam = make_optimizer("torch-adam", seed=rank)
    set_grads(params, 0)
    adam.step()
    router = _Router()
    state = RankState(_Stepped(adam), Scheduler(), [router])
    snap = Snapshotter(state, rank)
    snap.device = torch.device("cuda", 0)  # the state "is on a GPU": the stand-in orders it
    placement = place_replicas(Layout(tp=1, pp=1, dp=world_size, ranks_per_node=1), 1)
    memory = ReplicaMemory("cpu", Device("cpu", "gloo"))
    model = StreamModel()
    with model.installed():
        repl = Replicator(snap, placement, rank, dist.group.WORLD, memory)
        repl.verdict_ahead = ahead  # CUDA's path: settled and posted in `before_step`
        for it in range(1, ROUNDS + 1):
            model.phase = f"step {it}: forward and optimizer step"
            router.tokens.fill_(float(it))
            router.expert_bias.add_(1.0)
            model.phase = f"start_round({it})"
            repl.start_round(it)
            model.phase = f"step {it + 1}: forward"
            router.tokens.fill_(-1.0)  # the next forward pass writes the counter at once
            set_grads(params, it)
            model.phase = f"step {it + 1}: optimizer step"
            state.optimizer.step()  # the guard's `before_step` first
            model.phase = f"finish_round({it})"
            repl.finish_round()
        model.synchronize()
        model.phase = "restore"
        flat = repl.verified_copy(rank, ROUNDS)
        assert flat is not None
        Snapshotter.restore_into(state, flat, owner=rank, iteration=ROUNDS)
    repl.retire()
    side_reads = sum(1 for op in model.ops if op.stream != model.main.id and op.reads)
    # The device tensors: the live state the training writes, and the capture's staging of
    # the buffers where it has one (the verdict's flag and the replicas are host tensors here).
    device = [*state.state_tensors(), *([snap._stage.area] if hasattr(snap, "_stage") else [])]
    return {
        "violations": model.violations(device)[:8],
        "side_reads": side_reads,
        "restored_tokens": sorted(set(router.tokens.tolist())),
        "restored_bias": sorted(set(router.expert_bias.tolist())),
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ahead", [True, False], ids=["verdict-ahead", "verdict-after"])
def test_the_next_forward_pass_is_ordered_after_the_captures_read_of_the_buffers(
    ahead: bool,
) -> None:
    results = run_world("test_capture_order:_rank", 2, kwargs={"ahead": ahead}, timeout=200)
    for rank, result in enumerate(results):
        assert result["side_reads"] > 0, result  # the capture did run on the side stream
        assert result["violations"] == [], (rank, result["violations"])
        # The captured buffers are those of the step, not the next forward's.
        assert result["restored_tokens"] == [float(ROUNDS)], result
        assert result["restored_bias"] == [float(ROUNDS)], result
