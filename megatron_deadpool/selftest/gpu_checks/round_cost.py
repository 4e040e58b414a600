"""One replication round's cost to a training step, beside a plain copy of the same bytes.

A loop of bf16 matmuls (`base.matmul_loop`, ~64 ms on an H200) stands in for a step's compute.
Per shard size, a world-of-one `Replicator` with GPU replicas (`--deadpool-replica-device gpu`)
starts one round just before the loop (what the job does after the optimizer step); beside it,
a plain `copy_` of the shard's bytes on a side stream. Each figure is the minimum over
`ROUNDS` rounds of the loop's device time minus the loop's alone (the GPU time the round adds);
the host time is what `start_round` holds the calling thread (median over the rounds).

The verdict (`judge`, pure): a round must add at most `COPY_FACTOR` times what the plain copy
adds plus the loop's own noise (the spread of its times alone), and hold the host under
`HOST_LIMIT_MS`. Which pack backend runs is the process's: the first contact runs this once as
it is (the fused kernel) and once under ``DEADPOOL_PACK_BACKEND=torch`` (the fallback), each in
its own interpreter.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ...devices.streams import own_stream
from .base import Outcome, adam_state, device_times_ms, matmul_loop, replicator_of_one

ROUNDS = 4
COPY_FACTOR = 2.0
HOST_LIMIT_MS = 2.0
SHARDS_GB = (0.5, 1.5, 3.0)


@dataclass(frozen=True)
class SizeCost:
    """The figures of one shard size (milliseconds)."""

    shard_bytes: int
    loop_ms: float
    """The loop alone (minimum)."""
    noise_ms: float
    """The spread (max - min) of the loop's times alone."""
    copy_added_ms: float
    round_added_ms: float
    host_ms: float
    """What `start_round` held the host (median)."""


def judge(costs: Sequence[SizeCost]) -> tuple[bool, list[str]]:
    """(passed, what exceeded its bound, one line per finding)."""
    if not costs:
        return False, ["nothing measured"]
    found = []
    for c in costs:
        size = f"{c.shard_bytes / 1e9:.1f} GB"
        figures = (c.loop_ms, c.noise_ms, c.copy_added_ms, c.round_added_ms, c.host_ms)
        if not all(math.isfinite(x) for x in figures):
            found.append(f"{size}: a figure is not a finite number ({figures})")
            continue
        bound = COPY_FACTOR * max(c.copy_added_ms, 0.0) + c.noise_ms
        if c.round_added_ms > bound:
            found.append(
                f"{size}: the round adds {c.round_added_ms:.1f} ms of GPU time to the loop, over "
                f"{COPY_FACTOR:g} x the plain copy's {max(c.copy_added_ms, 0.0):.1f} ms + the "
                f"loop's noise {c.noise_ms:.1f} ms"
            )
        if c.host_ms > HOST_LIMIT_MS:
            found.append(
                f"{size}: start_round holds the host {c.host_ms:.1f} ms (limit {HOST_LIMIT_MS:g})"
            )
    return not found, found


def _round_times(
    shard_gb: float, group: Any, loop: Callable[[], None], rounds: int
) -> tuple[int, list[float], list[float]]:
    """(shard bytes, the loop's device time with a round started before it, the host time of
    each `start_round`), ms; the replicator's memory freed on return."""
    state = adam_state(int(shard_gb * 1e9) // 12)
    repl = replicator_of_one(state, group, "gpu")
    repl.start_round(1)  # warm-up: the round's allocations and communicator
    repl.before_step()
    repl.finish_round()
    torch.cuda.synchronize()
    host: list[float] = []
    with_round: list[float] = []
    for it in range(2, 2 + rounds):

        def step(it: int = it) -> None:
            t0 = time.perf_counter()
            repl.start_round(it)
            host.append(1000 * (time.perf_counter() - t0))
            loop()

        with_round += device_times_ms(step, 1)
        repl.before_step()
        repl.finish_round()
    shard_bytes = int(repl.sizes[0])
    repl.retire()
    torch.cuda.synchronize()
    return shard_bytes, with_round, host


def _copy_times(nbytes: int, loop: Callable[[], None], rounds: int) -> list[float]:
    """The loop's device time with a plain copy of `nbytes` started before it on a side stream
    (as the round's capture, the copy's end is not waited for; the replicator's own stream, so
    that both run on the same kind of stream), ms."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    side = own_stream(torch.device("cuda", torch.cuda.current_device()))

    def copied() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dst.copy_(src)
        loop()

    times = device_times_ms(copied, rounds)
    torch.cuda.synchronize()
    return times


def measure_size(shard_gb: float, group: Any, rounds: int = ROUNDS) -> SizeCost:
    """The figures of one shard size (CUDA; a world of one with `group` its NCCL group)."""
    loop = matmul_loop()
    loop()
    torch.cuda.synchronize()
    alone = device_times_ms(loop, rounds + 1)
    shard_bytes, with_round, host = _round_times(shard_gb, group, loop, rounds)
    gc.collect()  # the guarded optimizer's `step` refers to the optimizer: a cycle
    torch.cuda.empty_cache()
    with_copy = _copy_times(shard_bytes, loop, rounds)
    torch.cuda.empty_cache()
    return SizeCost(
        shard_bytes=shard_bytes,
        loop_ms=min(alone),
        noise_ms=max(alone) - min(alone),
        copy_added_ms=min(with_copy) - min(alone),
        round_added_ms=min(with_round) - min(alone),
        host_ms=statistics.median(host),
    )


def check(shards_gb: Sequence[float] = SHARDS_GB, judged: bool = True) -> Outcome:
    """The row: every shard size measured; judged (pass/FAIL) or only reported (info)."""
    import os

    import torch.distributed as dist

    from ...replication import pack
    from .base import world_of_one

    world_of_one()
    group = dist.new_group(backend="nccl")
    backend = pack.backend_for(torch.empty(1, device="cuda"))
    costs = [measure_size(gb, group) for gb in shards_gb]
    figures: dict[str, Any] = {
        "pack_backend": backend,
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "(unset)"),
        "shards": [
            {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(c).items()}
            for c in costs
        ],
    }
    if not judged:
        return {"status": "info", "figures": figures}
    ok, found = judge(costs)
    return {"status": "pass" if ok else "FAIL", "figures": figures, "note": "; ".join(found)}
