"""Data-loader workers must not keep a rank's connections alive.

Megatron-LM's data loaders fork worker processes (`--num-workers`, default 2) after the
process groups exist, so every worker inherits a copy of every gloo socket of its rank.
Two consequences, both fatal to a fast hot swap:

- when a rank dies, its peers see its connections close only once its orphaned workers
  notice (PyTorch's worker watchdog polls every 5 s), not at once;
- when a survivor releases its groups in a recovery, the connections stay open in its
  workers, so a peer blocked on it is not woken up (it waits for the collective timeout).

`install()` makes every data-loader worker (fork start method) close the TCP sockets it
inherited - it never uses them: it talks to its parent over pipes - and die together with
its parent (Linux `PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from typing import Any

_REAL: dict[str, Any] = {}
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - no prctl: the watchdog remains
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def close_inherited_tcp_sockets() -> int:
    """Close every TCP (IPv4/IPv6) socket among this process's descriptors; returns how many."""
    closed = 0
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:  # pragma: no cover - no /proc
        return 0
    for fd in fds:
        try:
            probe = socket.socket(fileno=fd)
        except OSError:
            continue  # not a socket (or already gone)
        try:
            family = probe.family
        finally:
            probe.detach()  # the probe must not close the descriptor itself
        if family in (socket.AF_INET, socket.AF_INET6):
            try:
                os.close(fd)
                closed += 1
            except OSError:
                pass
    return closed


def _worker_loop(*args: Any, **kwargs: Any) -> Any:
    if "loop" not in _REAL:  # a spawned worker: a fresh interpreter inherits no sockets
        from torch.utils.data._utils.worker import _worker_loop as loop

        return loop(*args, **kwargs)
    _die_with_parent(_REAL["parent"])
    close_inherited_tcp_sockets()
    return _REAL["loop"](*args, **kwargs)


def install() -> None:
    """Route torch's data-loader worker entry point through `_worker_loop` (idempotent)."""
    from torch.utils.data._utils import worker

    if "loop" in _REAL:
        return
    _REAL["loop"] = worker._worker_loop
    _REAL["parent"] = os.getpid()
    worker._worker_loop = _worker_loop
