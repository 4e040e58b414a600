"""Logging prefixed with rank and generation, as every process of a job writes it.

`setup_logging(role)` installs a handler whose lines read
`[deadpool r3 g1] message` (or `[deadpool spare s0]` before a spare is assigned);
`set_context(rank=..., generation=...)` updates the prefix after a hot swap.
"""

from __future__ import annotations

import logging
import sys

_CONTEXT = {"prefix": "deadpool"}


class _Prefix(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.dp_prefix = _CONTEXT["prefix"]
        return True


def set_context(*, rank: int | None = None, generation: int | None = None, spare: str = "") -> None:
    """Set the prefix: rank and generation for actives, the spare's id while waiting."""
    if rank is None:
        _CONTEXT["prefix"] = f"deadpool spare {spare}"
    else:
        _CONTEXT["prefix"] = f"deadpool r{rank} g{generation}"


def setup_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_Prefix())
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s.%(msecs)03d [%(dp_prefix)s] %(levelname)s %(message)s", "%H:%M:%S"
        )
    )
    root = logging.getLogger("megatron_deadpool")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
