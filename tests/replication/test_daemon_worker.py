"""A round's wait stuck on a peer for good does not keep a finished process from ending
(`replication/daemon_worker.py`): a real gloo receive from a live peer that never sends, handed
to the replicator's verifying thread, in a process that then returns from its main."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref

import pytest
from procs import wait_until

from megatron_deadpool.hotswap.protocol.membership import host_store
from megatron_deadpool.replication.daemon_worker import DaemonWorker

_RANK = """
import datetime, sys, time
import torch, torch.distributed as dist
from megatron_deadpool.replication.verifier import RoundCheck
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
if rank == 1:
    time.sleep(300)  # alive and connected, never sends: rank 0's receive waits for good
buf = torch.zeros(8, dtype=torch.uint8)
work = dist.irecv(buf, src=1)
findings = RoundCheck().start(lambda: [work], {1: (0, buf)}, 1)
time.sleep(0.5)
assert not findings.done()
print("main returns", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_process_whose_round_check_is_stuck_on_a_peer_still_ends() -> None:
    store = host_store("127.0.0.1", 0)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(rank), str(store.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (1, 0)
    ]
    peer, stuck = procs
    try:
        out, err = stuck.communicate(timeout=60)  # a ThreadPoolExecutor: it never returns
        assert stuck.returncode == 0 and "main returns" in out, err[-2000:]
        assert peer.poll() is None  # the peer was alive all along
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_calls_run_in_order_and_errors_reach_their_future() -> None:
    worker = DaemonWorker("test-worker")
    order: list[int] = []
    release = threading.Event()
    first = worker.submit(lambda: (release.wait(10), order.append(1))[1])
    second = worker.submit(order.append, 2)

    def fail() -> None:
        raise ValueError("no")

    third = worker.submit(fail)
    release.set()
    assert first.result(10) is None and second.result(10) is None and order == [1, 2]
    with pytest.raises(ValueError, match="no"):
        third.result(10)
    worker.shutdown()


def test_an_idle_worker_holds_nothing_of_its_last_call() -> None:
    """A call's arguments and its error (whose frames hold them) are dropped once the call
    ended: after a failure the released process groups must be freed while the worker waits
    for its next call."""

    class Group:
        pass

    def fail(group: Group) -> None:
        raise RuntimeError("connection closed")

    worker = DaemonWorker("test-worker")
    group = Group()
    ref = weakref.ref(group)
    future = worker.submit(fail, group)
    with pytest.raises(RuntimeError):
        future.result(10)
    del group, future
    wait_until(lambda: gc.collect() >= 0 and ref() is None, 5, "the worker to drop its last call")
    worker.shutdown()
