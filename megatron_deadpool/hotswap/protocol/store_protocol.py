"""The calls DeadPool makes on the job's store, as typing protocols: what torch's `TCPStore`, its
prefix views, the bounded and failover clients (`connection.py`, `failover.py`), the benchmark's
wire client and the in-memory store of the unit tests all answer alike (`sealed_store.SealedStore`
reads and writes the job's keys through them)."""

from __future__ import annotations

import datetime
from typing import Protocol, runtime_checkable


class StoreLike(Protocol):
    """The calls a member makes on the job's store through `SealedStore`: torch's `TCPStore`
    (and its prefix views), the bounded and failover clients of `connection.py` and
    `failover.py`, the benchmark's wire client (`bench/scale/store_wire.py`) and the in-memory store
    of the unit tests (`memory_store.py`) all answer them alike."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...

    def check(self, keys: list[str]) -> bool: ...

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None: ...

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...

    def queue_push(self, key: str, value: str) -> None: ...

    def delete_key(self, key: str) -> bool: ...


@runtime_checkable
class ServingStore(StoreLike, Protocol):
    """What the coordinator's own store answers besides (the coordinator's inbox, the keys of
    finished generations, the survivors' wake-ups)."""

    def queue_pop(self, key: str) -> bytes: ...

    def list_keys(self) -> list[str]: ...

    def multi_set(self, keys: list[str], values: list[str]) -> None: ...


@runtime_checkable
class ConfirmedSets(StoreLike, Protocol):
    """A client whose `set` confirms itself with a request of its own (torch's `set` is not
    answered): `connection.BoundedStore`, and the benchmark's wire client as it mimics it. Its
    `set_then_add` lets the answer of an add to a counter, made next on the same connection,
    confirm the set instead (the server answers one connection's requests in order): one
    request less for every value that is counted as it is written."""

    def set_then_add(self, key: str, value: str, counter: str, amount: int) -> int: ...
