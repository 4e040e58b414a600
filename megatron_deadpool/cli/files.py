"""`deadpool files`: the Slurm scripts, job configs and Megatron-LM patches the package carries.

A wheel holds what a user needs without a clone of the repository, under the repository's own
names (`megatron_deadpool/resources/`, links to the repository's folders in a checkout):

    deadpool files                              # list them
    deadpool files configs/models/gpt-7b.yaml   # print one
    deadpool files --path scripts/slurm/deadpool_launch.sh   # where it is on disk
    deadpool files --copy DIR                   # all of them into DIR, laid out as in the repo

`deadpool slurm-script SITE` (cli/slurm_script.py) prints one site's sbatch script.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from ..errors import ConfigError

ROOT = Path(__file__).resolve().parents[1] / "resources"
"""Where the packaged files are: megatron_deadpool/resources/ (installed or checked out)."""

PATTERNS = (
    "scripts/slurm/*.sbatch",
    "scripts/slurm/*.sh",
    "scripts/apply_patches.sh",
    "scripts/inject_failure.sh",
    "scripts/prepare_megatron_lm.sh",
    "configs/*.yaml",
    "configs/*/*.yaml",
    "patches/megatron-lm/*/*.patch",
)
"""The packaged files, relative to ROOT: pyproject.toml's package data for megatron_deadpool is
these under `resources/` (a test keeps the two equal)."""


def packaged() -> list[str]:
    """Every packaged file's name (its path relative to ROOT, as in the repository), sorted."""
    names = {p.relative_to(ROOT).as_posix() for pattern in PATTERNS for p in ROOT.glob(pattern)}
    return sorted(names)


def locate(name: str) -> Path:
    """The packaged file `name` (as `packaged()` lists it) on disk; ConfigError naming the
    listing command when there is no such file."""
    if name not in packaged():
        raise ConfigError(
            f"no packaged file {name!r}: `deadpool files` lists them "
            "(names as in the repository, e.g. scripts/slurm/vista.sbatch)"
        )
    return ROOT / name


def copy_all(dest: Path) -> list[Path]:
    """Copy every packaged file into `dest` under its repository name (dest/scripts/slurm/...,
    dest/configs/..., dest/patches/...); a file that exists there already is left alone.
    Returns the files written."""
    written = []
    for name in packaged():
        target = dest / name
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, target)
        if name.endswith((".sh", ".sbatch")):
            target.chmod(0o755)
        written.append(target)
    return written


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `deadpool files`' arguments."""
    parser.add_argument("name", nargs="?", help="a packaged file to print (default: list them)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--path",
        action="store_true",
        help="print where NAME (without NAME: the folder of them all) is on disk",
    )
    where.add_argument(
        "--copy",
        metavar="DIR",
        type=Path,
        help="copy every packaged file into DIR, laid out as in the repository (existing "
        "files are kept): then submit from DIR as the docs say (sbatch scripts/slurm/...)",
    )


def run(args: argparse.Namespace) -> int:
    """List, print, locate or copy the packaged files."""
    if args.copy is not None:
        if args.name is not None:
            raise ConfigError("--copy DIR copies every file: give no NAME with it")
        written = copy_all(args.copy)
        print(f"deadpool files: {len(written)} files written under {args.copy}", file=sys.stderr)
        return 0
    if args.name is None:
        print(ROOT if args.path else "\n".join(packaged()))
        return 0
    path = locate(args.name)
    if args.path:
        print(path)
    else:
        sys.stdout.write(path.read_text())
    return 0
