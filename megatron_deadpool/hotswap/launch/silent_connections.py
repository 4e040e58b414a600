"""Connections to the store that never made a request, dropped when they crowd the job's out.

torch's store server (libuv) accepts every connection and holds its descriptor until the peer
closes it. Keep-alive (`store_files.keep_alive`) frees the connections of a host that vanished,
not those of a live host that connects and stays silent - a port scanner, a health check that
never hangs up, a stray `nc`. Under an open-files limit sized to the job, enough of them lock
the job's processes out: the server is at its limit, and libuv accepts and at once closes
whatever else connects ("Connection reset by peer"; measured: 100 silent connections with 64
allowed files).

Every client of the store speaks first, and every DeadPool process makes a request as soon as it
has connected: torch's client sends its opening, `OPENING_BYTES` (its validation message and a
ping), in one write the moment it connects, and DeadPool's reachability probes hang up at once.
So a connection over which no more than that opening ever arrived, nothing for `GRACE_S`
seconds, made no request: it is no client of the job - silent, one that sent a byte or two, or
a client that connected and never asked anything. A client blocked in a wait (a rank waiting for
the next plan sends nothing for minutes) has made its request and is kept, and so are the
hosting process's own clients of its store. (torch opens another connection of its own only
where a process group is split or shrunk - `ProcessGroup.split_group`, `shrink_group` - and
neither DeadPool nor Megatron-Core does either.) `SilentConnections`, a
thread of the process that hosts the store (`deadpool coordinator`, a standby, the local
launchers), counts that process's open files every `INTERVAL_S` seconds (or less often, so as to
spend at most `BUSY_SHARE` of its time); only when they exceed what the job needs
(`store_files.store_files_needed`), or 90% of its limit, does it look at each connection the
server accepted (a socket in /proc/self/fd whose local port is the store's) and shut the silent
ones down: the server then reads end-of-file and closes them itself. Only then, because reading
every connection's `TCP_INFO` costs the host's CPU in proportion to the job's size.

Not covered: a peer that speaks torch's protocol and makes requests of its own keeps its
connection (so does a job's process). Against a host that does that on purpose the network must
be the cluster's own (README, trust model).
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ...devices.threads import DeviceThread
from ..protocol.store_files import OpenFiles

log = logging.getLogger(__name__)

GRACE_S = 10.0
"""How long a connection may go without a request from its start before it may be dropped (a
process of the job makes its first request within milliseconds of connecting; on a loaded host
within seconds)."""

INTERVAL_S = 2.0
"""How often the hosting process counts its open files."""

BUSY_SHARE = 0.05
"""The most of its time the thread spends looking: a look that took t seconds is followed by a
pause of at least t / BUSY_SHARE (where the kernel cannot count a process's descriptors, before
Linux 6.2, each count lists them: 0.18 s for 20,000 descriptors here)."""

CROWDED_SHARE = 0.9
"""The share of the soft open-files limit past which the thread looks, whatever the job needs."""

OPENING_BYTES = 10
"""What every client of torch's store sends as it connects, before any request, in one write:
VALIDATE (one byte) with its 4-byte magic number, then PING (one byte) with a 4-byte nonce
(torch 2.4 and later; DeadPool needs 2.6). A request adds at least its command byte, and every
request DeadPool makes names a key (an 8-byte length and the name): more than this has arrived
over any connection that made one, from a client with or without the ping."""

_LAST_DATA_RECV = 52  # struct tcp_info (linux/tcp.h): __u32 tcpi_last_data_recv, ms
_BYTES_RECEIVED = 128  # __u64 tcpi_bytes_received (Linux 4.1+)


@dataclass(frozen=True)
class Silence:
    """What `TCP_INFO` says of a connection: bytes that arrived over it, and milliseconds since
    the last did (since it was established, when none did)."""

    received: int
    quiet_ms: int

    def silent_for(self, seconds: float) -> bool:
        """No more than a client's opening ever arrived (no request), nothing of it for
        `seconds` (or nothing at all, and the connection is at least `seconds` old)."""
        return self.received <= OPENING_BYTES and self.quiet_ms >= seconds * 1000


def silence(sock: socket.socket) -> Silence | None:
    """`sock`'s `Silence`; None where the kernel does not report bytes received."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    if len(info) < _BYTES_RECEIVED + 8:
        return None
    (quiet_ms,) = struct.unpack_from("I", info, _LAST_DATA_RECV)
    (received,) = struct.unpack_from("Q", info, _BYTES_RECEIVED)
    return Silence(received, quiet_ms)


