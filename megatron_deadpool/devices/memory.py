"""Where snapshots and replicas live: GPU memory or pinned host memory
(`--deadpool-replica-device`).

A rank keeps 2 (k + 1) shard-sized buffers (a double-buffered local snapshot and two slots per
owner it holds for). ``gpu`` and ``cpu`` (pinned host memory) are the user's choice; ``auto``
takes GPU memory when that fits (`fits_on_gpu`) and pinned host memory otherwise. The choice
must be the same on every rank - a GPU send is received on the GPU (NCCL), a host one on the
host (gloo) - so each rank's `local_choice` is agreed by the replication group (the
`Replicator` takes host memory when any rank must).

**The choice holds for the run.** A replicator built after a recovery takes over its
predecessor's buffers, and while it decides, those 2 (k + 1) buffers are still allocated: read
then, free memory would vote "host" on every survivor - and one such vote moves every rank to
pinned host memory for the rest of the run. So a rank that already holds buffers votes what it
holds (`decide`, ``previous``); only a rank without any (the first replicator, a newcomer)
reads free memory, counting what it could reuse as free (``reusable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
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


def decide(
    setting: Literal["auto", "cpu", "gpu"],
    kind: Literal["cpu", "cuda"],
    need: int,
    reading: tuple[int, int] | None,
    previous: Choice | None = None,
    reusable: int = 0,
) -> Choice:
    """One rank's vote (pure): host memory without CUDA or under ``cpu``, GPU memory under
    ``gpu``; under ``auto`` the memory its buffers already live in (`previous`: the choice holds
    for the run), else GPU memory when `need` bytes fit in `reading` = (free, total) with the
    `reusable` bytes of GPU buffers it would take over counted as free (`fits_on_gpu`)."""
    if kind == "cpu" or setting == "cpu":
        return "host"
    if setting == "gpu":
        return "gpu"
    if previous is not None:
        return previous
    if reading is None:
        raise ValueError("auto replica memory without a previous choice needs a memory reading")
    free, total = reading
    return "gpu" if fits_on_gpu(need, free + reusable, total) else "host"


@dataclass(frozen=True)
class ReplicaMemory:
    """The user's setting for a process on `device`, turned into concrete memory."""

    setting: Literal["auto", "cpu", "gpu"]
    device: Device
    segments: Path | None = None
    """Where host buffers live as files that outlive the process (`replication.segments`)."""

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

    def local_choice(
        self, need: int, *, previous: Choice | None = None, reusable: int = 0
    ) -> Choice:
        """This rank's choice for `need` bytes of buffers (`decide`; free memory is read only
        when it matters). `previous`: the memory this rank's buffers are in already;
        `reusable`: bytes of GPU buffers it would take over."""
        reading: tuple[int, int] | None = None
        if self.setting == "auto" and self.device.kind == "cuda" and previous is None:
            reading = torch.cuda.mem_get_info(self.device.index)
        return decide(self.setting, self.device.kind, need, reading, previous, reusable)

    def torch_device(self, choice: Choice) -> torch.device:
        return self.device.torch_device if choice == "gpu" else torch.device("cpu")

    def pinned(self, choice: Choice) -> bool:
        """Host buffers are pinned when a GPU copies into them."""
        return choice == "host" and self.device.kind == "cuda"
