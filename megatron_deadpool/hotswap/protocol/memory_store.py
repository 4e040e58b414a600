"""An in-memory store that answers the calls `SealedStore` makes exactly as torch's TCPStore does.

For running the coordinator (and any role view's code) without a server: its decisions are
unit-tested on it in milliseconds (`tests/hotswap/coordinator/test_decisions.py`). What "exactly" means is
held to torch's `TCPStore` by one conformance test (`tests/hotswap/protocol/test_store_conformance.py`,
every behaviour below checked on both): values are bytes (text is UTF-8 encoded); `get`,
`multi_get` and `wait` block until their keys exist and raise `DistStoreError` after the
store's timeout; `add` creates a missing key at 0 and keeps the count as decimal text;
`compare_set` sets `desired` when the current value equals `expected` - a missing key counting
as equal to "" - and answers the value the key holds afterwards (for a missing key and another
`expected`: `expected`, nothing created); `queue_pop` blocks until `queue_push` gives it a
value, oldest first, and a queue's key exists while the queue is not empty; `delete_key`,
`list_keys` and `num_keys` see the keys that hold values, not the queues. `clone()` is
another connection to the same data, with a timeout of its own. Thread-safe; every blocking
call wakes when another thread changes the data.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


class _Data:
    """The data every connection of one store shares."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.queues: dict[str, deque[bytes]] = {}
        self.changed = threading.Condition()

    def exists(self, key: str) -> bool:
        """A key exists while it holds a value or a queue that is not empty (as in torch)."""
        return key in self.values or bool(self.queues.get(key))


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class MemoryStore:
    """One connection to an in-memory store (`clone()` opens another to the same data)."""

    def __init__(
        self,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        _data: _Data | None = None,
    ) -> None:
        self._data = _data or _Data()
        self.timeout = timeout

    # ------------------------------------------------------------------ connections
    def clone(self) -> MemoryStore:
        return MemoryStore(self.timeout, self._data)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout = timeout

    # ------------------------------------------------------------------ keys
    def set(self, key: str, value: str | bytes) -> None:
        with self._data.changed:
            self._data.values[key] = _bytes(value)
            self._data.changed.notify_all()

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        with self._data.changed:
            self._data.values.update(zip(keys, map(_bytes, values), strict=True))
            self._data.changed.notify_all()

    def get(self, key: str) -> bytes:
        return self._when(lambda v: v.get(key), [key])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        def all_there(values: dict[str, bytes]) -> list[bytes] | None:
            return [values[k] for k in keys] if all(k in values for k in keys) else None

        return self._when(all_there, keys)

    def check(self, keys: list[str]) -> bool:
        with self._data.changed:
            return all(self._data.exists(k) for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        def all_there(_: dict[str, bytes]) -> bool | None:
            return True if all(self._data.exists(k) for k in keys) else None

        self._when(all_there, keys, timeout)

    def add(self, key: str, amount: int) -> int:
        with self._data.changed:
            current = self._data.values.get(key, b"0")
            try:
                value = int(current) + amount
            except ValueError:
                raise dist.DistStoreError(f"add: {key} does not hold an integer") from None
            self._data.values[key] = str(value).encode()
            self._data.changed.notify_all()
            return value

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        expected_b, desired_b = _bytes(expected), _bytes(desired)
        with self._data.changed:
            current = self._data.values.get(key)
            if current is None and expected_b != b"":
                return expected_b
            if current is None or current == expected_b:
                self._data.values[key] = desired_b
                self._data.changed.notify_all()
                return desired_b
            return current

    def delete_key(self, key: str) -> bool:
        with self._data.changed:
            return self._data.values.pop(key, None) is not None

    def list_keys(self) -> list[str]:
        """Every key holding a value (not the queues, as in torch)."""
        with self._data.changed:
            return list(self._data.values)

    def num_keys(self) -> int:
        with self._data.changed:
            return len(self._data.values)

    # ------------------------------------------------------------------ queues
    def queue_push(self, key: str, value: str | bytes) -> None:
        with self._data.changed:
            self._data.queues.setdefault(key, deque()).append(_bytes(value))
            self._data.changed.notify_all()

    def queue_pop(self, key: str) -> bytes:
        def first(_: dict[str, bytes]) -> bytes | None:
            queue = self._data.queues.get(key)
            return queue.popleft() if queue else None

        return self._when(first, [key])

    # ------------------------------------------------------------------ blocking
    def _when(
        self,
        ready: Callable[[dict[str, bytes]], T | None],
        keys: list[str],
        timeout: datetime.timedelta | None = None,
    ) -> T:
        """`ready(values)` once it is not None; `DistStoreError` after the timeout."""
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        with self._data.changed:
            while True:
                value = ready(self._data.values)
                if value is not None:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise dist.DistStoreError(
                        f"wait timeout after {limit * 1e3:.0f}ms, keys: {keys}"
                    )
                self._data.changed.wait(left)
