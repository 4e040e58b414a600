"""A process's connections to the coordinator's store: the client, and the heartbeat thread.

Every process of a job reaches the coordinator through `connect_store` (bounded in time: a
clear error instead of a hang) and keeps a second connection of its own for its heartbeat, so
that a main thread blocked in a collective still beats.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from ..config.deadpool import parse_host_port
from ..errors import CoordinatorUnreachableError
from .membership import Membership


def connect_store(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the coordinator's store; a clear error instead of a hang."""
    host, port = parse_host_port(address, "deadpool-coordinator", resolve=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:  # short attempts: torch's own retry back-off can outlast the whole deadline
            attempt = max(0.5, min(10.0, deadline - time.monotonic()))
            store = dist.TCPStore(
                host,
                port,
                is_master=False,
                timeout=datetime.timedelta(seconds=attempt),
                wait_for_workers=False,
            )
            store.set_timeout(datetime.timedelta(seconds=timeout_s))
            return store
        except (RuntimeError, TimeoutError) as exc:
            if time.monotonic() > deadline:
                why = str(exc).splitlines()[0][:160]
                raise CoordinatorUnreachableError(
                    f"coordinator {address} unreachable after {timeout_s:.0f}s ({why}); start "
                    "`deadpool coordinator` first or fix --deadpool-coordinator"
                ) from None
            time.sleep(0.2)


class Heartbeat(threading.Thread):
    """Publishes this process's heartbeat on its own store connection."""

    def __init__(self, address: str, pid: str, interval: float, timeout: float) -> None:
        super().__init__(name="deadpool-heartbeat", daemon=True)
        self.membership = Membership(connect_store(address, timeout), pid)
        self.interval = interval
        self.stopped = threading.Event()
        self.lost: str | None = None  # why the coordinator became unreachable, if it did
        self.after_beat: Callable[[Membership], None] | None = None  # e.g. `PlanWatch`

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.membership.heartbeat()
                if self.after_beat is not None:
                    self.after_beat(self.membership)
            except (RuntimeError, OSError) as exc:  # the coordinator's store is gone
                self.lost = str(exc).splitlines()[0][:200]
                return
