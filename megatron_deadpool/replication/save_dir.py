"""What a `--save` directory holds, and which of it a `--load` resumes from.

Megatron-LM's layout (`megatron/training/checkpointing.py`): one folder per saved iteration,
`ROOT/iter_0000005/`, and the marker `ROOT/latest_checkpointed_iteration.txt` naming the newest
complete one. Beside them DeadPool's snapshot sets, `ROOT/deadpool/iter_T/` (`snapshot_set.py`),
written when memory could not recover a failure. A `--load` resumes from whichever is newer.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError, ConfigError
from .snapshot_set import latest_complete

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's marker file: the iteration of the newest complete checkpoint."""


def iteration_dir(root: str | os.PathLike[str], iteration: int) -> Path:
    """`root/iter_{iteration:07d}`, Megatron-LM's directory of one saved iteration."""
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | os.PathLike[str]) -> int | None:
    """The iteration named by `root`'s marker file, or None when there is none (no checkpoint).

    Raises `CheckpointError` when the marker exists but is not an integer (Megatron-LM's
    'release' checkpoints are not training checkpoints and are refused here too).
    """
    path = Path(root) / TRACKER
    if not path.is_file():
        return None
    text = path.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(
            f"{path}: expected an iteration number, found {text[:40]!r}; point --load at a "
            "directory written by --save"
        ) from None


def resume_point(root: str | Path) -> tuple[str, int] | None:
    """('snapshots' | 'megatron', iteration) of the newest complete state under `root`."""
    options = []
    megatron = latest_iteration(root)
    if megatron is not None:
        options.append((megatron, "megatron"))
    snaps = latest_complete(root)
    if snaps is not None:
        options.append((snaps, "snapshots"))
    if not options:
        return None
    iteration, kind = max(options)
    return kind, iteration


def check_load(root: str | os.PathLike[str], *, save: str | None = None) -> None:
    """Refuse, before any process starts, a `--load` the ranks would fail on or silently
    ignore: a folder that does not exist (unless it is the `--save` folder as well: the first
    run of a job that saves and resumes in one place starts from iteration 1, as Megatron-LM
    does), a file, a marker that names no iteration or a missing iteration folder, a
    snapshot-set manifest that cannot be read."""
    path = Path(root)
    if not path.exists():
        if save is not None and path.absolute() == Path(save).absolute():
            return
        raise ConfigError(
            f"--load: {str(path)!r} does not exist; give the directory a run saved into with "
            "--save (or drop --load to start from iteration 1)"
        )
    if not path.is_dir():
        raise ConfigError(f"--load: {str(path)!r} is a file; give the directory --save wrote")
    try:
        point = resume_point(path)
    except (CheckpointError, OSError) as exc:
        raise ConfigError(f"--load: {exc}") from None
    if point is not None and point[0] == "megatron" and not iteration_dir(path, point[1]).is_dir():
        raise ConfigError(
            f"--load: {path / TRACKER} names iteration {point[1]}, but "
            f"{iteration_dir(path, point[1])} is missing; point --load at a complete --save "
            "directory"
        )
