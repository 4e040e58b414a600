"""Snapshots and replicas in memory that outlives the process: a node's segment files.

A node's agent - the launcher (`hotswap.launch.local_job.LocalJob`) for each node it simulates - gives
every process it starts on that node a folder in a memory file system (`ENV`, e.g.
``/dev/shm/deadpool-XXXX/node1``). A replicator whose process has one keeps its slots in host
memory there, one file per slot, named by the rank the process holds, the owner of the shard
and the slot (`slot_path`), instead of in anonymous memory: rounds capture and receive directly
into them, so there is no second copy. When the process dies the files stay. The process its
node's agent starts in its place for the same rank (an in-place respawn) reads, before the
coordinator decides the recovery, what they hold verified (`SegmentHoldings`, every copy
checked against its checksum, as survivors check theirs) and reports it like a survivor: its
own snapshot restores it without a transfer, and the replicas it held still count - a rank and
the holder of its replica that die together on two live nodes lose nothing. When a node is lost
its folder goes with it (the agent deletes it), and its ranks' replacements start from peers'
replicas as before.

Only host memory: replicas in GPU memory die with their process. Files of another size than
the one asked for (another layout) are replaced, never read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..devices.pinned import buffer
from .snapshot import CorruptReplicaError, verify

ENV = "DEADPOOL_SEGMENTS"
"""The folder of this process's node, set by its node's agent (none: anonymous memory)."""

_NAME = re.compile(r"r(\d+)-o(\d+)-s([01])\.(\d+)")


def folder() -> Path | None:
    """This process's segment folder, if its node's agent gave it one."""
    value = os.environ.get(ENV)
    return Path(value) if value else None


def slot_path(where: Path, rank: int, owner: int, slot: int, nbytes: int) -> Path:
    """The file of slot `slot` of `owner`'s shard held by the process of rank `rank`; other
    sizes of the same slot are removed (a file is read only at the size it was made for)."""
    for old in where.glob(f"r{rank}-o{owner}-s{slot}.*"):
        if old.name != f"r{rank}-o{owner}-s{slot}.{nbytes}":
            old.unlink(missing_ok=True)
    return where / f"r{rank}-o{owner}-s{slot}.{nbytes}"


def slot_paths(where: Path, rank: int, owner: int, nbytes: int) -> tuple[Path, Path]:
    return slot_path(where, rank, owner, 0, nbytes), slot_path(where, rank, owner, 1, nbytes)


class SegmentHoldings:
    """What the segment files of rank `rank` on this node hold, verified: the snapshots of a
    process that died, for the one its node's agent started in its place."""

    def __init__(self, where: Path, rank: int) -> None:
        self.rank = rank
        self.copies: dict[int, dict[int, torch.Tensor]] = {}  # owner -> iteration -> flat
        for path in sorted(where.glob(f"r{rank}-o*-s*.*")):
            match = _NAME.fullmatch(path.name)
            if match is None or path.stat().st_size == 0:
                continue
            owner, nbytes = int(match[2]), int(match[4])
            flat = buffer(nbytes, torch.device("cpu"), pinned=False, path=path)
            try:
                header = verify(flat, owner=owner)
            except CorruptReplicaError:  # a slot being written when its process died
                continue
            self.copies.setdefault(owner, {})[header.iteration] = flat

    def holdings(self) -> dict[str, list[int]]:
        """As `Replicator.holdings`: "local" (this rank's own) and each held owner's."""
        out = {"local": sorted(self.copies.get(self.rank, {}))}
        out.update(
            {str(o): sorted(its) for o, its in self.copies.items() if o != self.rank and its}
        )
        return out

    def verified_copy(self, owner: int, iteration: int) -> torch.Tensor | None:
        return self.copies.get(owner, {}).get(iteration)
