"""The run's per-iteration records as `deadpool train` shows and writes them: one per iteration.

A recovery that restores an earlier iteration than the last one shown rewinds the records; the
iterations trained again then replace theirs, in memory and in the JSON log, so the log holds
exactly one line per iteration, in order, as the summary's losses do: the run folder's
`iterations.jsonl` (what `deadpool report` reads) and `--json-log`'s file.

Rank 0 publishes each record under its generation. A recovery agreed before the launcher read
the records up to the restore iteration leaves them under an earlier generation (the new one
trains from the iteration after): `IterationLog.next_record` follows the roster's generations
and looks where `generations_to_read` says.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from typing import Any, TextIO, TypeVar

R = TypeVar("R")


def generations_to_read(
    iteration: int, generation: int, restore_iteration: int, last_read: int
) -> range:
    """Where the record of `iteration` may be, newest first: the current `generation`'s, and -
    an iteration at or before its `restore_iteration`, trained before the recovery - every
    generation back to `last_read` (the generation of the last record read): the newest that
    published it trained it last."""
    oldest = min(last_read, generation) if iteration <= restore_iteration else generation
    return range(generation, oldest - 1, -1)


class IterationLog:
    """Records of iterations `first`, `first + 1`, ... (the next one is `next_iteration`)."""

    def __init__(self, first: int, *files: TextIO) -> None:
        self.first = first
        self.records: list[dict[str, Any]] = []
        self._files = list(files)
        self._offsets: list[list[int]] = []  # where each record's line starts in each file
        self._generation = 0  # the roster generation the records follow (`next_record`)
        self._last_read = 0  # the generation of the last record appended

    @property
    def next_iteration(self) -> int:
        return self.first + len(self.records)

    def next_record(
        self, generation: int, restore_iteration: int, read: Callable[[int, int], R | None]
    ) -> R | None:
        """The record of `next_iteration` for the roster of `generation` (restoring
        `restore_iteration`), read with `read(generation, iteration)` where it may be
        (`generations_to_read`); None while none is published. A new generation first rewinds
        the records to its restore iteration."""
        if generation != self._generation:
            self._generation = generation
            self.rewind(restore_iteration)
        it = self.next_iteration
        where = generations_to_read(it, generation, restore_iteration, self._last_read)
        return next(filter(None, (read(g, it) for g in where)), None)

    def append(self, record: dict[str, Any]) -> None:
        """Add the record of `next_iteration` (of the generation its ``generation`` names), and
        its line to the files."""
        self._last_read = int(record.get("generation", self._last_read))
        self.records.append(record)
        self._offsets.append([f.tell() if not f.closed else 0 for f in self._files])
        self.write(record)

    def rewind(self, restore_iteration: int) -> None:
        """Drop the records after `restore_iteration`: they will be trained again."""
        keep = max(0, restore_iteration + 1 - self.first)
        if keep < len(self._offsets):
            for f, offset in zip(self._files, self._offsets[keep]):
                if f.closed:
                    continue
                try:
                    f.seek(offset)
                    f.truncate()
                except OSError as exc:
                    self._lost(f, exc)
        del self.records[keep:]
        del self._offsets[keep:]

    def write(self, line: dict[str, Any]) -> None:
        """A line to every file (a record; last, the summary)."""
        for f in self._open():
            try:
                f.write(json.dumps(line) + "\n")
                f.flush()
            except OSError as exc:
                self._lost(f, exc)

    def _open(self) -> list[TextIO]:
        return [f for f in self._files if not f.closed]

    @staticmethod
    def _lost(f: TextIO, exc: OSError) -> None:
        """A file that cannot be written (a full disk) is closed, with one line on stderr: the
        run goes on, its records in memory."""
        print(f"deadpool: cannot write {f.name} ({exc}): its records stop here", file=sys.stderr)
        with contextlib.suppress(OSError):
            f.close()