def crowded(allowed: int) -> int:
    """The open files past which a look is due: what the job needs (`allowed`), or
    `CROWDED_SHARE` of the soft limit if that is lower (a limit set to just what the job needs
    is reached by the silent connections, never passed)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return allowed
    return min(allowed, int(soft * CROWDED_SHARE))


def accepted(port: int, fds: list[int]) -> Iterator[socket.socket]:
    """Each of `fds` that is a connection this process accepted on local port `port`, as a
    socket object that borrows the descriptor (`_borrowed`)."""
    for sock in _borrowed(fds):
        if _tcp(sock):
            local, peer = _ends(sock)
            if peer and local[1] == port:
                yield sock


def own_clients(port: int, fds: list[int]) -> set[tuple[str, int]]:
    """The local ends (`endpoint`) of this process's own connections to port `port` (the hosted
    store's own client): the peers of the connections the server accepted from this process."""
    own = set()
    for sock in _borrowed(fds):
        if _tcp(sock):
            local, peer = _ends(sock)
            if peer and peer[1] == port and local[1] != port:
                own.add(endpoint(local))
    return own


def endpoint(address: tuple[Any, ...]) -> tuple[str, int]:
    """(host, port) of a socket address, an IPv4-mapped IPv6 host as IPv4 (torch's client may
    connect over an IPv6 socket to the store's IPv4 listener, whose side sees plain IPv4)."""
    host = str(address[0])
    if host.startswith("::ffff:") and "." in host:
        host = host[len("::ffff:") :]
    return host, int(address[1])


def _borrowed(fds: list[int]) -> Iterator[socket.socket]:
    """Each of `fds` that is a socket, as a socket object that borrows the descriptor (no
    duplicate: there may be no descriptor left to make one); the caller must not close it. One
    closed and reused meanwhile is judged as what it is now."""
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            yield sock
        finally:
            sock.detach()  # the descriptor stays its owner's, whatever happened


def _tcp(sock: socket.socket) -> bool:
    return sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM


def _ends(sock: socket.socket) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(local, peer) addresses; the peer is empty where there is none (a listening socket)."""
    try:
        local = sock.getsockname()
    except OSError:
        return (("", 0), ())
    try:
        return local, sock.getpeername()
    except OSError:
        return local, ()


def drop_silent(port: int, fds: list[int], grace_s: float = GRACE_S) -> list[str]:
    """Shut down every connection among `fds` accepted on `port` that is `Silence.silent_for`
    `grace_s` seconds, except those from this process itself; their peers ("host:port"). Torch's
    server then reads end-of-file on each and closes it."""
    own = own_clients(port, fds)
    dropped = []
    for sock in accepted(port, fds):
        try:
            peer = sock.getpeername()
            quiet = silence(sock)
            if quiet is None or not quiet.silent_for(grace_s) or endpoint(peer) in own:
                continue
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            continue
        dropped.append(f"{peer[0]}:{peer[1]}")
    return dropped


class SilentConnections(DeviceThread):
    """The thread of a store's host that drops silent connections once its open files exceed
    `allowed`, with a warning naming them."""

    def __init__(
        self, allowed: int, *, grace_s: float = GRACE_S, interval_s: float = INTERVAL_S
    ) -> None:
        super().__init__(name="deadpool-silent-connections", daemon=True)
        self.port, self.allowed = 0, allowed
        self.grace_s, self.interval_s = grace_s, interval_s
        self._halt = threading.Event()
        self._files = OpenFiles()  # now, while a descriptor is still to be had

    def watch(self, port: int) -> None:
        """Start watching the store listening on `port` (`membership.host_store`'s
        `on_listen`)."""
        self.port = port
        self.start()

    def run(self) -> None:
        pause = self.interval_s
        try:
            while not self._halt.wait(pause):
                t0 = time.monotonic()
                self._look()
                pause = max(self.interval_s, (time.monotonic() - t0) / BUSY_SHARE)
        finally:
            self._files.close()

    def _look(self) -> None:
        if self._files.count() <= crowded(self.allowed):
            return
        dropped = drop_silent(self.port, self._files.list(), self.grace_s)
        if not dropped:
            return
        shown = ", ".join(dropped[:5]) + (
            f" and {len(dropped) - 5} more" if len(dropped) > 5 else ""
        )
        log.warning(
            "dropped %d connection(s) to the job's store that sent no request in %gs (no client "
            "of the job): %s",
            len(dropped),
            self.grace_s,
            shown,
        )

    def stop(self) -> None:
        """End the thread (at its next look)."""
        self._halt.set()
