"""Many simulated ranks' store clients in one thread: torch's TCPStore wire protocol on greenlets.

What `deadpool bench control-plane`'s simulated ranks (`sim_ranks.py`) talk to the
coordinator's store with. torch's own client costs its process 50-80 us of CPU per request (a
send and a receive system call, and a hand-off between threads, for each), so 16,384 simulated
ranks on a two-core machine spend seconds of CPU on their side of one recovery - the time a
cluster spends on 16,384 hosts in parallel - and the benchmark measured the simulation instead
of the control plane. Here every simulated rank runs the real `Membership` code in a greenlet
of its own, on a `WireStore`: a non-blocking socket that sends exactly the requests torch's
client sends for each call (a `get` is a WAIT then a GET, as in torch; `set` and `queue_push`
are not answered), and parks the greenlet until its answer arrives; one `Hub` per
process waits for all the sockets at once (epoll) and resumes each greenlet with its answer.
Each connection still carries one request at a time, like a rank's; the processes' CPU per
request drops to about 7 us (measured: 256 connections, 8,192 requests of each kind).

The protocol (torch 2.x, `torch/csrc/distributed/c10d/TCPStore.cpp`): a request is a command
byte (`TCPStoreBackend.hpp`'s `QueryType`) and its arguments - a string or byte string as its
length (uint64, little-endian) and its bytes, a count as uint64, an `add`'s increment as int64;
keys carry the client's "/" prefix. A new connection sends VALIDATE with the magic number and a
PING with a nonce, which the server echoes. `tests/bench/test_store_wire.py` records torch's
client through a proxy and checks that a `WireStore` sends the same bytes and reads the same
answers, call for call.
"""

from __future__ import annotations

import datetime
import heapq
import itertools
import os
import selectors
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

try:
    import greenlet
except ImportError as exc:  # pragma: no cover - greenlet comes with the [bench] and [test] extras
    raise ImportError(
        "deadpool bench control-plane simulates ranks on greenlets: pip install greenlet "
        "(or pip install -e '.[bench]')"
    ) from exc

VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT = range(7)
DELETE_KEY = 8
MULTI_GET, CANCEL_WAIT, PING, QUEUE_PUSH = 10, 12, 13, 14
MAGIC = 0x3C85F7CE
STOP_WAITING, WAIT_CANCELED = 0, 1
READY = 0
FOREVER_S = 24 * 3600.0  # a wait this long gets no timer

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_U32 = struct.Struct("<I")

Parser = Callable[[bytearray], tuple[Any, int] | None]
"""Reads one answer from the start of a buffer: (value, bytes used), or None if incomplete."""


