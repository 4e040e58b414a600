"""This process's file-descriptor table, grown once at start-up rather than in a recovery.

Linux keeps a process's open files in a table that starts with 64 entries and doubles when a
descriptor past its end is opened; in a process with more than one thread the opening call
then waits for an RCU grace period (the kernel's ``expand_fdtable``: ``synchronize_rcu``), in
uninterruptible sleep, before it returns. A recovery opens descriptors in bursts - each group it
repairs or creates connects sockets - and a newcomer starts with a small table. Measured with
``perf sched`` on ``deadpool bench recovery`` (TP2xDP2, gloo, torch 2.14.1): the newcomer's
gloo event-loop thread sat 10-16 ms in uninterruptible sleep in ``accept`` as its descriptors
passed 128, at its ~22nd of 25 group repairs, while the peer's side of that group was done in
0.5 ms - the one long wait of every repair, in every run, which the survivors then waited out
too. So each worker grows its table once as it starts (`reserve`): one grace period then, while
nothing waits on it. A table is one pointer and three bits per entry (65,536 entries: ~530 KB).
"""

from __future__ import annotations

import fcntl
import os
import resource
from pathlib import Path

BASE_ENTRIES = 4096
"""Entries reserved for any job: the libraries' own descriptors and a few hundred groups'."""

PER_RANK_ENTRIES = 4
"""Entries reserved per rank of the world: gloo connects one socket to each peer of each group,
and a rank's groups (its data-parallel ones above all) together count a few times the world."""


def wanted_entries(world_size: int) -> int:
    """How many descriptors a worker of a job of `world_size` ranks reserves room for. Pure."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be >= 1")
    return BASE_ENTRIES + PER_RANK_ENTRIES * world_size


def planned_entries(wanted: int, soft_limit: int) -> int:
    """The table size to grow to: `wanted`, at most the open-files limit `soft_limit`
    (``RLIMIT_NOFILE``; `resource.RLIM_INFINITY`: none) - past it no descriptor can be opened,
    so no table grows. Pure."""
    if soft_limit == resource.RLIM_INFINITY or soft_limit < 0:
        return wanted
    return min(wanted, soft_limit)


def table_entries() -> int | None:
    """The size of this process's descriptor table (``FDSize`` in ``/proc/self/status``; None
    where there is no such file)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("FDSize:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reserve(wanted: int) -> int:
    """Grow this process's descriptor table to hold `wanted` descriptors (at most its open-files
    limit) now; the descriptor numbers reserved. Opens one descriptor at the table's last entry
    (``F_DUPFD``: the lowest free number from there on, so no open descriptor is touched) and
    closes it: the table keeps its size."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    entries = planned_entries(wanted, soft)
    if entries < 2:
        return entries
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.close(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, entries - 1))
    except OSError:  # taken up to the limit already: the table is as large as it can be
        pass
    finally:
        os.close(fd)
    return entries
