"""Small, valid flat snapshots (payload + DeadPool header) for tests of snapshot sets on disk,
and a way to write whole sets of them."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_deadpool.replication import pack, snapshot_set
from megatron_deadpool.replication.snapshot import HEADER_BYTES, Header


def flat(owner: int, iteration: int, nbytes: int = 256) -> torch.Tensor:
    """A flat snapshot of `nbytes` payload bytes (a multiple of 4) that passes `verify`."""
    payload = (torch.arange(nbytes, dtype=torch.int64) * (owner + 3) + iteration).to(torch.uint8)
    header = Header(
        owner=owner,
        iteration=iteration,
        nbytes=nbytes,
        checksum=pack.checksum(payload),
        meta_nbytes=nbytes // 2,
    )
    raw = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
    out = torch.cat([payload, raw])
    assert out.numel() == nbytes + HEADER_BYTES
    return out


def write_set(root: Path, iteration: int, world: int, **fields: object) -> None:
    """A complete snapshot set of `iteration` for `world` ranks, with its manifest."""
    for rank in range(world):
        snapshot_set.write_flat(
            snapshot_set.rank_file(root, iteration, rank), flat(rank, iteration)
        )
    snapshot_set.publish_manifest(root, iteration, world, dict(fields))
