"""Directories and files a command will write, checked before any process starts.

A log directory, a `--save` directory or a `--json-log` file that cannot be written would
otherwise be found by a worker (or at the first checkpoint, hours in) as a traceback. Nothing
is created here: a path passes when it is a writable directory (a file: in one), or when the
nearest folder above it that exists is one, so that it can be created.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError


def check_writable_dir(path: str | os.PathLike[str], flag: str) -> None:
    """`path` is a directory this process can write, or can be created as one."""
    p = Path(path).expanduser()
    if not p.exists():
        _creatable(p, flag)
    elif not p.is_dir():
        raise ConfigError(f"{flag}: {str(p)!r} is a file, not a directory; give a directory")
    else:
        _writable(p, flag)


def check_writable_file(path: str | os.PathLike[str], flag: str) -> None:
    """`path` is a file this process can (over)write, or create."""
    p = Path(path).expanduser()
    if not p.exists():
        _creatable(p, flag)
    elif p.is_dir():
        raise ConfigError(f"{flag}: {str(p)!r} is a directory; give a file name")
    elif not os.access(p, os.W_OK):
        raise ConfigError(f"{flag}: cannot write {str(p)!r} (permission denied)")


def _creatable(p: Path, flag: str) -> None:
    """`p`, which does not exist, can be created: the nearest folder above it that exists is a
    directory this process can write."""
    above = p.absolute().parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise ConfigError(
            f"{flag}: cannot create {str(p)!r}: {str(above)!r} is a file, not a directory"
        )
    _writable(above, flag)


def _writable(directory: Path, flag: str) -> None:
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{flag}: cannot write in {str(directory)!r} (permission denied); give a directory "
            "you can write"
        )
