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
- `failures`: `is_peer_failure`, a peer's failure versus any other error.
"""

from __future__ import annotations

from .base import Device, active_device, select_device

__all__ = ["Device", "active_device", "select_device"]
