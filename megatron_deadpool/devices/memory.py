"""Where snapshots and replicas live: GPU memory or pinned host memory
(`--deadpool-replica-device`).

A rank keeps 2 (k + 1) shard-sized buffers (a double-buffered local snapshot and two slots per
owner it holds for). ``gpu`` and ``cpu`` (pinned host memory) are the user's choice; ``auto``
takes GPU memory when that fits (`fits_on_gpu`) and pinned host memory otherwise. The choice
must be the same on every rank - a GPU send is received on the GPU (NCCL), a host one on the
host (gloo) - so each rank's `local_choice` is agreed by the replication group (the
`Replicator` takes host memory when any rank must).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..errors import ConfigError
from .base import Device

GIB = 1 << 30
HEADROOM_FRACTION = 0.05
"""Part of the device's memory `auto` leaves free for the allocator's fragmentation, NCCL's
buffers and a later iteration's peaks, on top of what is free when replicas are allocated."""
HEADROOM_MIN = 2 * GIB

Choice = Literal["gpu", "host"]


def fits_on_gpu(need: int, free: int, total: int) -> bool:
    """Whether `need` bytes of replicas fit in GPU memory with `free` of `total` bytes free.

    `free` is what the device has free right after the first optimizer step, when the caching
    allocator already holds the step's peak (its cached blocks are not counted as free: the
    next iteration's activations reuse them)."""
    headroom = max(HEADROOM_MIN, int(total * HEADROOM_FRACTION))
    return need + headroom <= free


@dataclass(frozen=True)
class ReplicaMemory:
    """The user's setting for a process on `device`, turned into concrete memory."""

    setting: Literal["auto", "cpu", "gpu"]
    device: Device

    def __post_init__(self) -> None:
        if self.setting not in ("auto", "cpu", "gpu"):
            raise ConfigError(
                f"deadpool-replica-device: {self.setting!r} is not one of auto, cpu, gpu"
            )
        if self.setting == "gpu" and self.device.kind != "cuda":
            raise ConfigError(
                "deadpool-replica-device: 'gpu' needs CUDA, which this process does not have; "
                "use 'cpu' or 'auto'"
            )

    def local_choice(self, need: int) -> Choice:
        """This rank's choice for `need` bytes of buffers (free memory read now for auto)."""
        if self.device.kind == "cpu" or self.setting == "cpu":
            return "host"
        if self.setting == "gpu":
            return "gpu"
        free, total = torch.cuda.mem_get_info(self.device.index)
        return "gpu" if fits_on_gpu(need, free, total) else "host"

    def torch_device(self, choice: Choice) -> torch.device:
        return self.device.torch_device if choice == "gpu" else torch.device("cpu")

    def pinned(self, choice: Choice) -> bool:
        """Host buffers are pinned when a GPU copies into them."""
        return choice == "host" and self.device.kind == "cuda"
