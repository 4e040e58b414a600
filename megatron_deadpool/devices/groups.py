"""Which device a process group's tensors live on, and which backends DeadPool's groups use.

An NCCL-only group takes CUDA tensors only (a CPU tensor fails with "No backend type
associated with device type cpu"); a gloo group takes CPU tensors (and CUDA ones, staged
through the host). torch dispatches each collective on the tensor's device type to the
backend registered for it (`dist.get_backend_config(group)`, e.g. ``"cpu:gloo,cuda:nccl"``),
so a caller that allocates a tensor for a collective asks `tensor_device(group)` first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import DeadpoolRuntimeError
from .base import Device


def parse_backend_config(config: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> {"cpu": "gloo", "cuda": "nccl"}."""
    out: dict[str, str] = {}
    for part in config.split(","):
        dev, sep, name = part.partition(":")
        if sep:
            out[dev.strip()] = name.strip()
    return out


def backends(group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """device type -> backend name of `group` (default: WORLD), e.g. {"cpu": "gloo", ...}."""
    return parse_backend_config(str(dist.get_backend_config(group)))


def device_for(backends_of_group: dict[str, str]) -> str:
    """The device type for small tensors of a group with these backends: "cpu" when a backend
    handles CPU tensors (no device synchronisation to read them back), else "cuda"."""
    return "cpu" if "cpu" in backends_of_group else "cuda"


def tensor_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device for the small tensors a collective of `group` takes (sizes, flags, losses)
    (`device_for`; CUDA tensors go on the current device)."""
    if device_for(backends(group)) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def check_takes(group: dist.ProcessGroup, device: torch.device) -> None:
    """Raise when `group` has no backend for tensors on `device` (a configuration bug)."""
    known = backends(group)
    if device.type not in known:
        raise DeadpoolRuntimeError(
            f"process group with backends {known} cannot move tensors on {device}; create it "
            f"with devices.groups.replication_backend()"
        )


def replication_backend(device: Device) -> str:
    """Backend of DeadPool's replication group.

    CPU mode: gloo. CUDA: ``"cpu:gloo,cuda:nccl"`` - replicas in GPU memory travel over NCCL,
    replicas in pinned host memory over gloo, and the small size and verdict tensors over gloo
    without a device synchronisation; which memory replicas use is decided after the group
    exists (`devices.memory`), from the shard sizes the group itself exchanges.
    """
    return "gloo" if device.kind == "cpu" else "cpu:gloo,cuda:nccl"
