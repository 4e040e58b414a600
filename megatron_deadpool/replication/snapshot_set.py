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

Every file is written durably (`durable.write_durably`: fsynced, renamed, folder fsynced), so a
set whose manifest says complete was on disk when it said so. A reader trusts none of it: it
checks a rank file's header and sizes before it allocates anything (`read_flat`), and a set's
files against their headers and checksums before a resume picks it (`set_problem`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from ..durable import write_durably
from ..errors import CheckpointError
from .snapshot import HEADER_BYTES, CorruptReplicaError, Header, parse_header, size_problem, verify

SUBDIR = "deadpool"


def set_dir(root: str | Path, iteration: int) -> Path:
    """The directory of the snapshot set of `iteration`."""
    return Path(root) / SUBDIR / f"iter_{iteration:07d}"


def rank_file(root: str | Path, iteration: int, rank: int) -> Path:
    """The file of `rank`'s flat snapshot in the set of `iteration`."""
    return set_dir(root, iteration) / f"rank_{rank:05d}.snap"


def write_flat(path: Path, flat: torch.Tensor) -> None:
    """Write one flat snapshot (payload and header) atomically and durably (two holders may
    write the same copy: each through its own temporary file)."""
    data = flat.detach().cpu().contiguous().numpy()

    def write(out: BinaryIO) -> None:
        out.write(data.data)  # the array's own buffer: no copy

    write_durably(path, write)


def file_header(path: Path, *, owner: int | None = None, iteration: int | None = None) -> Header:
    """The header of the flat snapshot in `path`, checked against the file's size (and the
    expected owner and iteration, when given) without reading more than the header; raises
    `CorruptReplicaError` (or `OSError`: no such file) saying what is wrong."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < HEADER_BYTES:
            raise CorruptReplicaError(f"{path.name}: truncated ({size} B, no header)")
        f.seek(size - HEADER_BYTES)
        header = parse_header(f.read(HEADER_BYTES))
    if header is None:
        raise CorruptReplicaError(f"{path.name}: snapshot header missing or damaged")
    problem = size_problem(header, size)
    if problem:
        raise CorruptReplicaError(f"{path.name}: {problem} (truncated or damaged)")
    if owner not in (None, header.owner) or iteration not in (None, header.iteration):
        raise CorruptReplicaError(
            f"{path.name}: holds rank {header.owner}'s snapshot of iteration {header.iteration}, "
            f"expected rank {owner}'s of {iteration}"
        )
    return header


def read_flat(
    path: Path, *, owner: int | None = None, iteration: int | None = None
) -> torch.Tensor:
    """Read a flat snapshot written by `write_flat`: its header and sizes are checked first
    (`file_header`), so a damaged or crafted header never sizes an allocation."""
    header = file_header(path, owner=owner, iteration=iteration)
    data = np.fromfile(path, dtype=np.uint8, count=header.nbytes + HEADER_BYTES)
    if data.size != header.nbytes + HEADER_BYTES:
        raise CorruptReplicaError(f"{path.name}: shrank while it was read")
    return torch.from_numpy(data)


def rank_problem(root: str | Path, iteration: int, rank: int, *, checksum: bool) -> str | None:
    """Why `rank`'s file of the set of `iteration` cannot be resumed from (None: it can): no
    file, a header that does not fit it, and with `checksum` a payload that fails it."""
    path = rank_file(root, iteration, rank)
    try:
        if checksum:
            verify(
                read_flat(path, owner=rank, iteration=iteration), owner=rank, iteration=iteration
            )
        else:
            file_header(path, owner=rank, iteration=iteration)
    except CorruptReplicaError as exc:
        return str(exc) if str(exc).startswith(path.name) else f"{path.name}: {exc}"
    except OSError as exc:
        return f"{path.name}: {exc.strerror or exc}"
    return None


def set_problem(root: str | Path, iteration: int, *, checksums: bool) -> str | None:
    """Why the complete set of `iteration` cannot be resumed from (None: it can): a manifest
    without a world size, any rank's file missing or not fitting its header, and with
    `checksums` any file failing its checksum. The first problem found."""
    try:
        world = read_manifest(root, iteration).get("world_size")
    except (OSError, ValueError, AttributeError):
        return "manifest.json unreadable"
    if isinstance(world, bool) or not isinstance(world, int) or not 0 < world < 1 << 20:
        return f"manifest.json: world_size {world!r} is not a rank count"
    for rank in range(world):  # every header first: a truncated set costs no checksum
        problem = rank_problem(root, iteration, rank, checksum=False)
        if problem:
            return problem
    for rank in range(world) if checksums else ():
        problem = rank_problem(root, iteration, rank, checksum=True)
        if problem:
            return problem
    return None


def ranks_present(root: str | Path, iteration: int) -> list[int]:
    """The ranks whose snapshot of `iteration` is on disk."""
    return sorted(int(p.stem.split("_")[1]) for p in set_dir(root, iteration).glob("rank_*.snap"))


def read_manifest(root: str | Path, iteration: int) -> dict[str, Any]:
    """The manifest of the snapshot set of `iteration`."""
    return json.loads((set_dir(root, iteration) / "manifest.json").read_text())


def write_manifest(root: str | Path, manifest: dict[str, Any]) -> Path:
    """The set's manifest, replaced atomically and durably (a complete one makes the set a
    checkpoint)."""
    path = set_dir(root, manifest["iteration"]) / "manifest.json"
    return write_durably(path, json.dumps(manifest, indent=1).encode())


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


def complete_sets(root: str | Path) -> list[int]:
    """Iterations of the snapshot sets under `root` whose manifest says complete, newest first
    (what the manifests say: `set_problem` checks the files)."""
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
    return sorted(complete, reverse=True)


def unfinished_sets(root: str | Path) -> dict[int, int | None]:
    """The sets under `root` whose rank files are more than their manifest says: no manifest
    (or one that cannot be read) while rank files are there - every writer ended before
    writing it - or a manifest saying incomplete that lists fewer ranks than are on disk (its
    last writer ended before looking again). Iteration -> the world size the manifest names
    (None: no manifest to say it). A `--load` completes or refuses these (`save_dir`)."""
    out: dict[int, int | None] = {}
    for folder in (Path(root) / SUBDIR).glob("iter_*"):
        try:
            iteration = int(folder.name[len("iter_") :])
        except ValueError:
            continue
        present = ranks_present(root, iteration)
        if not present:
            continue
        try:
            manifest = read_manifest(root, iteration)
            world, listed = manifest.get("world_size"), manifest.get("ranks_present")
        except (OSError, ValueError, AttributeError):
            out[iteration] = None
            continue
        if not manifest.get("complete") and isinstance(listed, list) and present != listed:
            out[iteration] = (
                world if isinstance(world, int) and not isinstance(world, bool) else None
            )
    return out


def latest_complete(root: str | Path) -> int | None:
    """Iteration of the newest snapshot set under `root` whose manifest says complete, if any."""
    complete = complete_sets(root)
    return complete[0] if complete else None
