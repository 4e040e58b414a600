"""Waking on store events instead of sleep-polling the store.

A `StoreWaiter` thread blocks in one store call at a time, on a connection of its own (torch's
store server answers a blocked `wait` the moment the key is set, a blocked `queue_pop` the
moment the queue is filled), and sets an Event each time it returns with news. The main thread
waits on that Event with whatever timeout its own periodic work needs, so it stays responsive to
signals, costs no store traffic while nothing happens, and reacts within a store round trip when
something does. Blocking calls time out only after `BLOCK_S`: torch logs two warnings for every
store call that times out. `stop()` ends the thread (it unblocks its call with a real event):
a thread still blocked in the store when the interpreter exits could kill the process (SIGABRT)
if the call returned then.

- `coordinator_inbox`: the coordinator wakes when a process notifies it (`coord/inbox`).
- `spare_wakeups`: a waiting spare wakes when a roster is published or the job shuts down
  (`spares/epoch/{n}`, one key per event, waited for in order so that none is missed).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Generic, Protocol, Self, TypeVar

import torch.distributed as dist

from ...devices.threads import DeviceThread, select_rank_device
from .store_protocol import StoreLike

BLOCK_S = 24 * 3600.0
"""Longest single blocking store call of a waiter thread."""


class Connected(Protocol):
    """A role view a waiter can open a connection of its own for (`store_view.StoreView`)."""

    @property
    def store(self) -> StoreLike: ...

    def sibling(self, store: StoreLike, member: str | None = None) -> Self: ...


class InboxView(Connected, Protocol):
    """What the coordinator's inbox waiter calls (`coordinator_view.CoordinatorView`)."""

    def next_message(self) -> None: ...

    def notify_coordinator(self) -> None: ...


class SpareView(Connected, Protocol):
    """What a waiting spare's waiter calls (`worker_view.WorkerView`)."""

    def spare_epoch(self) -> int: ...

    def wait_spare_epoch(self, n: int, timeout_s: float) -> bool: ...

    def wake_spares(self) -> None: ...


V = TypeVar("V", bound=Connected)
I = TypeVar("I", bound=InboxView)
S = TypeVar("S", bound=SpareView)


class StoreWaiter(DeviceThread, Generic[V]):
    """Calls `block(membership)` (True: something happened) in a loop; sets `event` on news.

    `unblock()` (on another connection) makes a pending `block` return: `stop` uses it."""

    def __init__(
        self,
        membership: V,
        block: Callable[[V], bool],
        unblock: Callable[[], None],
        name: str,
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.membership = membership
        self.block = block
        self.unblock = unblock
        self.event = threading.Event()
        self.stopping = False
        self.lost: str | None = None  # why the store became unreachable, if it did

    def run(self) -> None:
        while not self.stopping:
            select_rank_device()  # known by now, if not when the thread started
            try:
                news = self.block(self.membership)
            except dist.DistStoreError:  # a timed-out blocking call: block again
                continue
            except (RuntimeError, OSError) as exc:  # the store is gone: wake the waiter to see
                self.lost = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                self.event.set()
                return
            if news:
                self.event.set()

    def wait(self, timeout_s: float) -> bool:
        """Block until news or `timeout_s`; True on news (the event is cleared either way)."""
        news = self.event.wait(timeout_s)
        self.event.clear()
        return news

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread: unblock its store call and wait for it."""
        self.stopping = True
        if self.is_alive() and self.lost is None:
            try:
                self.unblock()
            except (RuntimeError, OSError):  # the store is gone: the call fails on its own
                pass
            self.join(timeout_s)


def own_connection(membership: V) -> V:
    """A connection of its own to the same server (torch's `clone`; a bounded client's clone
    is a plain one), for a thread that blocks in it."""
    clone = getattr(membership.store, "clone", None)
    if clone is None:
        raise TypeError(f"{type(membership.store).__name__} cannot open a second connection")
    store = clone()
    store.set_timeout(datetime.timedelta(seconds=BLOCK_S))
    return membership.sibling(store)


def coordinator_inbox(membership: I) -> StoreWaiter[I]:
    """A started waiter that wakes the coordinator on every `notify_coordinator`."""

    def block(m: I) -> bool:
        m.next_message()
        return True

    waiter = StoreWaiter(
        own_connection(membership),
        block,
        membership.notify_coordinator,
        "deadpool-coordinator-inbox",
    )
    waiter.start()
    return waiter


def spare_wakeups(membership: S) -> StoreWaiter[S]:
    """A started waiter that wakes a waiting spare on every roster, every plan naming a spare
    and on the shutdown.

    Created before the spare first looks at the store: it waits for the events after the epoch
    it read, in order, so an event between that look and the wait is not missed.
    """
    seen = membership.spare_epoch()

    def block(m: S) -> bool:
        nonlocal seen
        if not m.wait_spare_epoch(seen + 1, BLOCK_S):
            return False
        seen += 1
        return True

    # Unblocking wakes every waiting spare once: harmless, each only looks at the store again.
    waiter = StoreWaiter(
        own_connection(membership), block, membership.wake_spares, "deadpool-spare-wakeup"
    )
    waiter.start()
    return waiter
