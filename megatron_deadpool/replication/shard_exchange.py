"""A recovery's shard transfers: every needy rank receives its snapshot of T from its holder.

Two steps on the (new generation's) replication group, taken by every rank of the roster:

1. one all-reduce of a small table - for each needy rank, the size of its snapshot and
   whether its holder keeps it in GPU memory - so that the receiver allocates the right
   buffer on the device the holder sends from (on CUDA a GPU tensor travels over the NCCL
   replication group and a host tensor over the data-parallel peers' gloo group,
   `devices.groups`: both ends must agree). Being a collective of the whole group, it is also
   the group's first operation, which NCCL's batched point-to-point calls require
   (`devices.p2p`);
2. one batched round of point-to-point transfers per device (`devices.p2p.post`): holders
   send, needy ranks receive.

The holders restore their own snapshot while the transfers run (`PendingShards.wait` after).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..devices.groups import tensor_device
from ..devices.p2p import Transfer, post


@dataclass
class PendingShards:
    """The transfers of `start_shard_exchange`, in flight."""

    received: torch.Tensor | None
    """This rank's snapshot, when it receives one (complete after `wait`)."""
    works: list[dist.Work]

    def wait(self) -> torch.Tensor | None:
        """Wait for this rank's sends and its receive; returns what it received. (On NCCL the
        current stream waits: work queued after this reads complete bytes and may overwrite
        the sent buffers.) Idempotent: a gloo receive waited on twice would wait for a second
        message."""
        works, self.works = self.works, []
        for work in {id(w): w for w in works}.values():
            work.wait()
        return self.received


def start_shard_exchange(
    group: dist.ProcessGroup,
    *,
    rank: int,
    world_size: int,
    sends: dict[int, torch.Tensor],
    source: int | None,
    gpu: torch.device | None = None,
    host_group: dist.ProcessGroup | None = None,
) -> PendingShards:
    """Post this rank's part of the exchange: `sends` maps needy rank -> the flat snapshot
    this rank holds for it; `source` is the holder this rank receives from (None: it
    receives nothing). `gpu` is this process's CUDA device (None on the CPU); `host_group`:
    where host tensors travel when not on `group` (CUDA)."""
    table = torch.zeros(2 * world_size, dtype=torch.int64, device=tensor_device(group))
    for target, flat in sends.items():
        table[2 * target] = flat.numel()
        table[2 * target + 1] = int(flat.device.type == "cuda")
    dist.all_reduce(table, group=group)
    nbytes, on_gpu = table[2 * rank : 2 * rank + 2].tolist()
    received = None
    transfers = [Transfer("send", flat, target) for target, flat in sends.items()]
    if source is not None:
        device = gpu if on_gpu else torch.device("cpu")
        if device is None:
            raise RuntimeError(
                f"rank {rank}: holder {source} sends from a GPU, this process has none"
            )
        received = torch.empty(nbytes, dtype=torch.uint8, device=device)
        transfers.append(Transfer("recv", received, source))
    by_device: dict[torch.device, list[Transfer]] = {}
    for transfer in transfers:
        by_device.setdefault(transfer.tensor.device, []).append(transfer)
    works = [
        w
        for device, batch in by_device.items()
        for w in post(batch, host_group if device.type == "cpu" and host_group else group)
    ]
    return PendingShards(received, works)
