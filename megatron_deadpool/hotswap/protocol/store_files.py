"""The open-files limit of a process that hosts the job's store: raised to fit the job, or refused.

torch's store server (`TCPStore`, hosted by `deadpool coordinator`, a standby coordinator and the
local launchers) holds one descriptor per connection, and every process of a job keeps
`CONNECTIONS_PER_PROCESS` connections to it (its client, and the one its waiter thread blocks
on). Under the common default soft limit of 1,024 open files a job of more than ~500 processes
could not connect them all: the server cannot accept a connection past its limit, and the rank
that made it times out. So a process that hosts the store raises its soft limit as far as its
hard limit allows (`reserve_files`), and refuses to start (`OpenFilesError`, exit code 2) when
even the hard limit cannot hold the job, naming `ulimit -n` and the number it needs.

How many (`store_files_needed`): the connections of every process the job may have at once - its
actives, its spares, and the spares' number again for the processes they replace. Plus `RESERVE`
for the host process's own files (its own clients of the store, its logs, a standby's probes of
the other coordinators).

Half-open connections (`keep_alive`). A process that dies on a live host has its connections
closed by the kernel, but one on a host that vanished (power lost, cut off) leaves them
half-open: nothing ever arrives on them, and torch's server (libuv) would hold their descriptors
for as long as it runs. torch has no keep-alive setting, but the job's store listens on a socket
DeadPool makes (`membership.host_store`), and on Linux a connection accepted from a listening
socket inherits its keep-alive options (`SO_KEEPALIVE`, `TCP_KEEPIDLE`, `TCP_KEEPINTVL`,
`TCP_KEEPCNT`) and `TCP_USER_TIMEOUT`. So the kernel probes a connection that has been silent
for half the keep-alive time, and when its host has not answered for the whole of it (or has left
data unacknowledged that long) the connection fails with ETIMEDOUT; torch's server then closes
it (its read callback closes a connection on any error), and the descriptor is free again. A
live host's kernel answers the probes whatever its process does (stopped, blocked in a wait), so
only connections to hosts that are gone are dropped.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import resource
import socket
import struct

from ...errors import OpenFilesError

CONNECTIONS_PER_PROCESS = 2
"""Store connections each process of a job keeps open (measured: about two)."""

RESERVE = 64
"""Files the hosting process needs besides the job's connections."""


def store_files_needed(world_size: int, spares: int, per_process: int = 0) -> int:
    """Open files a process hosting the store of a job of `world_size` ranks and `spares` spares
    needs; `per_process`: files it holds of each process besides its connections (a launcher's
    output files and process handles)."""
    processes = world_size + 2 * spares  # the spares again: the processes they replace
    return processes * (CONNECTIONS_PER_PROCESS + per_process) + RESERVE


def reserve_files(need: int, what: str) -> int:
    """Raise this process's soft open-files limit as far as its hard limit allows (never lower
    it); `OpenFilesError` when the hard limit is below `need`. The soft limit it now has."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        raise OpenFilesError(
            f"open files: {what} needs {need} open files, but this process may open at most "
            f"{hard} (its hard limit); raise it (`ulimit -n {need}` before starting, or the "
            "cluster's limits.conf / Slurm's PropagateResourceLimits) or run a smaller job"
        )
    target = hard if hard != resource.RLIM_INFINITY else max(need, soft)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def keep_alive(sock: socket.socket, seconds: float) -> None:
    """Make the connections `sock` (a listening socket) accepts fail once their host has not
    answered for `seconds`: keep-alive probes after `seconds / 2` of silence, every `seconds / 12`,
    and `TCP_USER_TIMEOUT` of `seconds` (which, with keep-alive on, decides when the connection
    is given up). Whole seconds for the probes, at least 1."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"keep-alive: a finite number of seconds > 0, got {seconds!r}")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(seconds / 2)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, int(seconds / 12)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 6)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1000, int(seconds * 1000)))


_GETDENTS64 = {"x86_64": 217, "aarch64": 61}  # the syscall's number (Perlmutter's, Vista's CPUs)


class OpenFiles:
    """This process's descriptors, counted and listed without taking one more: at its limit a
    process cannot open /proc/self/fd to list it (os.listdir would fail with EMFILE, and a
    reserve descriptor given up for the listing is taken by the store's accept thread as soon
    as it is free). The folder is opened once, here; then `count` asks its size (the number of
    descriptors, on Linux 6.2 and later) and `list` reads it again from the start with
    getdents64. Where that syscall's number is not known, `list` falls back on os.listdir."""

    def __init__(self) -> None:
        self._dir = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
        self._buf = ctypes.create_string_buffer(1 << 16)
        self._syscall = _GETDENTS64.get(platform.machine())
        self._libc = ctypes.CDLL(None, use_errno=True) if self._syscall else None

    def count(self) -> int:
        """How many descriptors this process holds."""
        size = os.fstat(self._dir).st_size
        return size if size > 0 else len(self.list())

    def list(self) -> list[int]:
        """The descriptors this process holds (its own folder's among them)."""
        if self._libc is None:
            return [int(name) for name in os.listdir("/proc/self/fd")]
        os.lseek(self._dir, 0, os.SEEK_SET)
        out: list[int] = []
        while True:
            n = self._libc.syscall(self._syscall, self._dir, self._buf, len(self._buf))
            if n < 0:
                raise OSError(ctypes.get_errno(), "getdents64 on /proc/self/fd")
            if n == 0:
                return out
            raw, at = self._buf.raw[:n], 0
            while at < n:  # struct linux_dirent64: u64 ino, s64 off, u16 reclen, u8 type, name
                (reclen,) = struct.unpack_from("H", raw, at + 16)
                name = raw[at + 19 : raw.index(b"\0", at + 19)]
                if name.isdigit():
                    out.append(int(name))
                at += reclen

    def close(self) -> None:
        os.close(self._dir)
