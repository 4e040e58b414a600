"""Megatron's timers across a peer's failure: the step or log that failed leaves them as they were.

Megatron's `Timer.start` and `Timer.elapsed` take a barrier, so a peer's failure can interrupt
them half-way: `training_log`'s `timers('interval-time').elapsed(barrier=True)` stops and resets
the timer, then dies in the barrier of its restart - the timer is left stopped at 0 s, and the
next log line, after the recovery, divides by that 0 (`ZeroDivisionError` in the throughput).
A step that fails leaves the timers it started running, and Megatron asserts on their next
start. So every call DeadPool recovers around notes which timers run before it (`running`) and,
when it fails, puts them back (`restore`): those it started are reset, those it stopped run
again - without a barrier or a device synchronisation, which a broken communicator could hang.
The interval that failed is lost to the timers; it is recomputed or logged again anyway.
"""

from __future__ import annotations

import time
from typing import Any


def megatron() -> Any:
    """Megatron's global `Timers` (set up by `initialize_megatron`); None before, or outside
    a Megatron-LM tree (megatron-core alone has no `megatron.training`)."""
    try:
        from megatron.training import global_vars
    except ImportError:
        return None
    return getattr(global_vars, "_GLOBAL_TIMERS", None)


def _all(timers: Any) -> dict[str, Any]:
    """Megatron's timers by name (`Timers._timers`, the same in every supported release)."""
    found = getattr(timers, "_timers", {})
    return found if isinstance(found, dict) else {}


def running(timers: Any) -> set[str]:
    """The names of the timers that run now."""
    return {name for name, t in _all(timers).items() if getattr(t, "_started", False)}


def restore(timers: Any, before: set[str]) -> None:
    """Timers as they were when `running` returned `before`: one started since is reset (its
    elapsed time dropped), one stopped since runs again from now."""
    for name, t in _all(timers).items():
        started = getattr(t, "_started", False)
        if started and name not in before:
            t.reset()
        elif not started and name in before:
            t._start_time = time.time()  # Timer.start without its barrier and synchronisation
            t._started = True
