"""What a `--save` directory holds, and which of it a `--load` resumes from.

Megatron-LM's layout (`megatron/training/checkpointing.py`): one folder per saved iteration,
`ROOT/iter_0000005/`, and the marker `ROOT/latest_checkpointed_iteration.txt` naming the newest
complete one. Beside them DeadPool's snapshot sets, `ROOT/deadpool/iter_T/` (`snapshot_set.py`),
written when memory could not recover a failure. A `--load` resumes from whichever is newer,
once it verified it: a set whose files do not match their headers and checksums (truncated by
a node lost while it was written, damaged since) is passed over for the next newest set or
Megatron checkpoint, and `choose_resume` says so in one line (`Resume.fallback`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..devices.groups import tensor_device
from ..durable import write_durably
from ..errors import CheckpointError, ConfigError
from . import snapshot_set

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's marker file: the iteration of the newest complete checkpoint."""


def iteration_dir(root: str | os.PathLike[str], iteration: int) -> Path:
    """`root/iter_{iteration:07d}`, Megatron-LM's directory of one saved iteration."""
    return Path(root) / f"iter_{iteration:07d}"


def write_tracker(root: str | os.PathLike[str], iteration: int) -> Path:
    """Name `iteration` in `root`'s marker file, atomically and durably (readers see the old
    or the new marker, never half of one, and it names only an iteration already written)."""
    return write_durably(Path(root) / TRACKER, f"{iteration}\n".encode())


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


Agree = Callable[[bool], bool]
"""This rank's verdict on a snapshot set (True: its own file verified) -> every rank's (True:
each rank's did); a collective over the world, called the same number of times on every rank."""


def world_agrees(ok: bool) -> bool:
    """`Agree` over the default group: whether `ok` holds on every rank (one all-reduce)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=tensor_device())
    dist.all_reduce(flag)
    return int(flag.item()) == 0


@dataclass(frozen=True)
class Resume:
    """Where a `--load` resumes: ('snapshots' | 'megatron', iteration), or nothing at all
    (`kind` None), and the newer snapshot sets passed over, each with why."""

    kind: str | None
    iteration: int
    passed_over: tuple[str, ...] = ()

    def point(self) -> tuple[str, int] | None:
        return None if self.kind is None else (self.kind, self.iteration)

    def fallback(self, root: str | Path) -> str | None:
        """The one line saying which newer sets were passed over and what is resumed instead
        (None: nothing was passed over)."""
        if not self.passed_over:
            return None
        instead = {
            "snapshots": f"the snapshot set of iteration {self.iteration}",
            "megatron": f"the Megatron checkpoint of iteration {self.iteration}",
            None: "iteration 1 (nothing older to resume from)",
        }[self.kind]
        return f"--load {root}: passed over {'; '.join(self.passed_over)}; resuming from {instead}"


def choose_resume(
    root: str | Path,
    *,
    rank: int | None = None,
    agree: Agree | None = None,
    world_size: int | None = None,
) -> Resume:
    """The newest verified state under `root` (`Resume`).

    One process deciding for the job (the launcher; `rank` None) checks every file of a
    candidate set: header, sizes and checksum. The ranks of a world deciding together (`rank`
    and `agree`) check every file's header and sizes (the same answer on every rank), their own
    file's checksum, and `agree` on it: every rank picks the same set, and the answer is the
    launcher's, though each rank reads only its own file in full. A Megatron checkpoint is
    taken as its marker names it (`check_load` refuses one whose folder is missing).

    A set newer than every other state there whose manifest is missing or behind its files
    (`snapshot_set.unfinished_sets`: its writers ended before finishing it) is never skipped
    for an older state: one process deciding for a job of `world_size` ranks completes its
    manifest when every rank's file is there and verifies (`finish_set`), else - and always
    for the ranks of a world - `CheckpointError` says what is missing.
    """
    options: list[tuple[int, str]] = [(t, "snapshots") for t in snapshot_set.complete_sets(root)]
    megatron = latest_iteration(root)
    if megatron is not None:
        options.append((megatron, "megatron"))
    newest = max((t for t, _ in options), default=-1)
    for t, world in sorted(snapshot_set.unfinished_sets(root).items(), reverse=True):
        if t <= newest:
            continue  # an older save than what is resumed: kept for inspection, as incomplete
        if rank is None and finish_set(root, t, world or world_size):
            options.append((t, "snapshots"))
            break
        raise CheckpointError(unfinished_line(root, t, world or world_size))
    passed: list[str] = []
    for iteration, kind in sorted(options, reverse=True):
        if kind == "megatron":
            return Resume(kind, iteration, tuple(passed))
        problem = snapshot_set.set_problem(root, iteration, checksums=rank is None)
        if problem is None and rank is not None and agree is not None:
            own = snapshot_set.rank_problem(root, iteration, rank, checksum=True)
            if not agree(own is None):
                problem = own or "another rank's file failed its checksum"
        if problem is None:
            return Resume(kind, iteration, tuple(passed))
        passed.append(
            f"the damaged snapshot set {snapshot_set.set_dir(root, iteration)} ({problem})"
        )
    return Resume(None, 0, tuple(passed))


def finish_set(root: str | Path, iteration: int, world_size: int | None) -> bool:
    """Write the manifest of `iteration`'s set from the rank files on disk when every one of
    `world_size` ranks' files is there and passes its header and checksum; whether it did."""
    if world_size is None or snapshot_set.ranks_present(root, iteration) != list(range(world_size)):
        return False
    if any(snapshot_set.rank_problem(root, iteration, r, checksum=True) for r in range(world_size)):
        return False
    reason = "completed by --load from the rank files on disk (its writers ended before it)"
    snapshot_set.publish_manifest(root, iteration, world_size, {"reason": reason})
    return True


