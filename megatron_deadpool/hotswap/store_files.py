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
actives, its spares, and the spares' number again for the processes they replace. A process that
dies on a live host has its connections closed by the kernel, but one on a host that vanished
(power lost, cut off) leaves them half-open, and torch's server offers no way to drop an idle or
half-open connection (no keep-alive or idle timeout in its Python API): it holds their
descriptors for as long as it runs. Plus `RESERVE` for the host process's own files (its own
clients of the store, its logs, a standby's probes of the other coordinators).
"""

from __future__ import annotations

import resource

from ..errors import OpenFilesError

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
