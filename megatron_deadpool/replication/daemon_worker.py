"""A one-thread worker whose stuck call never keeps the process from ending.

The replicator hands a round's waits to a thread (`verifier.RoundCheck`, and on a GPU the
posting of host replicas' transfers). After a peer's failure such a wait can stay blocked for
good: a receive from a dead peer that no abort reaches (seen in the Slurm lab's self-test: a
rank that finished training never exited, and Slurm killed its task). A
`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits, whatever
`shutdown(wait=False)` said, so one stuck thread held the finished process forever. The
`DaemonWorker` runs its calls on a daemon thread instead: a call stuck for good is abandoned
with the process, as the store's abandoned helpers are (`hotswap/protocol/connection.py`). The thread
selects the rank's GPU before each call (`devices.threads`): the poster's
`cudaEventSynchronize` must not make a context on GPU 0.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from ..devices.threads import select_rank_device, start_thread

T = TypeVar("T")


class DaemonWorker:
    """Runs submitted calls one at a time, in order, on a daemon thread named `name`."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        start_thread(self._serve, name=name)  # on the rank's GPU (`devices.threads`)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """`fn(*args)`'s future."""
        future: Future[T] = Future()
        self._calls.put((future, lambda: fn(*args)))
        return future

    def shutdown(self) -> None:
        """End the thread after the calls already submitted (at once, if it is idle)."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            select_rank_device()  # also when the device became known after the thread started
            _run(*call)
            # Nothing of the call may outlive it while the thread waits for the next one: its
            # arguments and its error's frames hold process groups, which the release after a
            # failure must see freed (seen: "DEADPOOL_REPLICATION ... still referenced").
            del call


def _run(future: Future[Any], fn: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - handed to the future's reader
        future.set_exception(exc)
