"""`deadpool --version`: this package's version and, when installed, torch's and megatron-core's.

Read from the installed packages' metadata (`importlib.metadata`): nothing is imported, so it
answers at once, also where importing torch takes seconds.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from .. import __version__

DEPENDENCIES = ("torch", "megatron-core")
"""The packages whose versions `--version` names beside DeadPool's own."""


def installed(distribution: str) -> str | None:
    """The installed version of `distribution`, or None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def version_line() -> str:
    """One line: `deadpool 0.1.0 (torch 2.13.0, megatron-core 0.16.1)`; a dependency that is
    not installed reads `megatron-core not installed` (a Megatron-LM tree on PYTHONPATH brings
    its own megatron.core, which has no package metadata)."""
    parts = []
    for name in DEPENDENCIES:
        found = installed(name)
        parts.append(f"{name} {found}" if found else f"{name} not installed")
    return f"deadpool {__version__} ({', '.join(parts)})"


class VersionAction(argparse.Action):
    """`--version`: print `version_line()` and exit 0 (argparse's own version action needs the
    text when the parser is built; this one reads the metadata only when asked)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            nargs=0,
            help="print DeadPool's, torch's and megatron-core's versions and exit",
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        print(version_line())
        parser.exit(0)
