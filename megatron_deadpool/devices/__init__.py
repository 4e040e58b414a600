"""Device back-ends: the CPU development mode (gloo) and the CUDA/NCCL path.

`select_device(mode)` decides once per process: CUDA when it is really present (unless the
CPU mode is asked for), the CPU development mode otherwise. Every device- or backend-specific
decision lives here, one concern per module:

- `base`: the `Device`, `select_device`, `prepare_communication` (settings before any group);
- `cpu`: the CPU development mode (Megatron's CUDA assumptions redirected);
- `nccl`: NCCL settings, communicators per generation (split or warm), aborting every
  group's communicators together, the backends' error state;
- `gloo`: unblocking gloo collectives with a dead or stopped peer (connections shut down);
- `abort`: `abort_groups`, both of the above, on a thread of its own and bounded in time;
- `health`: whether this process's GPU still completes its steps' work;
- `groups`: which device a group's tensors use; the replication groups' backends;
- `p2p`: one batched call per round of point-to-point transfers;
- `memory`: GPU or pinned host memory for replicas (the vote);
- `pinned`: replica buffers, page-locked host memory of the exact size;
- `gpus`: the GPU of every local active rank and spare;
- `failures`: `is_peer_failure`, a peer's failure versus any other error;
- `threads`: every thread DeadPool starts, each on the rank's GPU (`device_threads`);
- `streams`: the replication side stream, DeadPool's own, not one of torch's pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Device, active_device, select_device

__all__ = ["Device", "active_device", "select_device"]


def __getattr__(name: str) -> Any:
    """`Device`, `active_device`, `select_device` from `base`, imported on first use: the
    modules that need no torch (`threads`, which a launcher's and a coordinator's threads
    start through) are imported without it."""
    if name in __all__:
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
