"""A process's connections to a coordinator's store: bounded clients, and the heartbeat thread.

torch's TCPStore client waits without limit for the answer of a server that stopped answering (a
frozen coordinator, a host that vanished without closing its sockets), whatever its timeout, and
its `set` does not wait for an answer at all (a value set on a lost connection vanishes without
an error). So every operation here runs on a helper thread and the caller waits a bounded time:
no answer raises `DistNetworkError`, as a closed connection does, and the helper (stuck in torch)
is abandoned; and a `set` is confirmed by a round trip on the same connection. Every process
keeps a second connection for its heartbeat, so that a main thread blocked in a collective
still beats - and a lost coordinator is noticed within one heartbeat interval. Only the beat
itself, and a store error of what runs after it (`after_beat`: the plan watch), count as losing
the coordinator; any other error after a beat is logged and the beating goes on.

A helper that was given up on may still return later (its server was only slow). One that
returns while the interpreter shuts down kills the process with SIGABRT (a thread re-entering
Python then is unwound through torch's C++ frames), so at exit abandoned helpers get a few
seconds to return first; one stuck for good never returns and does no harm.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import torch.distributed as dist

from ...config.deadpool import parse_host_port
from ...devices.threads import DeviceThread, select_rank_device
from ...errors import CoordinatorUnreachableError

log = logging.getLogger(__name__)

T = TypeVar("T")

STORE_ERRORS = (dist.DistNetworkError, dist.DistStoreError, RuntimeError, OSError)
"""What a store operation raises when the coordinator is unreachable (or refused us)."""

LOST_ERRORS = (CoordinatorUnreachableError, dist.DistNetworkError, dist.DistStoreError, OSError)
"""What, raised after a beat (`Heartbeat.after_beat`), means the coordinator is lost: a store
error, never another `RuntimeError` (e.g. torch's `DistBackendError` from a process group)."""


class _Caller(DeviceThread):
    """A daemon thread that runs store calls one at a time for a caller that waits a bounded
    time (a daemon: one stuck in torch forever does not hold up the interpreter's exit)."""

    def __init__(self) -> None:
        super().__init__(name="deadpool-store-call", daemon=True)
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.stuck = False  # a call was given up: the thread may never return from it
        self.start()

    def run(self) -> None:
        while True:
            call = self.calls.get()
            if call is None:  # `close`
                return
            fn, box, done = call
            select_rank_device()  # known by now, if not when the thread started
            try:
                box.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append((False, exc))
            done.set()

    def call(self, fn: Callable[[], T], timeout: float, abandon: Callable[[], bool]) -> T:
        """`fn()`'s result; `DistNetworkError` after `timeout` seconds without one, or as soon
        as `abandon()` says the answer is no longer wanted (the thread is then unusable)."""
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self.calls.put((fn, box, done))
        deadline = time.monotonic() + timeout
        while not done.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or abandon():
                self.stuck = True
                _ABANDONED.append(self)
                raise dist.DistNetworkError(f"no answer from the store within {timeout:g}s")
        ok, value = box[0]
        if ok:
            return value
        raise value

    def close(self) -> None:
        """End the thread once it is idle (a stuck one stays where torch holds it)."""
        self.calls.put(None)


_ABANDONED: list[_Caller] = []


@atexit.register
def _settle_abandoned(limit_s: float = 10.0) -> None:
    """At exit: let abandoned calls that are only slow return before the interpreter goes."""
    deadline = time.monotonic() + limit_s
    for caller in _ABANDONED:
        caller.close()
        caller.join(max(0.0, deadline - time.monotonic()))


def open_client(address: str, timeout: float) -> dist.TCPStore:
    """One bounded attempt to connect to the store at HOST:PORT.

    A plain TCP connection first: torch's own client retries a refused connection for up to
    about three times its timeout, and a thread left inside torch when the interpreter exits
    kills the process (SIGABRT). Only a server that accepts the connection gets a torch client,
    on a helper thread (a stopped server accepts, then never answers).
    """
    host, port = parse_host_port(address, "deadpool-coordinator", resolve=True)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise dist.DistNetworkError(f"cannot connect to {address}: {exc}") from None
    caller = _Caller()
    try:
        return caller.call(
            lambda: dist.TCPStore(
                host,
                port,
                is_master=False,
                timeout=datetime.timedelta(seconds=timeout),
                wait_for_workers=False,
            ),
            timeout + 1.0,
            lambda: False,
        )
    finally:
        caller.close()


class BoundedStore:
    """A store client whose every operation answers within `op_timeout` seconds (a `wait`
    within its own timeout plus that) or raises `DistNetworkError`."""

    def __init__(self, client: Any, op_timeout: float) -> None:
        """`client`: a torch store client (`open_client`)."""
        self.client = client
        self.op_timeout = op_timeout
        self._caller = _Caller()

    def __del__(self) -> None:
        caller = getattr(self, "_caller", None)
        if caller is not None:
            caller.close()

    def set(self, key: str, value: str) -> None:
        """Set, confirmed: the answer to the `check` after it means the server applied it."""

        def confirmed(c: Any) -> None:
            c.set(key, self._outgoing(key, value))
            c.check([key])

        self._call(confirmed)

    def set_then_add(self, key: str, value: str, counter: str, amount: int) -> int:
        """Set, then add `amount` to `counter` on the same connection (one retry unit): the
        add's answer confirms the set, so no check follows it (`store_protocol.ConfirmedSets`)."""

        def both(c: Any) -> int:
            c.set(key, self._outgoing(key, value))
            return int(c.add(counter, amount))

        return self._call(both)

    def get(self, key: str) -> bytes:
        return self._call(lambda c: c.get(key))

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda c: c.check(keys))

    def add(self, key: str, amount: int) -> int:
        return self._call(lambda c: c.add(key, amount))

    def delete_key(self, key: str) -> bool:
        return self._call(lambda c: c.delete_key(key))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call(lambda c: c.compare_set(key, expected, self._outgoing(key, desired)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(lambda c: c.multi_get(keys))

    def queue_push(self, key: str, value: str) -> None:
        self._call(lambda c: c.queue_push(key, value))

    def clone(self) -> Any:
        """A plain connection of its own to the current server, for a thread that blocks in
        the store (`wakeup.StoreWaiter`): unbounded, and it does not fail over (its blocked
        call fails when the server is lost, which wakes its waiter)."""
        return self.client.clone()

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self._call(lambda c: c.wait(keys, timeout), timeout.total_seconds())

    def _call(self, fn: Callable[[Any], T], extra_s: float = 0.0) -> T:
        client, caller = self.client, self._caller
        try:
            return caller.call(lambda: fn(client), self.op_timeout + extra_s, self._moved)
        finally:
            if caller.stuck:
                caller.close()  # it ends if torch ever lets go
                self._caller = _Caller()

    def _moved(self) -> bool:
        """The answer is no longer wanted (a failover client moved to another coordinator)."""
        return False

    def _outgoing(self, key: str, value: str) -> str:
        """`value` as it is written to `key` on this attempt (a failover client seals it again
        for the store it now goes to)."""
        return value


class Beats(Protocol):
    """What a heartbeat thread calls (`worker_view.WorkerView`)."""

    def heartbeat(self) -> None: ...


B = TypeVar("B", bound=Beats)


class Heartbeat(DeviceThread, Generic[B]):
    """Publishes this process's heartbeat on its own store connection (`store`)."""

    def __init__(self, membership: B, interval: float) -> None:
        """`membership`: on a store connection of the heartbeat's own."""
        super().__init__(name="deadpool-heartbeat", daemon=True)
        self.membership = membership
        self.interval = interval
        self.stopped = threading.Event()
        self.lost: str | None = None  # why the coordinator became unreachable, if it did
        self.after_beat: Callable[[B], None] | None = None  # e.g. `PlanWatch`

    def stop(self, timeout_s: float) -> None:
        """No more beats; wait up to `timeout_s` for the one in flight. A process must not exit
        while this thread is inside a store call: a thread that returns from torch while the
        interpreter shuts down kills the process ("terminate called without an active
        exception", exit -6)."""
        self.stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout_s)

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.membership.heartbeat()  # a round trip: notices a lost coordinator
                if self.after_beat is not None:
                    select_rank_device()  # known by now, if not when the thread started
                    self._after_beat(self.after_beat)
            except STORE_ERRORS as exc:  # no coordinator could be found again
                self.lost = str(exc).splitlines()[0][:200]
                return

    def _after_beat(self, after_beat: Callable[[B], None]) -> None:
        """Run `after_beat`; a store error goes up (the coordinator is lost), any other error
        is logged and the next beat comes as usual."""
        try:
            after_beat(self.membership)
        except LOST_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - not the coordinator's: keep beating
            log.error("after a heartbeat: %s", str(exc).splitlines()[0][:200])
