"""Stopping a thread before its next collective call, where aborting a collective under way is
not clean (gloo: CPU mode).

A survivor that shares no collective with the dead rank before the gradient sync computes on to
it - most of an iteration - and the recovery's agreement waits for it. On NCCL the survivor's
groups are aborted as the plan appears (`ncclCommAbort` ends the kernels of every operation under
way). On gloo an abort in the middle of a collective with live peers can leave a send under way
that gloo neither completes nor fails (`devices/gloo.py`), so the survivor is stopped where no
operation of its is under way: before its next collective. `close(thread, why)` makes the next
call of one of `COLLECTIVES` on `thread` raise `DistBackendError` (`why`) instead of starting
the operation - the error a collective with a lost peer raises, which the driver recovers from
like any other - and opens the gate again; `open()` opens it without that.

The calls are torch's module functions, as Megatron makes them (`torch.distributed.all_reduce`,
looked up at each call): `close` puts a wrapper in their place and `open` puts the originals
back, so that a process in which no plan stops a step's compute never runs through them. A
function some code took from `torch.distributed` at its import (Megatron's
`dist_all_gather_func`, `dist_reduce_scatter_func`) is not reached, nor are `isend` and `irecv`
(`COLLECTIVES` says why), and a call inside a coalescing block passes (`_coalescing`); the stop
then comes at the next call that is, or at the next step's start. Another thread's calls (the
replication thread's rounds) pass untouched.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "barrier",
    "send",
    "recv",
    "batch_isend_irecv",
)
"""The `torch.distributed` functions the gate stops a thread before (those it has). Not
`isend` and `irecv`: code names them to build a `P2POp` (`P2POp(torch.distributed.isend, ...)`,
Megatron's pipeline communication), which torch checks by identity against its own functions
(`_check_op`; `batch_isend_irecv` picks the peer's argument by `op is isend`), so a wrapper in
their place makes every `P2POp` built while the gate is closed a `ValueError`. A batch of them is
stopped at `batch_isend_irecv`; a direct `isend`/`irecv` is not stopped (the next call that is
stops the thread)."""


class CollectiveGate:
    """Stops one thread before its next collective call (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: int | None = None  # the thread the gate is closed for
        self._why = ""
        self._wrappers: dict[str, Callable[..., Any]] = {}
        self._originals: dict[str, Callable[..., Any]] = {}

    @property
    def closed(self) -> bool:
        """Whether a thread's next collective call raises."""
        return self._thread is not None

    def close(self, thread: int, why: str) -> None:
        """The next collective call of `thread` (a `threading.get_ident()`) raises
        `DistBackendError(why + ...)` instead of starting."""
        with self._lock:
            self._thread, self._why = thread, why
            for name in COLLECTIVES:
                real = getattr(dist, name, None)
                if real is None or name in self._originals:
                    continue
                self._originals[name] = real
                self._wrappers[name] = wrapper = self._gated(name, real)
                setattr(dist, name, wrapper)

    def open(self) -> None:
        """No call raises; torch's functions are back (unless code replaced them since)."""
        with self._lock:
            self._thread = None
            for name, real in self._originals.items():
                if getattr(dist, name, None) is self._wrappers[name]:
                    setattr(dist, name, real)
            self._originals.clear()
            self._wrappers.clear()

    def _gated(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(real)
        def gated(*args: Any, **kwargs: Any) -> Any:
            if self._thread == threading.get_ident() and not _coalescing():
                why = self._why
                self.open()
                raise dist.DistBackendError(f"{why}: stopped before its next collective ({name})")
            return real(*args, **kwargs)

        return gated


def _coalescing() -> bool:
    """Whether a `torch.distributed._coalescing_manager` block is open in this process (Megatron's
    DDP without the distributed optimizer all-reduces its buckets in one): a call there only
    records its operation, which the block's end runs with the others, and an error raised in
    the block would leave torch's record of it behind (the block has no `finally`: the group's
    later collectives would be recorded, not run). So a call there passes; the next one after
    the block stops the thread."""
    return bool(getattr(c10d._world, "pg_coalesce_state", None))
