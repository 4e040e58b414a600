"""A process's link to the job's coordinator that survives the coordinator's loss.

`--deadpool-coordinator` lists the primary coordinator first, then standbys
(`deadpool coordinator --standby`). A store serves the job once it holds the job token (sealed
with the job's secret, `seal.py`: no one without the secret can write it); a
standby sets it only when it takes over, so before that no process can join it - a process
whose connection to the primary merely blipped finds the primary again, never a second job.

Every store operation of a process goes through a `FailoverStore` (bounded in time, see
`connection.py`). When one fails, the process's `CoordinatorLink` - shared by its main thread
and its heartbeat thread, so only the first to notice searches - tries the listed coordinators
in order, again and again within `--deadpool-connect-timeout`:
  - the same coordinator (same identity) answering again: a network blip, carry on;
  - a coordinator with a newer epoch serving the job: a standby that took over. Re-register
    with it first - what this process knows of the job (`rebuild.Registration`, from the
    `record` callback: rank, generation and roster, progress, layout, ...) - and wait until it
    has rebuilt the job's state from every survivor's registration (`standby.py`); then go on.
Then the failed operation is repeated on the new connection. Process groups of later generations
rendezvous on the new store (`WorkerView.process_group_store`).

Each of the job's stores has its own seal (`seal.py`: entry i of the list, i's): a store is
probed with its entry's seal, so a `job/token` or `coordinator` copied from another store of the
job (the primary's into a standby's that has not taken over) proves nothing there, and the
coordinator answering again is the one whose identity the same entry's store holds, sealed for
that store. Every connection of the process seals and opens with the seal of the store serving
now (`LinkSeal`); a sealed write repeated on a successor's store after a failover is sealed
again for it (`CoordinatorLink.rebind`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ...errors import CoordinatorUnreachableError, first_line
from ..protocol.connection import STORE_ERRORS, BoundedStore, open_client
from ..protocol.messages import CoordinatorIdentity, Registration
from ..protocol.seal import JobSeal
from ..protocol.sealed_store import SealedStore
from ..protocol.worker_view import WorkerView

log = logging.getLogger("megatron_deadpool.failover")

T = TypeVar("T")


class CoordinatorLink:
    """Which coordinator serves the job, for every connection of one process."""

    def __init__(
        self,
        addresses: list[str],
        seal: JobSeal,
        *,
        connect_timeout: float,
        op_timeout: float,
        rebuild_timeout: float,
        beat_s: float,
        member: Callable[[], str],
        record: Callable[[], Registration],
    ) -> None:
        """`op_timeout`: the bound on one store operation; `rebuild_timeout`: how long a standby
        may take to rebuild the job's state once this process re-registered (it beats every
        `beat_s` meanwhile); `member()` and `record()`: this process's member name (or
        `task{i}`) and its re-registration, when needed."""
        self.addresses = list(addresses)
        self.seal = seal
        # Each listed store's seal (its entry's), and the serving one's (`LinkSeal`).
        self.seals = [seal.for_store(index) for index in range(len(self.addresses))]
        self.current = self.seals[0]
        self.store_seal: JobSeal = LinkSeal(self)
        self.connect_timeout = connect_timeout
        self.op_timeout = op_timeout
        self.rebuild_timeout = rebuild_timeout
        self.beat_s = beat_s
        self.attempt_s = max(1.0, min(2.0, op_timeout / 2))
        self.member = member
        self.record = record
        self.lock = threading.Lock()
        self.address = self.addresses[0]
        self.identity: CoordinatorIdentity | None = None  # the serving coordinator
        self.switches = 0  # connections made stale so far (reconnects and takeovers)
        self.failed: str | None = None  # why no coordinator could be found, once so
        self.takeovers: list[dict[str, float | str]] = []

    # ------------------------------------------------------------------ start-up
    def connect(self) -> None:
        """Find the coordinator serving the job (within the connect timeout); a store with
        another job's token (one this secret cannot open) is refused (`JobTokenError`)."""
        deadline = time.monotonic() + self.connect_timeout
        while True:
            why = ""
            for index, address in enumerate(self.addresses):
                found = self._probe(index)
                if isinstance(found, str):
                    why = found
                    continue
                membership, serves, identity = found
                if serves is None:
                    why = f"{address} serves no job yet (a standby that has not taken over)"
                    continue
                membership.check_token()  # another job's coordinator: refused
                taking_over = (
                    identity is not None and identity.epoch > 0 and not membership.rebuilt()
                )
                if taking_over and not self._rejoin(membership, address, time.time()):
                    continue  # (a standby taking the job over counts those who register)
                self.address, self.identity = address, identity
                self.current = self.seals[index]
                return
            if time.monotonic() > deadline:
                raise CoordinatorUnreachableError(
                    f"coordinator {','.join(self.addresses)} unreachable after "
                    f"{self.connect_timeout:.0f}s ({why}); start `deadpool coordinator` first or "
                    "fix --deadpool-coordinator"
                )
            time.sleep(0.2)

    # ------------------------------------------------------------------ connections
    def client(self, seen: int | None = None, why: str = "") -> tuple[dist.Store, int]:
        """A new client of the serving coordinator and the switch count it belongs to. `seen`:
        the switch count of a connection that just failed (`why`) - the first to report a
        failure of the current coordinator searches for it or its successor."""
        with self.lock:
            while True:
                if self.failed is not None:
                    raise CoordinatorUnreachableError(self.failed)
                if seen is not None and seen == self.switches:
                    self._switch(why)
                try:
                    return open_client(self.address, self.attempt_s), self.switches
                except STORE_ERRORS as exc:
                    seen, why = self.switches, first_line(exc)

    def _switch(self, why: str) -> None:
        """The serving coordinator failed (`why`): find it again, or a standby that took over
        (re-registering with it), within the connect timeout."""
        t0 = time.time()
        lost = self.address
        log.warning("lost the coordinator %s (%s): looking for it or a standby", lost, why)
        deadline = time.monotonic() + self.connect_timeout
        while time.monotonic() <= deadline:
            for index, address in enumerate(self.addresses):
                found = self._probe(index)
                if isinstance(found, str) or not found[1]:
                    continue  # unreachable, a standby that has not taken over, or another job
                membership, _, identity = found
                if identity == self.identity:
                    log.info("coordinator %s answers again after %.2fs", address, time.time() - t0)
                elif identity is not None and identity.epoch > (
                    self.identity.epoch if self.identity else -1
                ):
                    if not self._rejoin(membership, address, t0):
                        continue
                    self.identity = identity
                else:
                    continue  # an older coordinator (restarted, or one that stood down)
                self.address = address
                self.current = self.seals[index]
                self.switches += 1
                return
            time.sleep(0.2)
        self.failed = (
            f"lost the coordinator {lost} ({why}) and found none of {','.join(self.addresses)} "
            f"serving the job within {self.connect_timeout:.0f}s"
        )
        raise CoordinatorUnreachableError(self.failed)

    def _rejoin(self, membership: WorkerView, address: str, t_lost: float) -> bool:
        """Re-register with the standby at `address`, then wait until it rebuilt the job's
        state; False if it did not (it withdrew: the primary answers again)."""
        t_found = time.time()
        membership.register(self.record())
        membership.announce()
        deadline = time.monotonic() + self.rebuild_timeout
        beat = time.monotonic() + self.beat_s
        while not membership.rebuilt():
            now = time.monotonic()
            if now > deadline:
                log.warning("standby %s did not rebuild the job in time: searching on", address)
                return False
            if now >= beat:  # this process's heartbeat may be the thread waiting here
                membership.heartbeat()
                beat = now + self.beat_s
            time.sleep(0.05)
        t_rebuilt = time.time()
        self.takeovers.append(
            {"address": address, "search_s": t_found - t_lost, "rebuild_s": t_rebuilt - t_found}
        )
        log.warning(
            "registered with standby coordinator %s, which took the job over, %.2fs after "
            "looking for it; it rebuilt the job's state %.2fs later",
            address,
            t_found - t_lost,
            t_rebuilt - t_found,
        )
        return True

    def _probe(
        self, index: int
    ) -> tuple[WorkerView, bool | None, CoordinatorIdentity | None] | str:
        """(a client of the store of entry `index`, opened with that store's seal; whether it
        serves this job - None: no job -; its identity), or why not. An identity of another
        entry's coordinator is refused (rejected and logged like a forged value): only entry
        i's coordinator serves entry i's store (epoch i)."""
        address = self.addresses[index]
        try:
            store = BoundedStore(open_client(address, self.attempt_s), self.op_timeout)
            membership = WorkerView(SealedStore(store, self.member(), self.seals[index]))
            serves, identity = membership.serves_job(), membership.identity()
        except STORE_ERRORS as exc:
            return f"{address}: {first_line(exc)}"
        if identity is not None and identity.epoch != index:
            why = (
                f"{address}: its coordinator's identity names entry {identity.epoch} of "
                f"--deadpool-coordinator, not this store's entry {index}: refused"
            )
            log.warning("%s", why)
            return why
        return membership, serves, identity

    def rebind(self, key: str, value: str) -> str:
        """`value`, about to be written to `key` of the store serving now: a value sealed for
        another of the job's stores (sealed before a failover, its write repeated after it) is
        sealed again for this one; anything else (this store's, unsealed) as it is."""
        current = self.current
        if len(self.seals) == 1 or current.verifies(key, value):
            return value
        for seal in self.seals:
            if seal is not current and seal.verifies(key, value):
                return current.seal(key, seal.open(key, value).decode())
        return value


