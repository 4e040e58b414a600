"""Which device a process group's tensors live on, and which backends DeadPool's groups use.

An NCCL-only group takes CUDA tensors only (a CPU tensor fails with "No backend type
associated with device type cpu"); a gloo group takes CPU tensors (and CUDA ones, staged
through the host). torch dispatches each collective on the tensor's device type to the
backend registered for it (`dist.get_backend_config(group)`, e.g. ``"cpu:gloo,cuda:nccl"``),
so a caller that allocates a tensor for a collective asks `tensor_device(group)` first.

DeadPool's replication groups, by device (`replication_backend`, `host_transfer_group`,
`verdict_ahead`):

- CPU mode: one gloo group over the world carries everything, and a round's verdict is agreed
  at once by a gloo all-reduce (`Replicator.finish_round`), as it always was.
- CUDA: no world-wide gloo group. The world-wide replication group is NCCL only (split from
  the world's communicator, no full mesh of TCP connections per generation); it carries GPU
  replicas, the sizes exchanged once per generation and the round's verdict - a one-element
  NCCL all-reduce posted asynchronously before the next optimizer step and read after it
  (`Replicator.before_step`), so no collective waits on the critical path. Replicas in pinned
  host memory travel over gloo inside each data-parallel group only (holders are data-
  parallel peers, `replication.placement`): `new_host_group` connects dp - 1 peers per rank,
  created by the group's members alone (``use_local_synchronization``), and only when
  `--deadpool-replica-device` allows host memory.
"""

from __future__ import annotations

import datetime

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
    """Backend of DeadPool's world-wide replication group: gloo in the CPU mode, NCCL only on
    CUDA (module docstring)."""
    return "gloo" if device.kind == "cpu" else "nccl"


def host_transfer_group(device: Device, setting: str) -> bool:
    """Whether replicas in host memory need a gloo group of their own (`new_host_group`): on
    CUDA, unless `--deadpool-replica-device` is ``gpu``. (The CPU mode's world group is gloo.)"""
    return device.kind == "cuda" and setting != "gpu"


def verdict_ahead(device: Device) -> bool:
    """Whether a round's verdict is agreed asynchronously (posted before the next optimizer
    step on the NCCL group, read after it) rather than by a blocking all-reduce: on CUDA."""
    return device.kind == "cuda"


def new_host_group(ranks: list[int], timeout: datetime.timedelta) -> dist.ProcessGroup:
    """The gloo group of this rank's data-parallel peers (`ranks`, this rank among them) for
    replicas in host memory; created by those ranks only (``use_local_synchronization``: its
    name is a hash of its ranks, no world-wide step)."""
    return dist.new_group(
        sorted(ranks), timeout=timeout, backend="gloo", use_local_synchronization=True
    )
