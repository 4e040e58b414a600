"""A persistent checkpoint that cannot be written: every rank learns it together, one line says it.

Shared by the embedded job's own save (`embedded/checkpoint.py`) and the guard around
Megatron-LM's `save_checkpoint` (`megatron_lm/save.py`). Both write Megatron-LM's layout
(`save_dir.py`): a folder per iteration, then the marker naming it. A save that fails (a full
disk, a read-only folder) must not leave a rank inside a collective that another rank left, nor
a partial folder, nor a marker naming one. The pieces:

- `agreed(error)`: one collective over the world (`all_gather_object` on the default group):
  every rank's error or None in, the same answer out on every rank. Each save step that can
  fail on some ranks only ends in one, so all ranks take the same branch afterwards.
- `attempt(write)`: a local write, as None or this rank's words for why it failed.
- `prepare(path)`: before a save, the folder made and probed, agreed. `probe(path)`: rank 0
  writes `PROBE_BYTES` (and removes them): a disk that is already full fails there, where every
  rank learns it, and not in a file rank 0 writes alone.
- `write_failure(exc, path)`: torch's `CheckpointException` (raised on every rank when any
  rank's write failed) in one line, the system's own words preferred.
- `save_agreeing(save, path)`: megatron-core's torch_dist save (or Megatron-LM's
  `save_checkpoint` around it) with every barrier of the world an agreement. A rank whose
  write failed alone (rank 0 writes core_v0.16.1's `common.pt`, `metadata.json` and Megatron-
  LM's marker alone) meets the others at their next barrier with its error, and all of them
  leave the save there together; a write rank 0 makes alone with no barrier after it (the
  sharded write's collectives follow `common.pt`) keeps its error for the next barrier instead
  of raising. A failed sharded write is reported on every rank by torch itself.
- `not_saved(root, iteration, kept, error)`: rank 0 removes the partial folder; the one line
  that says what was and was not saved and what `--load root` resumes from.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..durable import write_durably
from ..errors import first_line
from .save_dir import iteration_dir, latest_iteration

PROBE_BYTES = 1 << 20
"""What rank 0 writes (and removes) before a save: a disk already full fails here, where every
rank learns it, and not in the first file of the checkpoint, which rank 0 may write alone."""

ANOTHER_RANK = "another rank"
"""How a rank that only knows that some other rank failed words it (`agreed` prefers others)."""


def attempt(write: Callable[[], object]) -> str | None:
    """Run a local write: None, or why it failed (this rank's words for it)."""
    try:
        write()
    except OSError as exc:
        return os_error(exc)
    return None


def os_error(exc: OSError) -> str:
    """`exc` as this rank's line: 'rank R: [Errno N] what the system said'."""
    said = f"[Errno {exc.errno}] {exc.strerror}" if exc.strerror else first_line(exc)
    return f"rank {dist.get_rank()}: {said}"


def probe(path: Path) -> None:
    """Write `PROBE_BYTES` into folder `path` durably, then remove them."""
    written = write_durably(path / ".deadpool-probe", bytes(PROBE_BYTES))
    written.unlink()


def prepare(path: Path) -> str | None:
    """Before a save into folder `path`: every rank creates it (`exist_ok`), rank 0 probes it;
    None, or the agreed reason it cannot be written. Collective (two `agreed`)."""
    error = agreed(attempt(lambda: path.mkdir(parents=True, exist_ok=True)))
    if error is None and dist.get_rank() == 0:
        error = attempt(lambda: probe(path))
    return agreed(error)


def write_failure(exc: CheckpointException, path: Path) -> str:
    """torch's report of failed checkpoint writes, in one line: a failed rank's error, the
    system's own words (`[Errno 28] ...`) preferred (only the coordinating rank knows the
    details; the others say that another rank's write failed). Torch's file writer may hide the
    system's words ("unexpected pos ..."): when `path`'s file system has less than `PROBE_BYTES`
    left, the line says so."""
    said = []
    for rank, failure in sorted(exc.failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure
        said.append(f"rank {rank}: {first_line(error).removeprefix('Worker failure: ')}")
    system = [s for s in said if "[Errno" in s]
    line = (system or said or [f"rank {dist.get_rank()}: {ANOTHER_RANK}'s write failed"])[0]
    free = free_bytes(path)
    if "[Errno 28]" not in line and free is not None and free < PROBE_BYTES:
        line += f" - no space left on its file system ({free} bytes free)"
    return line


def free_bytes(path: Path) -> int | None:
    """The bytes an unprivileged writer may still use on `path`'s file system (None: unknown)."""
    try:
        st = os.statvfs(path if path.exists() else path.parent)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def agreed(error: str | None) -> str | None:
    """Every rank's `error` gathered (one collective over the world): the first rank's, a
    rank's own words preferred over 'another rank failed'; None when no rank failed."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    said = [e for e in errors if e is not None]
    specific = [e for e in said if ANOTHER_RANK not in e]
    return (specific or said)[0] if said else None


class _AgreedFailure(Exception):
    """Raised on every rank at once, at an agreeing barrier where some rank brought an error."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


class _Pending:
    """This rank's failed write that the other ranks have not heard of yet."""

    def __init__(self) -> None:
        self.error: str | None = None

    def take(self) -> str | None:
        error, self.error = self.error, None
        return error


def save_agreeing(save: Callable[[], object], path: Path) -> str | None:
    """`save()` (writing the checkpoint folder `path`) with every world barrier an agreement
    (module docstring): None, or the error every rank agreed on; each rank leaves `save` at the
    same point. Collective; an error of another kind (a peer lost) is raised as it comes."""
    pending = _Pending()
    try:
        with _agreeing_barriers(pending), _rank0_writes_deferred(pending):
            save()
    except _AgreedFailure as failed:  # every rank, at the same barrier
        return failed.error
    except CheckpointException as exc:  # torch raises it on every rank of a failed write
        return agreed(write_failure(exc, path))
    except OSError as exc:  # this rank alone: the others are in an agreeing barrier
        return agreed(os_error(exc))
    return agreed(pending.take())  # what a rank wrote after the last barrier


@contextlib.contextmanager
def _agreeing_barriers(pending: _Pending) -> Iterator[None]:
    """Within: `torch.distributed.barrier()` on the world is `agreed(pending error)`, and
    raises `_AgreedFailure` on every rank when any rank brought one."""
    real = dist.barrier

    @functools.wraps(real)
    def barrier(group: Any = None, *args: Any, **kwargs: Any) -> Any:
        if group is not None and group is not dist.group.WORLD:
            return real(group, *args, **kwargs)
        error = agreed(pending.take())
        if error is not None:
            raise _AgreedFailure(error)
        return None

    dist.barrier = barrier
    try:
        yield
    finally:
        dist.barrier = real


@contextlib.contextmanager
def _rank0_writes_deferred(pending: _Pending) -> Iterator[None]:
    """Within: megatron-core's writes that rank 0 makes alone with no barrier after them
    record their failure in `pending` instead of raising (core_v0.16.1: `common.pt`, which
    `TorchCommonSaveStrategy.save_common` writes before the sharded write's collectives; from
    core_v0.19.0 on the common state is part of the sharded write)."""
    from megatron.core.dist_checkpointing.strategies import common

    owner = getattr(common, "TorchCommonSaveStrategy", None)
    real = getattr(owner, "save_common", None)
    if owner is None or real is None:
        yield
        return

    @functools.wraps(real)
    def save_common(*args: Any, **kwargs: Any) -> None:
        try:
            real(*args, **kwargs)
        except OSError as exc:
            pending.error = pending.error or os_error(exc)
        except RuntimeError as exc:  # torch.save: "PytorchStreamWriter failed writing file ..."
            pending.error = pending.error or f"rank {dist.get_rank()}: {first_line(exc)}"

    owner.save_common = save_common
    try:
        yield
    finally:
        owner.save_common = real


def not_saved(root: str | os.PathLike[str], iteration: int, kept: int | None, error: str) -> str:
    """Remove what the failed save of `iteration` left (rank 0; never a folder the marker names:
    a save does not write into one), and say in one line what was and was not saved. Collective
    (one `agreed`: rank 0's words on every rank)."""
    path = iteration_dir(root, iteration)
    removed = "its partial files were removed"
    if latest_iteration(root) == iteration:  # the marker was written (its folder's fsync failed)
        removed = "its files stay: the marker names them"
    elif dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            removed = f"its partial files could not all be removed: delete {path}"
    removed = agreed(removed) or removed  # rank 0's words, on every rank
    newest = (
        f"--load {root} resumes from the newest complete checkpoint, iteration {kept} "
        f"({iteration_dir(root, kept)})"
        if kept is not None
        else f"no complete checkpoint is saved in {root}: --load {root} starts from iteration 1"
    )
    return f"checkpoint of iteration {iteration} not saved to {path} ({error}); {removed}; {newest}"