class LinkSeal(JobSeal):
    """The seal of whichever store a `CoordinatorLink` serves now: a process's connections
    follow the link from store to store (`FailoverStore`), and so does what seals and opens
    their values."""

    def __init__(self, link: CoordinatorLink) -> None:
        # No JobSeal state of its own (no super().__init__): every call goes to the link's.
        self.link = link
        self.job = link.seal.job

    def __repr__(self) -> str:
        return f"LinkSeal({self.link.current!r})"

    def for_store(self, store: int) -> JobSeal:
        return self.link.seals[store]

    def seal(self, key: str, payload: str) -> str:
        return self.link.current.seal(key, payload)

    def verifies(self, key: str, raw: str | bytes) -> bool:
        return self.link.current.verifies(key, raw)

    def open(self, key: str, raw: str | bytes) -> bytes:
        return self.link.current.open(key, raw)


class FailoverStore(BoundedStore):
    """The store client of the coordinator serving the job, whichever that is now: a failed
    operation waits for `CoordinatorLink` to find it (or its successor) and is repeated there;
    `CoordinatorUnreachableError` when none can be found."""

    def __init__(self, link: CoordinatorLink) -> None:
        self.link = link
        client, self.seen = link.client()
        super().__init__(client, link.op_timeout)

    def _moved(self) -> bool:
        return self.link.switches != self.seen  # another connection found the coordinator gone

    def _outgoing(self, key: str, value: str) -> str:
        return self.link.rebind(key, value)  # sealed for the store it now goes to

    def _call(self, fn: Callable[[Any], T], extra_s: float = 0.0) -> T:
        if self._moved():  # another connection of this process found the coordinator gone
            self.client, self.seen = self.link.client()
        while True:
            try:
                return super()._call(fn, extra_s)
            except dist.DistNetworkError as exc:
                self.client, self.seen = self.link.client(self.seen, first_line(exc))


def host_id() -> str:
    """hostname:os pid of this process (for a re-registration)."""
    return f"{socket.gethostname()}:{os.getpid()}"
