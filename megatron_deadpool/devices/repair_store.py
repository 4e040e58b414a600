"""The store a process's repairable groups rendezvous on, whose waits a later plan can end.

A repair in place (`devices.reconfigure`) reconnects each group through its store: gloo's
``connectFullMesh`` writes this process's address under the group's ``reconfigure/{uuid}/`` and
waits for every member's. A member that dies once it published its reconfigure handles never
writes its address, and its peers wait - inside torch's C++ reconfigure, which nothing in Python
interrupts - for the whole repair timeout (60 s, measured), although the coordinator planned the
next generation a millisecond after the death.

`RepairStore` wraps the store the groups are created on (a ``dist.Store`` written in Python,
which torch's groups use like any other: every subgroup's store is a prefix of it). It passes
every operation through and remembers the keys the process is blocked on. `abandon`, called from
another thread once a later plan appeared, marks the store abandoned and writes `ABANDONED` at
each of those keys through another connection (`side`: a prefix store of the same prefix over
another client), only where no value is there yet (an atomic ``compare_set``): the blocked
``wait`` or ``get`` returns, and raises `RepairAbandoned`; so does any later read of such a key, in
this process or another one whose repair of the same generation is still waiting there. The error
goes back through gloo and out of torch's reconfigure as it was raised (measured, torch 2.14.1:
the group keeps its old rank, members and uuid, and its next repair, under another uuid, works),
where `hotswap.worker.group_repair` takes it for a peer failure: the recovery starts over in the
later generation. `abandonable()` brackets the waits that may be abandoned: the mark is cleared
as the block starts and as it ends.

The keys abandoned are those of a repair's rendezvous (``reconfigure/{uuid}/``, one uuid per
generation): no later repair reads them. What passing through Python costs: ~0-20 us per
``wait`` and ``get`` on an idle core (~200 us for the pair through the plain prefix store), and
in `deadpool bench recovery` (torch 2.14.1, 2 cores, 3 pairs of 4 repeats against the plain
store) a reconstruct of 57.6 against 54.1 ms, the hot swap 0.318 against 0.292 s - inside their
spread. The handles a group gives then have no store address (``gloo:0:-1:0:``), the same in
every process of the job. What this does not end: a wait for a member's TCP connection once the
member wrote its address (gloo's own timeout); the wait for the members' handles
(`WorkerView.repair_handles`, on the job's connection) is ended by the coordinator instead, which
marks a lost rank's handles as it plans the later generation (`messages.REPAIR_ABANDONED`).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from . import gloo

ABANDONED = b"deadpool:repair-abandoned"
"""What `abandon` writes at the keys a process waits for (never a gloo address)."""


class RepairAbandoned(RuntimeError):
    """A later plan abandoned the repair this process was waiting in."""


class RepairStore(dist.Store):
    """`inner` (the store the groups are created on), with waits `abandon` can end."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self._lock = threading.Lock()
        self._waiting: dict[str, int] = {}  # key -> calls blocked on it
        self._abandoned = threading.Event()

    @property
    def port(self) -> int | None:
        """The TCP store's port (`devices.gloo` leaves its connections alone)."""
        return gloo.store_port_of(self.inner)

    # ------------------------------------------------------------------ what torch calls
    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._enter([key])
        try:
            value = self.inner.get(key)
        finally:
            self._leave([key])
        if value == ABANDONED:
            raise RepairAbandoned(f"the repair was abandoned for a later plan (at {key!r})")
        return value

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._enter(keys)
        try:
            if timeout is None:
                self.inner.wait(keys)
            else:
                self.inner.wait(keys, timeout)
        finally:
            self._leave(keys)

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

    # ------------------------------------------------------------------ abandoning
    @contextlib.contextmanager
    def abandonable(self) -> Iterator[None]:
        """The waits inside the block are the ones `abandon` ends (the mark of an earlier
        abandon cleared as it starts and as it ends)."""
        self._abandoned.clear()
        try:
            yield
        finally:
            self._abandoned.clear()

    def waiting(self) -> list[str]:
        """The keys a blocking call waits for now (any thread)."""
        with self._lock:
            return sorted(self._waiting)

    def abandon(self, side: dist.Store) -> list[str]:
        """(Another thread) End the waits under way and those to come until the block of
        `abandonable` ends: `ABANDONED` written through `side` at every key waited for that
        holds no value yet. Returns the keys waited for."""
        self._abandoned.set()
        keys = self.waiting()
        for key in keys:
            side.compare_set(key, "", ABANDONED.decode())
        return keys

    def _enter(self, keys: list[str]) -> None:
        """Before a blocking call on `keys` (raises at once when abandoned)."""
        self._raise_if_abandoned()
        with self._lock:
            for key in keys:
                self._waiting[key] = self._waiting.get(key, 0) + 1

    def _leave(self, keys: list[str]) -> None:
        """After it (raises when it was abandoned meanwhile)."""
        with self._lock:
            for key in keys:
                if self._waiting[key] > 1:
                    self._waiting[key] -= 1
                else:
                    del self._waiting[key]
        self._raise_if_abandoned()

    def _raise_if_abandoned(self) -> None:
        if self._abandoned.is_set():
            raise RepairAbandoned("the repair was abandoned for a later plan")
