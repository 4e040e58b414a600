"""Unblocking gloo collectives whose peer is dead or stopped: shut the group's connections.

`ProcessGroup.abort()` does nothing for gloo in torch 2.13 (verified: a thread blocked in an
`all_reduce` with a SIGSTOPped peer stays blocked after `abort()`, `shutdown()` and
`_abort_process_group()`), and a stopped peer never closes its sockets, so the collective
would wait for the group's timeout. What does return at once: `shutdown(2)` of the TCP
connections gloo's pairs use. gloo's event loop then sees the connection end, fails the
pair, and the blocked operation raises ("Connection closed by peer") within milliseconds.

Which sockets: gloo connects every pair of a group's full mesh while the group is created
(`ProcessGroupGloo`'s constructor, unless ``TORCH_GLOO_LAZY_INIT`` defers it, which
`check_settings` refuses), and every group - `init_process_group`, `new_group`, Megatron's
groups - is created by `torch.distributed.distributed_c10d._new_process_group_helper`.
`track_connections()` wraps that function once per process and records the established TCP
connections that appear during a gloo group's creation (never the store's: its port is
excluded). `shutdown_connections()` shuts those that still exist. Listening sockets are left
alone: gloo's listener thread kills the process (SIGABRT) when its listening socket is shut
down.

What the shutdown does not reach: a send that was under way when its connection ended. gloo
(tcp `Pair`) queues the unwritten rest of a message that did not fit the socket's buffer and
writes it as the peer reads; when the connection then ends, it fails the pair's pending
operations but not a queued send, and a write error on it (`EPIPE`, `ECONNRESET`) is ignored:
the operation neither completes nor fails, and its waiter blocks until the group's timeout (a
collective) or for good (`isend`'s `wait()`). Measured: a 256 MB `isend` to a peer that
stopped reading stays blocked after `abort_groups`; seen in CI as a survivor whose main thread
stayed in a tensor-parallel all-reduce of Megatron's backward after its abort, its peer's
connection closed, until the coordinator presumed it dead. So, in CPU mode (where every group is
gloo), `interruptible_waits()` makes a wait on a collective without a bound of its own wait in
slices of `WAIT_SLICE`, and raise `DistBackendError` after a slice once this process's groups
were aborted (from `shutdown_connections` until a group is created again). Not covered: a
point-to-point operation (and gloo's `reduce_scatter_tensor`), whose timed wait would fail the
connection (`interruptible_waits`); a receive under way is not failed either (gloo keeps it
as the pair's current read). Not on GPUs: an NCCL operation's `wait(timeout)` blocks the CPU
on the kernel, unlike its `wait()`.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import socket
import stat
import threading
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch.distributed as dist

from ..errors import ConfigError

_LOCK = threading.Lock()
_TRACKED: dict[int, str] = {}  # socket inode -> the group that opened it
_INSTALLED: dict[str, Callable[..., Any]] = {}
_ABORTED = threading.Event()  # set by the abort, cleared when a group is created again

WAIT_SLICE = datetime.timedelta(milliseconds=200)
"""How long an interruptible wait blocks before it looks whether the groups were aborted."""

_SLICE_OVER = "Operation timed out!"
"""The first line of what torch's `Work.wait(timeout)` raises when the timeout passed (no other
effect: the operation goes on, a later wait returns its result; torch 2.13 and 2.14)."""


def check_settings(environ: MutableMapping[str, str] | None = None) -> None:
    """Refuse settings under which a gloo group's connections are not made at its creation, or
    every group gets a gloo helper group no spare can build (torch's DETAIL debug level)."""
    env = os.environ if environ is None else environ
    value = env.get("TORCH_GLOO_LAZY_INIT", "")
    if value.strip().lower() in ("1", "true", "yes", "on"):
        raise ConfigError(
            f"TORCH_GLOO_LAZY_INIT={value}: DeadPool unblocks gloo collectives with a dead or "
            "stopped peer by shutting down the connections a group opens at its creation; "
            "unset it"
        )
    debug = env.get("TORCH_DISTRIBUTED_DEBUG", "")
    if debug.strip().upper() == "DETAIL":
        # Measured: torch 2.13 fails a spare's private world ("fn INTERNAL ASSERT FAILED ...
        # Not implemented"), torch 2.14.1 crashes the spare (SIGSEGV) - every spare, so the
        # first failure ends the job out of redundancy.
        raise ConfigError(
            f"TORCH_DISTRIBUTED_DEBUG={debug}: torch then wraps every process group in a "
            "checking wrapper with a gloo helper group, which a spare cannot create in the "
            "world of its own it builds in (torch fails or crashes every spare); use "
            "TORCH_DISTRIBUTED_DEBUG=INFO or unset it"
        )


def socket_fds() -> dict[int, int]:
    """fd -> socket inode for every socket descriptor of this process.

    One `fstat` per descriptor (a socket's inode is the number /proc shows as `socket:[N]`):
    this runs twice per group Megatron creates, and `readlink` of each /proc/self/fd entry
    instead cost three to four times as much, about 0.1 s over a generation's ~60 groups."""
    out: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # pragma: no cover - no /proc
        return out
    for fd in fds:
        try:
            st = os.fstat(int(fd))
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            out[int(fd)] = st.st_ino
    return out


def _new_connections(before: set[int], exclude_ports: set[int | None]) -> set[int]:
    """Inodes of this process's connected TCP sockets that are not in `before` and not to or
    from one of `exclude_ports` (the stores'). Each new socket is asked itself, through a
    duplicate of its descriptor (`_ends`): reading /proc/net/tcp instead cost ~7 ms a read,
    0.85 s over Megatron's ~60 groups of a generation."""
    found: set[int] = set()
    for fd, inode in socket_fds().items():
        if inode in before:
            continue
        ends = _ends(fd)
        if ends is not None and not exclude_ports & {ends[0][1], ends[1][1]}:
            found.add(inode)
    return found


def connections() -> list[str]:
    """Every connected TCP socket of this process as "local port -> peer host:port" (for a
    log that must say what a stuck collective could still be waiting on)."""
    out = []
    for fd in socket_fds():
        ends = _ends(fd)
        if ends is not None:
            out.append(f"{ends[0][1]} -> {ends[1][0]}:{ends[1][1]}")
    return out


def _ends(fd: int) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """(local, peer) addresses of `fd` if it is a connected TCP socket (not a listener: gloo's
    listener thread kills the process if its socket is shut down), else None; asked through a
    duplicate of the descriptor."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        if sock.type != socket.SOCK_STREAM or sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_ACCEPTCONN
        ):
            return None
        return sock.getsockname(), sock.getpeername()
    except OSError:  # not connected
        return None
    finally:
        sock.close()


def store_port_of(store: Any) -> int | None:
    """The port of the TCP store under `store`'s prefixes (None: not a TCP store; a store
    written in Python says its own, `devices.repair_store`)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return getattr(store, "port", None)


