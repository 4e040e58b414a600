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
reads free memory, counting what it could reuse as free (``reusable``). And a newcomer's vote
does not move the run: where any rank holds buffers already (the survivors of a recovery), the
agreed choice is what they hold (`Tally.choice`); free memory decides only when no rank holds
any (the first replicator).

**Host replicas still take GPU memory.** A capture of GPU state into host memory packs into a
GPU staging buffer of the snapshot's size and copies that to the pinned slot
(`Snapshotter.capture`). So ``auto`` takes host memory only where that staging buffer fits
(with the same headroom); where neither fits, every rank refuses at construction with one
message (`ReplicaMemoryError`) instead of the first capture running out of memory mid-run.
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


class ReplicaMemoryError(ConfigError):
    """Neither GPU replicas nor the GPU staging buffer of host replicas fit in GPU memory."""


def fits_on_gpu(need: int, free: int, total: int) -> bool:
    """Whether `need` bytes of replicas fit in GPU memory with `free` of `total` bytes free.

    `free` is what the device has free right after the first optimizer step, when the caching
    allocator already holds the step's peak (its cached blocks are not counted as free: the
    next iteration's activations reuse them)."""
    return need + headroom(total) <= free


def decide(
    setting: Literal["auto", "cpu", "gpu"],
    kind: Literal["cpu", "cuda"],
    need: int,
    reading: tuple[int, int] | None,
    previous: Choice | None = None,
    reusable: int = 0,
    staging: int = 0,
) -> Choice:
    """One rank's vote (pure): host memory without CUDA or under ``cpu``, GPU memory under
    ``gpu``; under ``auto`` the memory its buffers already live in (`previous`: the choice holds
    for the run), else GPU memory when `need` bytes fit in `reading` = (free, total) with the
    `reusable` bytes of GPU buffers it would take over counted as free (`fits_on_gpu`), else
    host memory - whose captures still need `staging` bytes of GPU memory (the staging buffer
    of GPU state, module docstring): when those do not fit either, `ReplicaMemoryError`."""
    if kind == "cpu" or setting == "cpu":
        return "host"
    if setting == "gpu":
        return "gpu"
    if previous is not None:
        return previous
    if reading is None:
        raise ValueError("auto replica memory without a previous choice needs a memory reading")
    free, total = reading
    if fits_on_gpu(need, free + reusable, total):
        return "gpu"
    if staging and not fits_on_gpu(staging, free + reusable, total):
        raise ReplicaMemoryError(
            f"deadpool-replica-device auto: GPU replicas need {need} B and host replicas a GPU "
            f"staging buffer of {staging} B (the snapshot's size), but only {free + reusable} B "
            f"of {total} B are free with {headroom(total)} B kept as headroom: give each rank "
            "a smaller shard (a larger data-parallel size) or free GPU memory"
        )
    return "host"


def headroom(total: int) -> int:
    """Bytes `fits_on_gpu` keeps free on a device of `total` bytes."""
    return max(HEADROOM_MIN, int(total * HEADROOM_FRACTION))


@dataclass(frozen=True)
class Tally:
    """Every rank's vote, summed over the replication group (one all-reduce of `counts`).

    The agreed `choice`: where any rank holds buffers already (a survivor of a recovery), the
    memory they are in - the choice holds for the run, and a newcomer adopts it whatever its
    own free memory says; else host memory if any rank voted for it (a GPU send is received on
    the GPU, a host one on the host: all ranks must agree)."""

    fresh_host: int = 0
    """Ranks without buffers voting for host memory."""
    held_host: int = 0
    """Ranks whose buffers are in host memory."""
    held_gpu: int = 0
    """Ranks whose buffers are in GPU memory."""
    short: int = 0
    """Ranks where not even host replicas' GPU staging buffer fits (`ReplicaMemoryError`)."""

    @staticmethod
    def of(vote: Choice, held: bool, short: bool = False) -> Tally:
        """One rank's part: its `vote`, whether it `held` buffers in that memory already."""
        return Tally(
            fresh_host=int(not held and vote == "host"),
            held_host=int(held and vote == "host"),
            held_gpu=int(held and vote == "gpu"),
            short=int(short),
        )

    def counts(self) -> list[int]:
        """The four counts, to be summed over the ranks."""
        return [self.fresh_host, self.held_host, self.held_gpu, self.short]

    @staticmethod
    def from_counts(counts: list[int]) -> Tally:
        """Inverse of `counts` (of the sum)."""
        fresh_host, held_host, held_gpu, short = counts
        return Tally(fresh_host, held_host, held_gpu, short)

    def choice(self) -> Choice:
        if self.held_host or self.held_gpu:
            return "host" if self.held_host else "gpu"
        return "host" if self.fresh_host else "gpu"


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
        self, need: int, *, previous: Choice | None = None, reusable: int = 0, staging: int = 0
    ) -> Choice:
        """This rank's choice for `need` bytes of buffers (`decide`; free memory is read only
        when it matters). `previous`: the memory this rank's buffers are in already;
        `reusable`: bytes of GPU buffers it would take over; `staging`: GPU bytes host
        replicas would still need (raises `ReplicaMemoryError` when neither fits)."""
        reading: tuple[int, int] | None = None
        if self.setting == "auto" and self.device.kind == "cuda" and previous is None:
            reading = torch.cuda.mem_get_info(self.device.index)
        return decide(self.setting, self.device.kind, need, reading, previous, reusable, staging)

    def torch_device(self, choice: Choice) -> torch.device:
        return self.device.torch_device if choice == "gpu" else torch.device("cpu")

    def pinned(self, choice: Choice) -> bool:
        """Host buffers are pinned when a GPU copies into them."""
        return choice == "host" and self.device.kind == "cuda"
