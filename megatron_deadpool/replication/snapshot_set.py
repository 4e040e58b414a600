"""What survives a failure memory cannot recover, written to disk and read back.

When no spare is left, or an owner and every holder of its shard died together, the run must
stop. Before it does, every survivor writes the flat snapshots it has of one common iteration
T - its own, and those it holds for dead ranks - under `SAVE/deadpool/iter_T/`, plus a
manifest naming what is present and what was lost. A complete set (every rank's shard) is a
checkpoint: `--load SAVE` resumes from it exactly (each rank restores its flat snapshot,
checksum-verified). An incomplete set is kept for inspection, and `--load` resumes from the
last complete checkpoint instead (a Megatron checkpoint written by `--save-interval`).
With no coordinator left to pick T and the writers, each survivor writes every iteration it
holds, and the manifests are kept true by whoever writes last (`publish_manifest`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError

SUBDIR = "deadpool"


def set_dir(root: str | Path, iteration: int) -> Path:
    """The directory of the snapshot set of `iteration`."""
    return Path(root) / SUBDIR / f"iter_{iteration:07d}"


def rank_file(root: str | Path, iteration: int, rank: int) -> Path:
    return set_dir(root, iteration) / f"rank_{rank:05d}.snap"


def write_flat(path: Path, flat: torch.Tensor) -> None:
    """Write one flat snapshot (payload and header) atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two holders may write the same copy
    flat.detach().cpu().numpy().tofile(tmp)
    os.replace(tmp, path)


def read_flat(path: Path) -> torch.Tensor:
    """Read a flat snapshot written by `write_flat`."""
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


def ranks_present(root: str | Path, iteration: int) -> list[int]:
    """The ranks whose snapshot of `iteration` is on disk."""
    return sorted(int(p.stem.split("_")[1]) for p in set_dir(root, iteration).glob("rank_*.snap"))


def read_manifest(root: str | Path, iteration: int) -> dict[str, Any]:
    """The manifest of the snapshot set of `iteration`."""
    return json.loads((set_dir(root, iteration) / "manifest.json").read_text())


def write_manifest(root: str | Path, manifest: dict[str, Any]) -> Path:
    """The set's manifest, replaced atomically (a complete one makes the set a checkpoint)."""
    path = set_dir(root, manifest["iteration"]) / "manifest.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path)
    return path


def publish_manifest(
    root: str | Path, iteration: int, world_size: int, fields: dict[str, Any]
) -> dict[str, Any]:
    """Write the manifest of `iteration`'s set from the rank files on disk, when survivors
    write their parts with nobody to say who is last (the coordinator is gone): each writes
    what it sees, then looks again and writes again if more appeared. The manifest that stays
    is one written after every rank file that preceded it, so the set is marked complete as
    soon as it is."""
    while True:
        present = ranks_present(root, iteration)
        manifest = {
            "iteration": iteration,
            "complete": present == list(range(world_size)),
            "world_size": world_size,
            "ranks_present": present,
            "ranks_missing": sorted(set(range(world_size)) - set(present)),
            **fields,
        }
        write_manifest(root, manifest)
        if ranks_present(root, iteration) == present:
            return manifest


def latest_complete(root: str | Path) -> int | None:
    """Iteration of the newest complete snapshot set under `root`, if any."""
    complete = []
    for path in (Path(root) / SUBDIR).glob("iter_*/manifest.json"):
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        iteration = manifest.get("iteration") if isinstance(manifest, dict) else None
        if isinstance(iteration, bool) or not isinstance(iteration, int):
            raise CheckpointError(
                f"{path}: not a snapshot-set manifest (no iteration number); remove its folder "
                "or point --load at a directory written by --save"
            )
        if manifest.get("complete"):
            complete.append(iteration)
    return max(complete, default=None)
