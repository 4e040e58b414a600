"""The run's per-iteration records as `deadpool train` shows and writes them: one per iteration.

A recovery that restores an earlier iteration than the last one shown rewinds the records; the
iterations trained again then replace theirs, in memory and in the JSON log, so the log holds
exactly one line per iteration, in order, as the summary's losses do (`--json-log`).
"""

from __future__ import annotations

import json
from typing import Any, TextIO


class IterationLog:
    """Records of iterations `first`, `first + 1`, ... (the next one is `next_iteration`)."""

    def __init__(self, first: int, file: TextIO | None = None) -> None:
        self.first = first
        self.records: list[dict[str, Any]] = []
        self._file = file
        self._offsets: list[int] = []  # where each record's line starts in the file

    @property
    def next_iteration(self) -> int:
        return self.first + len(self.records)

    def append(self, record: dict[str, Any]) -> None:
        """Add the record of `next_iteration`, and its line to the file."""
        self.records.append(record)
        if self._file:
            self._offsets.append(self._file.tell())
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def rewind(self, restore_iteration: int) -> None:
        """Drop the records after `restore_iteration`: they will be trained again."""
        keep = max(0, restore_iteration + 1 - self.first)
        if self._file and keep < len(self._offsets):
            self._file.seek(self._offsets[keep])
            self._file.truncate()
        del self.records[keep:]
        del self._offsets[keep:]

    def write(self, line: dict[str, Any]) -> None:
        """A last line that is not an iteration's record (the summary)."""
        if self._file:
            self._file.write(json.dumps(line) + "\n")
