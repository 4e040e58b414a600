"""Checking a round's replicas in host memory off the main thread.

A holder verifies every replica it receives by its checksum before it counts (`snapshot.verify`).
For replicas in GPU memory that runs on the GPU. For replicas in host memory - pinned host
memory next to a GPU, or the CPU mode - it is the host checksum over the whole shard: GiBs per
step, which on the main thread would sit on the training's critical path. A `RoundCheck` does it
on a worker thread instead, at memory speed on DeadPool's bounded pool of checksum threads
(`parallel_checksum`: no OpenMP team beside the training's threads; one core took 1.0-1.3 s
per 2 GiB on an H200 node, so a rank holding 9 GiB made each step wait ~5 s), started as soon
as the round's transfers are posted: the thread
waits for them (overlapping the next iteration's forward and backward), checks every received
replica, and the main thread only reads the outcome when it settles the round. What counts as
verified does not change: the same `verify`, and the main thread alone marks slots verified
(`Replicator.settle`), so a round given up after a failure (`Replicator.abandon`) reads the
thread's findings but never has them applied under it.

Each transfer is waited for once, by the thread (a gloo receive waited on twice waits for a
second message); an error of one transfer does not stop the others from being waited for and
their replicas checked, so that after an abort the receives that did arrive can still be kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .daemon_worker import DaemonWorker
from .snapshot import CorruptReplicaError, verify


@dataclass
class Findings:
    """What the thread found for one round."""

    errors: list[BaseException] = field(default_factory=list)
    """The transfers' errors (a failed or aborted transfer), in posting order."""
    arrived: set[int] = field(default_factory=set)
    """Owners whose receive completed."""
    corrupt: dict[int, str] = field(default_factory=dict)
    """Owners whose received replica failed `verify`, and why."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Where the thread's time went: "posted" (until `works()` returned: the GPU capture's
    copy landed and the transfers were posted), "transfers" (their waits), "checksums"."""

    def verified(self, owner: int) -> bool:
        return owner in self.arrived and owner not in self.corrupt


class RoundCheck:
    """The worker thread of one replicator (one round at a time; a daemon: a wait stuck on a
    dead peer does not keep the process from ending, `daemon_worker.py`)."""

    def __init__(self) -> None:
        self._pool = DaemonWorker("deadpool-verify")

    def start(
        self,
        works: Callable[[], list[dist.Work]],
        receives: dict[int, tuple[int, torch.Tensor]],
        iteration: int,
    ) -> Future[Findings]:
        """Wait for the round's transfers (`works()` gives them, one per transfer, receives at
        the indices `receives` names: owner -> (index, buffer)) and verify what arrived."""
        return self._pool.submit(_check, works, receives, iteration)

    def shutdown(self) -> None:
        self._pool.shutdown()


def _check(
    works: Callable[[], list[dist.Work]],
    receives: dict[int, tuple[int, torch.Tensor]],
    iteration: int,
) -> Findings:
    found = Findings()
    t0 = time.perf_counter()
    listed = works()
    t1 = time.perf_counter()
    failed: set[int] = set()
    for work in {id(w): w for w in listed}.values():
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - the peer failed or the group was aborted
            found.errors.append(exc)
            failed.add(id(work))
    t2 = time.perf_counter()
    for owner, (index, flat) in receives.items():
        if id(listed[index]) in failed:
            continue
        found.arrived.add(owner)
        try:
            verify(flat, owner=owner, iteration=iteration)  # on the checksum threads
        except CorruptReplicaError as exc:
            found.corrupt[owner] = str(exc)
    found.seconds = {
        "posted": t1 - t0,
        "transfers": t2 - t1,
        "checksums": time.perf_counter() - t2,
    }
    return found
