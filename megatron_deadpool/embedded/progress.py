"""Live progress of a run, one line per iteration, the way Megatron users read their logs.

    [gen 0] iter    3/8   [=====>        ] loss 2.4180 | 0.126 s/it | repl: committed 2, 48.1 KiB/rank

Recovery events print as their own lines between iterations, with each phase's wall time.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from ..units import human_bytes


class Progress:
    """Renders iteration records and events to a stream (stdout by default)."""

    def __init__(self, total: int, *, stream: TextIO | None = None, quiet: bool = False) -> None:
        self.total = total
        self.stream = stream or sys.stdout
        self.quiet = quiet

    def _print(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream, flush=True)

    def header(self, text: str) -> None:
        self._print(text)

    def iteration(self, rec: dict[str, Any], deadpool: bool) -> None:
        it = rec["iteration"]
        width = 14
        done = int(width * it / max(1, self.total))
        bar = "=" * max(0, done - 1) + (">" if done else "") + " " * (width - done)
        line = (
            f"[gen {rec['generation']}] iter {it:4d}/{self.total:<4d} [{bar}] "
            f"loss {rec['loss']:.4f} | {rec['iter_time_s']:.3f} s/it"
        )
        if deadpool:
            committed = rec.get("committed_iteration")
            state = f"committed {committed}" if committed is not None else "first round in flight"
            line += f" | repl: {state}, {human_bytes(rec.get('replica_bytes_sent', 0))}/rank"
        self._print(line)

    def event(self, text: str) -> None:
        self._print(f"  !! {text}")