def unfinished_line(root: str | Path, iteration: int, world_size: int | None) -> str:
    """The one line refusing to resume past the unfinished set of `iteration`."""
    where = snapshot_set.set_dir(root, iteration)
    present = snapshot_set.ranks_present(root, iteration)
    if world_size is None:
        missing = "its manifest (the world size it was saved by is unknown here)"
    else:
        lost = sorted(set(range(world_size)) - set(present))
        bad = [
            p
            for r in present
            if r < world_size
            and (p := snapshot_set.rank_problem(root, iteration, r, checksum=True))
        ]
        missing = (f"the files of ranks {lost}" if lost else "nothing but its manifest") + (
            f"; {'; '.join(bad)}" if bad else ""
        )
    return (
        f"{where} holds the rank files of ranks {present} but no complete manifest (the run that "
        f"saved it ended before finishing it); missing: {missing}. Resuming from anything older "
        "would train over that save: restore the missing files, or move the folder away to resume "
        "from the state before it"
    )


def resume_point(root: str | Path, world_size: int | None = None) -> tuple[str, int] | None:
    """('snapshots' | 'megatron', iteration) of the newest verified state under `root`, every
    file of a set checked (`choose_resume` as one process deciding, for a job of `world_size`
    ranks)."""
    return choose_resume(root, world_size=world_size).point()


def check_load(
    root: str | os.PathLike[str], *, save: str | None = None, world_size: int | None = None
) -> None:
    """Refuse, before any process starts, a `--load` the ranks would fail on or silently
    ignore: a folder that does not exist (unless it is the `--save` folder as well: the first
    run of a job that saves and resumes in one place starts from iteration 1, as Megatron-LM
    does), a file, a marker that names no iteration or a missing iteration folder, a
    snapshot-set manifest that cannot be read, a newer snapshot set left unfinished that
    cannot be completed (one that can, for a job of `world_size` ranks, is: `choose_resume`)."""
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
        point = resume_point(path, world_size)
    except (CheckpointError, OSError) as exc:
        raise ConfigError(f"--load: {exc}") from None
    if point is not None and point[0] == "megatron" and not iteration_dir(path, point[1]).is_dir():
        raise ConfigError(
            f"--load: {path / TRACKER} names iteration {point[1]}, but "
            f"{iteration_dir(path, point[1])} is missing; point --load at a complete --save "
            "directory"
        )
