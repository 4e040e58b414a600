"""The coordinator's event log: its observations and decisions, one JSON object per line.

Each entry has its wall time (`t`), its kind (`event`) and the event's fields; the list of
entries is also kept in memory (`events`) for the launcher's summary and for tests. Messages
(`messages.py`) go into it through their `to_dict`/`asdict` form.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class EventLog:
    """Append-only JSON-lines log of the coordinator's observations and decisions."""

    def __init__(self, path: Path | None, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: str, **fields: Any) -> None:
        entry = {"t": self.clock(), "event": event, **fields}
        self.events.append(entry)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def of(self, event: str) -> list[dict[str, Any]]:
        """The entries of one kind, in order."""
        return [e for e in self.events if e["event"] == event]
