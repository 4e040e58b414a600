"""`Membership`: every role's view of the job's store at once, for the code that plays them all.

The store's keys are read and written through role views over one sealed core
(`sealed_store.SealedStore`): a worker holds a `worker_view.WorkerView`, the coordinator a
`coordinator_view.CoordinatorView`, a node's agent an `agent_view.AgentView`; the reads they
all make are `store_view.StoreView`'s. The keys and who writes and reads each are documented
once, on `messages.Keys` (and in docs/reference/store-keys.md, generated from them).

`Membership` combines the three views, and adds what a launcher reads of a job's results and
the stops it asks for. It is for the code that legitimately plays every role: the local
launcher hosting the coordinator and supervising its processes (`launch/local_job.py`,
`launch/supervisor.py`), `deadpool coordinator` (`cli/coordinator.py`), the benchmarks that
simulate ranks and a coordinator on one store (`bench/`), the self-test's checks and the
tests. The worker and coordinator modules never import it (an import-linter contract,
`pyproject.toml`). Also here: `host_store`, the job's store as its host serves it.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable

import torch.distributed as dist

from .agent_view import AgentView
from .coordinator_view import CoordinatorView
from .messages import FinalReplication, IterationRecord, Keys, Preempted
from .seal import JobSeal
from .sealed_store import SealedStore
from .store_files import keep_alive
from .store_protocol import StoreLike
from .worker_view import WorkerView


class Membership(WorkerView, CoordinatorView, AgentView):
    """Every role's access to the job's store as `member`, sealed with `seal`, and a launcher's
    reads of the job's results."""

    def __init__(self, store: StoreLike, member: str, seal: JobSeal) -> None:
        """A core of its own on `store` (`StoreView(membership.core)` and the other views
        stand on the same one)."""
        super().__init__(SealedStore(store, member, seal))

    # ------------------------------------------------------------------ the job's results
    def metrics(self, generation: int, iteration: int) -> IterationRecord | None:
        """Rank 0's record of `iteration` in `generation` (None: not published, or pruned)."""
        key = Keys.METRICS.format(g=generation, iteration=iteration)
        value = self.core.read(key)
        return None if value is None else IterationRecord.decode(key, value)

    def preempted(self) -> Preempted | None:
        """Where training stopped on purpose (None: it did not)."""
        value = self.core.read(Keys.PREEMPTED)
        return None if value is None else Preempted.decode(Keys.PREEMPTED, value)

    def final_replication(self) -> FinalReplication | None:
        """The committed iteration at the end of training, as rank 0 published it."""
        value = self.core.read(Keys.FINAL_REPLICATION)
        return None if value is None else FinalReplication.decode(Keys.FINAL_REPLICATION, value)

    def load_time(self, rank: int) -> float | None:
        """Seconds `rank` took to load a persistent checkpoint."""
        return self.core.seconds(Keys.LOAD_TIME.format(rank=rank))


def host_store(
    host: str,
    port: int,
    timeout_s: float = 300.0,
    keepalive_s: float | None = None,
    on_listen: Callable[[int], None] = lambda port: None,
) -> dist.TCPStore:
    """Host the job's store listening on `host` only (torch's own server binds every interface).

    Port 0 picks a free port (`store.port`). `keepalive_s`: a connection whose host has not
    answered for that long is dropped (`store_files.keep_alive`; None: never). `on_listen`:
    called with the port as soon as it listens, before torch's server and the store's own
    client start (`SilentConnections.watch`: from that moment anyone may connect). The listening
    socket is handed to torch, which closes it when the store goes: Python's socket object is
    detached, so that its own close cannot hit the same descriptor number a second time - by then
    possibly another socket's (a race seen as EBADF on an unrelated socket's close).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if keepalive_s is not None:
            keep_alive(sock, keepalive_s)
        sock.bind((host, port))
        sock.listen(1024)
        listening = sock.getsockname()[1]
        on_listen(listening)
        store = dist.TCPStore(
            host,
            listening,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # torch's server owns the descriptor now
    return store