def track_connections() -> None:
    """Record the connections of every gloo group created from now on (idempotent)."""
    c10d = dist.distributed_c10d
    if "helper" in _INSTALLED:
        return
    real = c10d._new_process_group_helper
    _INSTALLED["helper"] = real

    @functools.wraps(real)
    def helper(group_size: int, group_rank: int, ranks: Any, backend: Any, store: Any, *a, **k):
        if (
            "gloo" not in str(backend)
            or group_rank is None
            or group_size == 1
            or k.get("enable_reconfigure")
        ):
            # no connection to record: another backend, a group this process is not in, a
            # group of one, or one created to be reconfigured (it connects at its repair,
            # which records them: `devices.reconfigure.repair`)
            return real(group_size, group_rank, ranks, backend, store, *a, **k)
        name = str(a[0] if a else k.get("group_name", "?"))
        with recording(name, {store_port_of(store)}):
            return real(group_size, group_rank, ranks, backend, store, *a, **k)

    c10d._new_process_group_helper = helper  # type: ignore[assignment]


@contextlib.contextmanager
def recording(name: str, store_ports: set[int | None]) -> Iterator[None]:
    """Record the connections gloo groups open inside the block under `name` (a group's
    creation, or the repair in place of all of them: `devices.reconfigure`), never those to or
    from `store_ports`; the waits of this process are normal again from now on (it has live
    groups). Two scans of the descriptor table, whatever the block does: one per group of a
    repair cost ~1 ms each on 2 cores, a third of the repair of Megatron's 25 groups. Also
    when the block raises: a repair that fails part-way (a member lost) leaves the groups it
    reconnected live, and the next abort must shut their connections down too (a repair of a
    group with live connections waits a tick of gloo's loop per peer)."""
    _ABORTED.clear()  # the next generation's groups: their waits are normal again
    before = set(socket_fds().values())
    try:
        yield
    finally:
        with _LOCK:
            for inode in _new_connections(before, store_ports):
                _TRACKED[inode] = name


