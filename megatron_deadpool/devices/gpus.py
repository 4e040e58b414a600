"""Which GPU each local process of a node uses: actives first, then the spares (pure).

Two NCCL ranks of one communicator cannot share a GPU, and a spare that takes a dead rank's
slot joins the same communicators, so every spare needs a GPU of its own, set aside at
launch. A local launcher starting `actives` active ranks and `spares` spares on a node with
`gpus` devices gives task i (actives 0..actives-1, spares after them) ``LOCAL_RANK = i``,
which `devices.select_device` turns into ``cuda:i``. On a cluster each node runs its own
tasks (spare nodes only spares), so ``SLURM_LOCALID`` already is that index.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class GpuAssignment:
    """Local GPU index of every active rank and every spare of one node."""

    actives: tuple[int, ...]
    spares: tuple[int, ...]

    def local_rank(self, task: int) -> int:
        """LOCAL_RANK of local task `task` (actives first, then spares)."""
        return (*self.actives, *self.spares)[task]


def assign_gpus(*, actives: int, spares: int, gpus: int | None) -> GpuAssignment:
    """GPU per local process; `gpus` None means the CPU development mode (indices are then
    only LOCAL_RANK values). Raises `ConfigError` when the node has too few GPUs."""
    for name, value in (("active ranks", actives), ("spares", spares)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name}: expected a count >= 0, got {value!r}")
    if actives < 1:
        raise ConfigError("active ranks: a node needs at least one active rank to launch")
    if gpus is not None and actives + spares > gpus:
        raise ConfigError(
            f"{actives} active ranks + {spares} spares need {actives + spares} GPUs, this node "
            f"has {gpus}: a spare needs a GPU of its own (two NCCL ranks cannot share one); "
            f"use --nproc {max(gpus - spares, 1)} with {spares} spares, fewer spares, or spares "
            "on another node"
        )
    return GpuAssignment(
        actives=tuple(range(actives)), spares=tuple(range(actives, actives + spares))
    )


def local_gpu_count() -> int | None:
    """GPUs the processes a local launcher starts will use; None when they run in the CPU
    development mode (no CUDA device, or ``DEADPOOL_DEVICE=cpu``)."""
    import os

    import torch

    if os.environ.get("DEADPOOL_DEVICE") == "cpu":
        return None
    if not (torch.cuda.is_available() and torch.cuda.device_count() > 0):
        return None
    return torch.cuda.device_count()
