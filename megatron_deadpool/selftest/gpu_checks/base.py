"""What the GPU checks share: `Skip`, CUDA's device timer, a world-size-1 NCCL world and a
GPU Adam shard (a `RankState`) of a chosen size."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...replication.snapshot import RankState

MIB, GIB = 1 << 20, 1 << 30

Outcome = dict[str, Any]
"""A check's result: ``status`` ("pass", "FAIL", "info"), ``figures`` and an optional ``note``
(the first contact's row)."""


class Skip(Exception):
    """This check cannot run here; the message says why."""


def require_cuda() -> None:
    """Raise `Skip` without a CUDA device."""
    if not (torch.cuda.is_available() and torch.cuda.device_count()):
        raise Skip("no CUDA device")


def require_megatron() -> None:
    """Raise `Skip` when megatron-core cannot be imported."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise Skip(f"megatron-core not importable ({exc}); carry its wheel") from None


def elapsed_ms(fn: Callable[[], object], repeat: int = 3) -> float:
    """Best of `repeat` device times of `fn()` in ms (CUDA events on the current stream)."""
    return min(device_times_ms(fn, repeat))


def device_times_ms(fn: Callable[[], object], repeat: int) -> list[float]:
    """The device time of each of `repeat` calls of `fn()` in ms (CUDA events on the current
    stream, each call waited for before the next)."""
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def matmul_loop(count: int = 40, size: int = 8192) -> Callable[[], None]:
    """`count` bf16 matmuls of `size`^3 on the current stream (40 x 8192^3: ~64 ms on an H200),
    standing in for a training step's compute."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)

    def loop() -> None:
        for _ in range(count):
            torch.mm(a, b)

    return loop


def world_of_one(groups: int = 0, kind: str = "cuda") -> list[Any]:
    """A world-size-1 NCCL world on a fresh store (DeadPool's settings), plus `groups` groups;
    `kind` "cpu": the same on gloo in the CPU mode (what checks a probe's own logic)."""
    import torch.distributed as dist

    from ...devices import nccl, select_device

    backend = "nccl" if kind == "cuda" else "gloo"
    select_device("cuda" if kind == "cuda" else "cpu", local_rank=0)
    dist.init_process_group(
        backend=backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
        **nccl.init_kwargs(backend),
    )
    return [dist.new_group([0], backend=backend) for _ in range(groups)]


class _Wrapped:
    """Megatron's optimizer as the replicator sees it (it guards `step`)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.optimizer = opt
        self.param_groups = opt.param_groups

    def step(self) -> Any:
        return self.optimizer.step()


class _Scheduler:
    """A learning-rate scheduler's state as the snapshot carries it."""

    num_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_steps = state["num_steps"]


def adam_state(
    numel: int, seed: int = 0, model: Sequence[torch.nn.Module] = (), device: str = "cuda"
) -> RankState:
    """A torch Adam over one parameter of `numel` fp32 elements on `device` after one step: a
    shard of 12 x `numel` bytes (parameter and both moments); `model`'s buffers travel with
    it."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(numel, device=device, generator=gen))]
    opt = torch.optim.Adam(params, lr=1e-3)
    params[0].grad = torch.randn(numel, device=device, generator=gen)
    opt.step()
    params[0].grad = None
    return RankState(_Wrapped(opt), _Scheduler(), model)


def replicator_of_one(
    state: RankState,
    group: Any,
    setting: str = "gpu",
    holders: tuple[int, ...] = (0,),
    **kwargs: Any,
) -> Any:
    """A `Replicator` of rank 0 in a world of one over `state`: the rank holds its own replica
    (`holders`; () for none: gloo cannot send to its own rank); `setting`:
    `--deadpool-replica-device`; `kwargs` go to the Replicator (`host_group`)."""
    from ...devices.base import Device
    from ...devices.memory import ReplicaMemory
    from ...replication.placement import Layout, Placement
    from ...replication.replicator import Replicator
    from ...replication.snapshot import Snapshotter

    placement = Placement(Layout(tp=1, pp=1, dp=1, ranks_per_node=1), len(holders), (holders,))
    cuda = torch.cuda.is_available() and state.optimizer.param_groups[0]["params"][0].is_cuda
    device = Device("cuda", "nccl", torch.cuda.current_device()) if cuda else Device("cpu", "gloo")
    memory = ReplicaMemory(setting, device)  # type: ignore[arg-type]
    return Replicator(Snapshotter(state, 0), placement, 0, group, memory, **kwargs)
