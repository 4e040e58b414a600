"""The `Device` a process trains on (backend name, tensor device), chosen once per process.

The CPU development mode and the CUDA path share every line of DeadPool's logic; they differ
only in what this object answers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from ..errors import ConfigError
from .threads import note_device

Mode = Literal["auto", "cpu", "cuda"]


@dataclass(frozen=True)
class Device:
    """Where tensors, collectives and replicas of one process live."""

    kind: Literal["cpu", "cuda"]
    backend: Literal["gloo", "nccl"]
    index: int = 0

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device("cuda", self.index)


def real_cuda() -> bool:
    """Whether CUDA is really present: a CUDA build of torch, a device, and not the CPU mode's
    stand-in (which answers CUDA's questions with "yes", also on a CUDA build without a GPU)."""
    from .cpu import is_active

    return not is_active() and bool(torch.version.cuda) and torch.cuda.device_count() > 0


def active_device() -> Device:
    """The device this process already trains on (chosen by its job, e.g. Megatron-LM's
    start-up): the CPU development mode when it is active, else CUDA's current device when
    CUDA is really present (recorded as the device DeadPool's threads select, `devices.threads`),
    else the CPU."""
    if real_cuda():
        index = torch.cuda.current_device()
        note_device(index)  # DeadPool's threads select it (`devices.threads`)
        return Device(kind="cuda", backend="nccl", index=index)
    return Device(kind="cpu", backend="gloo")


def select_device(mode: Mode = "auto", local_rank: int | None = None) -> Device:
    """Pick CUDA when really present (and not refused), else activate the CPU mode.

    Also prepares the process's communication before any process group exists: DeadPool's
    NCCL settings (`devices.nccl.apply_settings`, CUDA only) and the record of gloo
    connections that `abort_groups` shuts down (`devices.gloo`). A CUDA device chosen is
    recorded as the one DeadPool's threads select (`devices.threads`).
    """
    if mode not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device: {mode!r} is not one of auto, cpu, cuda")
    if os.environ.get("DEADPOOL_DEVICE") in ("cpu", "cuda") and mode == "auto":
        mode = os.environ["DEADPOOL_DEVICE"]  # type: ignore[assignment]
    has_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if mode == "cuda" and not has_cuda:
        raise ConfigError("device: 'cuda' was asked for but no CUDA device is available")
    if mode == "cuda" or (mode == "auto" and has_cuda):
        index = local_rank if local_rank is not None else _local_rank()
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK={index}: this node has {torch.cuda.device_count()} GPUs; every "
                "active rank and every spare of a node needs a GPU of its own "
                "(devices.gpus.assign_gpus)"
            )
        prepare_communication("cuda")
        torch.cuda.set_device(index)
        note_device(index)  # DeadPool's threads select it (`devices.threads`)
        return Device(kind="cuda", backend="nccl", index=index)
    from .cpu import activate

    prepare_communication("cpu")
    activate()
    return Device(kind="cpu", backend="gloo")


def prepare_communication(kind: Literal["cpu", "cuda"]) -> None:
    """Before this process creates any process group: refuse settings that break recovery,
    apply DeadPool's NCCL settings (CUDA), record the gloo connections of every group from now
    on (what `abort_groups` shuts down), and on CPU make waits on gloo operations end once the
    groups were aborted (`gloo.interruptible_waits`). Idempotent."""
    from . import gloo, nccl

    gloo.check_settings()
    if kind == "cuda":
        nccl.apply_settings()
    else:
        gloo.interruptible_waits()
    gloo.track_connections()


def _local_rank() -> int:
    text = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    if not text.isdigit():
        raise ConfigError(f"LOCAL_RANK: expected a GPU index (0, 1, ...), got {text!r}")
    return int(text)
