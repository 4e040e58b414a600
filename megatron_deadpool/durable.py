"""Files that must survive a crash: written atomically and durably, or not at all.

Everything DeadPool writes for a later run to trust - snapshot sets and their manifests, the
checkpoint tracker, run summaries - goes through `write_durably`: the bytes go to a temporary
file beside the target with a name no other writer can take (host, PID and a random part: two
containers on one shared filesystem can have the same PID), are flushed and fsynced, the file
is renamed over the target, and the folder is fsynced so that the rename itself survives a
power or node loss. A reader sees the old file or the complete new one, never part of one; a
writer that fails (a full disk, a read-only folder) leaves no temporary file behind and raises
the `OSError`. `make_dirs` creates folders the same way (each new entry fsynced in its parent).
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TMP_SUFFIX = ".tmp"
"""How every temporary file DeadPool writes ends (`temp_path`)."""


def temp_path(path: Path) -> Path:
    """A temporary name beside `path`, unique across hosts, processes and calls."""
    host = socket.gethostname().split(".")[0][:32] or "host"
    return path.with_name(f".{path.name}.{host}.{os.getpid()}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")


def fsync_dir(path: Path) -> None:
    """Make the entries of folder `path` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """`path` and its missing parents, each new folder's entry fsynced in its parent."""
    missing = []
    at = Path(path)
    while not at.is_dir():
        missing.append(at)
        at = at.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another writer made it meanwhile
            folder.mkdir()
        fsync_dir(folder.parent)


def write_durably(path: Path, data: bytes | Callable[[BinaryIO], object]) -> Path:
    """Replace `path` with `data` (bytes, or a function writing to the open file) atomically
    and durably (module docstring); returns `path`. On any failure no temporary file remains
    and the error is raised; `path` is then unchanged."""
    path = Path(path)
    make_dirs(path.parent)
    tmp = temp_path(path)
    try:
        with open(tmp, "xb") as out:
            if isinstance(data, bytes):
                out.write(data)
            else:
                data(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)
    return path