def _text(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else bytes(value)
    return _U64.pack(len(data)) + data


def _fixed(size: int, unpack: Callable[[bytes], Any]) -> Parser:
    def parse(buf: bytearray) -> tuple[Any, int] | None:
        return (unpack(bytes(buf[:size])), size) if len(buf) >= size else None

    return parse


def _strings(count: int) -> Parser:
    """`count` length-prefixed byte strings, one after the other."""

    def parse(buf: bytearray) -> tuple[Any, int] | None:
        out, at = [], 0
        for _ in range(count):
            if len(buf) < at + 8:
                return None
            (size,) = _U64.unpack_from(buf, at)
            if len(buf) < at + 8 + size:
                return None
            out.append(bytes(buf[at + 8 : at + 8 + size]))
            at += 8 + size
        return out, at

    return parse


_BYTE = _fixed(1, lambda b: b[0])
_INT = _fixed(8, lambda b: _I64.unpack(b)[0])
_ONE_STRING = _strings(1)


class _Waker:
    """A file object's readiness resumes one parked greenlet."""

    def __init__(self, task: greenlet.greenlet) -> None:
        self.task = task

    def readable(self) -> None:
        self.task.switch()


class Hub:
    """The loop that resumes each greenlet once its socket answered or its timer ran out."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.loop = greenlet.greenlet(self._run)
        self._timers: list[tuple[float, int, greenlet.greenlet]] = []
        self._cancelled: set[int] = set()
        self._ids = itertools.count()
        self._ready: deque[tuple[greenlet.greenlet, tuple[Any, ...]]] = deque()

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start `fn(*args)` in a greenlet of its own at the hub's next turn."""
        self._ready.append((greenlet.greenlet(fn, parent=self.loop), args))

    def run(self, main: Callable[[], Any]) -> Any:
        """Run the hub until `main()` (in a greenlet, it may spawn others) returns; its result.
        An exception in any greenlet ends the hub and is raised here."""
        caller, result = greenlet.getcurrent(), []

        def wrapped() -> None:
            result.append(main())
            caller.switch()

        self.spawn(wrapped)
        self.loop.switch()
        return result[0]

    def each(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """`fn(item)` for every item, each in a greenlet of its own, all at once; their
        results, once all returned (call it from a greenlet of this hub)."""
        results: list[Any] = [None] * len(items)
        left = [len(items)]
        caller = greenlet.getcurrent()

        def one(i: int, item: Any) -> None:
            results[i] = fn(item)
            left[0] -= 1
            if left[0] == 0:
                self._ready.append((caller, ()))

        for i, item in enumerate(items):
            self.spawn(one, i, item)
        if items:
            self.loop.switch()
        return results

    def call_later(self, seconds: float) -> int:
        """Resume the calling greenlet (with None) in `seconds`, unless `cancel`led first."""
        timer = next(self._ids)
        heapq.heappush(self._timers, (time.monotonic() + seconds, timer, greenlet.getcurrent()))
        return timer

    def cancel(self, timer: int) -> None:
        self._cancelled.add(timer)

    def sleep(self, seconds: float) -> None:
        """Park the calling greenlet for `seconds`."""
        self.call_later(seconds)
        self.loop.switch()

    def wait_readable(self, fileobj: Any) -> None:
        """Park the calling greenlet until `fileobj` can be read."""
        self.selector.register(fileobj, selectors.EVENT_READ, _Waker(greenlet.getcurrent()))
        try:
            self.loop.switch()
        finally:
            self.selector.unregister(fileobj)

    def _run(self) -> None:
        while True:
            while self._ready:
                task, args = self._ready.popleft()
                task.switch(*args)
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                _, timer, task = heapq.heappop(self._timers)
                if timer in self._cancelled:
                    self._cancelled.discard(timer)
                else:
                    task.switch()
            if self._ready:
                continue
            timeout = max(0.0, self._timers[0][0] - now) if self._timers else None
            for key, _ in self.selector.select(timeout):
                key.data.readable()


class WireStore:
    """One simulated rank's connection to a TCPStore: the `dist.Store` calls `Membership`
    makes, as torch's client makes them on the wire; each call parks its greenlet until
    answered. Not thread-safe: one greenlet at a time per connection, as torch's lock does."""

    def __init__(self, hub: Hub, address: str, timeout_s: float, prefix: str = "/") -> None:
        host, _, port = address.rpartition(":")
        self.hub = hub
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = _U32.pack(os.getpid() & 0xFFFFFFFF)
        self.sock.sendall(bytes([VALIDATE]) + _U32.pack(MAGIC) + bytes([PING]) + nonce)
        if self._recv_exactly(4) != nonce:
            raise dist.DistStoreError(f"the store at {address} did not answer the handshake")
        self.sock.setblocking(False)
        self.buf = bytearray()
        self.waiting: list[tuple[Parser, greenlet.greenlet]] = []
        hub.selector.register(self.sock, selectors.EVENT_READ, self)

    def _recv_exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise dist.DistNetworkError("the store closed the connection")
            data += chunk
        return data

    # ------------------------------------------------------------------ the hub's side
    def readable(self) -> None:
        """Called by the hub: read what arrived and resume the greenlets whose answers are in."""
        try:
            chunk = self.sock.recv(1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self.hub.selector.unregister(self.sock)
            for _, task in self.waiting:
                task.throw(dist.DistNetworkError("the store closed the connection"))
            return
        self.buf += chunk
        while self.waiting:
            parsed = self.waiting[0][0](self.buf)
            if parsed is None:
                return
            value, used = parsed
            del self.buf[:used]
            _, task = self.waiting.pop(0)
            task.switch(value)

    # ------------------------------------------------------------------ requests
    def _key(self, key: str) -> bytes:
        return _text(self.prefix + key)

    def _keys(self, keys: Sequence[str]) -> bytes:
        return _U64.pack(len(keys)) + b"".join(self._key(k) for k in keys)

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view) :]
            except BlockingIOError:
                self.hub.sleep(0.001)  # the kernel's buffer is full: let the server read

    def _ask(self, data: bytes, parser: Parser) -> Any:
        self._send(data)
        self.waiting.append((parser, greenlet.getcurrent()))
        return self.hub.loop.switch()

    def _wait(self, keys: Sequence[str], timeout_s: float) -> None:
        """torch's doWait: WAIT, and on a timeout CANCEL_WAIT, then DistStoreError."""
        self._send(bytes([WAIT]) + self._keys(keys))
        entry = (_BYTE, greenlet.getcurrent())
        self.waiting.append(entry)
        timer = self.hub.call_later(timeout_s) if timeout_s < FOREVER_S else None
        answer = self.hub.loop.switch()
        if entry not in self.waiting:  # answered before the timer
            if timer is not None:
                self.hub.cancel(timer)
            if answer != STOP_WAITING:
                raise dist.DistStoreError(f"store answered {answer} to a wait")
            return
        self.waiting.remove(entry)  # timed out: cancel, as torch does
        answer = self._ask(bytes([CANCEL_WAIT]), _BYTE)
        if answer != WAIT_CANCELED:  # it answered the wait just before the cancel
            self._ask(b"", _BYTE)
        raise dist.DistStoreError(f"wait timeout after {timeout_s * 1e3:.0f}ms, keys: {keys}")

    def set(self, key: str, value: str | bytes) -> None:
        self._send(bytes([SET]) + self._key(key) + _text(value))

    def get(self, key: str) -> bytes:
        self._wait([key], self.timeout_s)
        return self._ask(bytes([GET]) + self._key(key), _ONE_STRING)[0]

    def add(self, key: str, value: int) -> int:
        return self._ask(bytes([ADD]) + self._key(key) + _I64.pack(value), _INT)

    def check(self, keys: list[str]) -> bool:
        return self._ask(bytes([CHECK]) + self._keys(keys), _BYTE) == READY

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait(keys, self.timeout_s if timeout is None else timeout.total_seconds())

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._wait(keys, self.timeout_s)
        return self._ask(bytes([MULTI_GET]) + self._keys(keys), _strings(len(keys)))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        request = bytes([COMPARE_SET]) + self._key(key) + _text(expected) + _text(desired)
        return self._ask(request, _ONE_STRING)[0]

    def delete_key(self, key: str) -> bool:
        return self._ask(bytes([DELETE_KEY]) + self._key(key), _INT) == 1

    def queue_push(self, key: str, value: str | bytes) -> None:
        self._send(bytes([QUEUE_PUSH]) + self._key(key) + _text(value))

    def prefixed(self, prefix: str) -> WireStore:
        """This connection seen through `dist.PrefixStore(prefix, ...)` (keys "prefix/key")."""
        view = object.__new__(WireStore)
        view.__dict__.update(self.__dict__)
        view.prefix = f"{self.prefix}{prefix}/"
        return view