def store_port(group: dist.ProcessGroup) -> int | None:
    """The port of the TCP store `group` rendezvouses on (None: not a TCP store)."""
    return store_port_of(dist.distributed_c10d._world.pg_map.get(group, (None, None))[1])


def interruptible_waits() -> None:
    """From now on `Work.wait()` without a timeout of its own, on a collective, raises
    `DistBackendError` within `WAIT_SLICE` of this process's groups being aborted, instead of
    waiting for an operation that gloo will never finish (module docstring; CPU mode only).
    Idempotent.

    Such a wait goes in slices of torch's own timed wait, which leaves the operation alone. Not
    for an operation without a future (a point-to-point one; on gloo also
    `reduce_scatter_tensor`): torch hands its timeout to gloo, which fails the connection when it
    passes (measured: "Timed out waiting 200ms for send operation" on a send under way), so its
    wait is left as it is."""
    if "wait" in _INSTALLED:
        return
    real = dist.Work.wait
    _INSTALLED["wait"] = real
    no_bound = datetime.timedelta(0)

    @functools.wraps(real)
    def wait(self: dist.Work, timeout: datetime.timedelta = no_bound) -> bool:
        if timeout != no_bound or not _has_future(self):
            return real(self, timeout)
        while True:
            try:
                return real(self, WAIT_SLICE)
            except RuntimeError as exc:
                if str(exc).partition("\n")[0] != _SLICE_OVER:  # then torch's C++ stack
                    raise
            if _ABORTED.is_set():
                raise dist.DistBackendError(
                    "this process's process groups were aborted while it waited on a gloo "
                    "operation its peers' loss left unfinished"
                )

    dist.Work.wait = wait  # type: ignore[method-assign]


def _has_future(work: dist.Work) -> bool:
    try:
        work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        return False
    return True


def tracked() -> dict[int, str]:
    """inode -> group name of the gloo connections recorded so far (and still open)."""
    open_now = set(socket_fds().values())
    with _LOCK:
        for inode in [i for i in _TRACKED if i not in open_now]:
            del _TRACKED[inode]
        return dict(_TRACKED)


def shutdown_connections() -> int:
    """Shut down (both directions) every recorded gloo connection still open; returns how many.
    Until a group is created again, interruptible waits end (`interruptible_waits`).

    Each descriptor is duplicated and the duplicate's inode checked before the shutdown, so a
    descriptor number reused by an unrelated socket in the meantime is never touched.
    """
    count = 0
    _ABORTED.set()
    with _LOCK:
        targets = dict(_TRACKED)
        _TRACKED.clear()
    for fd, inode in socket_fds().items():
        if inode not in targets:
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            if os.fstat(dup).st_ino != inode:
                continue
            sock = socket.socket(fileno=dup)
            try:
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:
                pass  # already shut down or reset by the peer
            finally:
                sock.detach()  # the duplicate is closed below, once; gloo still owns `fd`
        finally:
            os.close(dup)
    return count
