"""A `--save` folder on a small filesystem of a command's own: a tmpfs mounted in a private
mount namespace (`unshare`, needs root), so that a checkpoint fills it up for real. Shared by the
embedded job's and Megatron-LM's full-disk tests (tests/embedded/test_full_disk.py,
tests/megatron_lm/test_megatron_lm_full_disk.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

SMALL_DISK = (
    'size=$1 save=$2 keep=$3 pidfile=$4; shift 4; mount -t tmpfs -o "size=$size" tmpfs "$save" '
    '|| exit 90; "$@" & pid=$!; echo $pid > "$pidfile"; wait $pid; rc=$?; '
    'find "$save" > "$keep.listing"; cp -a "$save/." "$keep/"; exit $rc'
)
"""Run a command with `save` a small tmpfs of its own (gone when it ends); the files it holds
then are listed (in `keep.listing`) and copied to `keep`, and the command's PID is in `pidfile`
meanwhile."""


def on_small_disk(
    size: str, save: Path, keep: Path, pidfile: Path, cmd: Sequence[str]
) -> list[str]:
    """`cmd` with `save` (an existing, empty folder) a tmpfs of `size` (e.g. "4m") while it
    runs, as `SMALL_DISK` says; skips the test without root and `unshare`."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small filesystem privately")
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", SMALL_DISK, "sh", size,
            str(save), str(keep), str(pidfile), *cmd]  # fmt: skip


def left_files(keep: Path) -> list[str]:
    """What the small filesystem held when the command ended (`SMALL_DISK`'s listing)."""
    return (keep.parent / f"{keep.name}.listing").read_text().split()
