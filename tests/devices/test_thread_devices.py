"""Every thread DeadPool starts runs on the rank's GPU (`devices.threads`), on a stand-in CUDA
runtime that records each thread's current device at every call (tests/devices/cuda_standin.py).

A new thread's current CUDA device is 0: a CUDA call there makes a context on GPU 0 for every
other rank of the node (issue 39, N1). The scenario runs, in a process of its own with the rank's
device set to 3 on the main thread, the real code paths that start threads and call CUDA on
them - the heartbeat running `DeviceWatch`, a round's poster (`Replicator._post_after`) and
verifier, an abort (torch's abort of NCCL groups, the concurrent NCCL aborts), freeing groups on
threads - and no call may come from a thread whose current device is not 3. At b213e7a the
heartbeat's `cudaEventQuery`, the poster's `cudaEventSynchronize` and the aborts all ran on
device 0.
"""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cuda_standin import in_own_process

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_deadpool"


def _device_threads() -> dict[str, int | None] | None:
    try:
        from megatron_deadpool.devices.threads import device_threads
    except ImportError:  # the code before issue 39
        return None
    return device_threads()


def _rank_on_device_3() -> dict[str, Any]:
    """The scenario (module docstring), in its own process."""
    from types import SimpleNamespace

    from cuda_standin import CudaStandIn

    runtime = CudaStandIn()
    runtime.install()

    import torch
    import torch.distributed as dist
    from stores import SEAL

    from megatron_deadpool.devices import nccl
    from megatron_deadpool.devices.abort import start_abort
    from megatron_deadpool.devices.base import active_device
    from megatron_deadpool.devices.health import DeviceWatch
    from megatron_deadpool.hotswap.protocol.connection import Heartbeat, open_client
    from megatron_deadpool.hotswap.protocol.membership import Membership, host_store
    from megatron_deadpool.hotswap.worker import rebind
    from megatron_deadpool.replication.daemon_worker import DaemonWorker
    from megatron_deadpool.replication.replicator import Replicator
    from megatron_deadpool.replication.verifier import RoundCheck

    # The Megatron-LM path's order: DeadPool connects and beats before Megatron's start-up
    # selects the GPU (the device is 0 then), and learns the device afterwards.
    active_device()
    store = host_store("127.0.0.1", 0)
    membership = Membership(open_client(f"127.0.0.1:{store.port}", 30), "a0", SEAL)
    beat = Heartbeat(membership, 0.05)
    beat.start()
    torch.cuda.set_device(3)  # the rank's GPU, selected on the main thread (Megatron's start-up)
    device = active_device()
    seen: dict[str, Any] = {}

    # The heartbeat thread checks the step's event after each beat.
    watch = DeviceWatch(3600.0, end=lambda code, why: None)
    watch.step_done(1)
    beat.after_beat = watch
    deadline = time.monotonic() + 60
    while not any(c.name == "cudaEventQuery" for c in runtime.calls):
        assert time.monotonic() < deadline, "the heartbeat never checked the step's event"
        time.sleep(0.02)
    seen["heartbeat"] = _device_threads()
    beat.stop(10)

    # A round's poster (host replicas of GPU state: sent once the capture's copy landed) and
    # verifier.
    event = torch.cuda.Event()
    event.record()
    poster = DaemonWorker("deadpool-post")
    holder = SimpleNamespace(transfer_group=None)
    assert poster.submit(Replicator._post_after, holder, event, []).result(60) == []
    check = RoundCheck()
    check.start(list, {}, 1).result(60)
    seen["round"] = _device_threads()
    poster.shutdown()
    check.shutdown()

    # An abort: torch's abort of every group (ncclCommAbort for NCCL groups), the concurrent
    # NCCL aborts, and the groups' last references dropped on threads (their destructors).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    real_abort = dist.distributed_c10d._abort_process_group

    def abort_process_group(*args: Any, **kwargs: Any) -> Any:
        runtime.record("ncclCommAbort", "torch's _abort_process_group")
        return real_abort(*args, **kwargs)

    dist.distributed_c10d._abort_process_group = abort_process_group

    class ProcessGroupNCCL:  # a group's NCCL backend: aborting it calls CUDA
        def abort(self) -> None:
            runtime.record("ncclCommAbort", "backend.abort()")

    class FreedGroup:
        def __del__(self) -> None:
            runtime.record("ncclCommDestroy", "a group's destructor")

    start_abort().result()
    nccl.abort_concurrently([ProcessGroupNCCL(), ProcessGroupNCCL()])
    boxes: list[list[Any]] = [[FreedGroup()], [FreedGroup()]]
    rebind._free_in_parallel(boxes)
    return {
        "device": [device.kind, device.index],
        "calls": [[c.name, c.thread, c.device, c.detail] for c in runtime.calls],
        "off_device": [[c.name, c.thread, c.device, c.detail] for c in runtime.off_device(3)],
        "seen": seen,
    }


@pytest.mark.timeout(300)
def test_no_cuda_call_of_a_deadpool_thread_runs_off_the_ranks_device() -> None:
    result = in_own_process("test_thread_devices:_rank_on_device_3")
    assert result["device"] == ["cuda", 3]
    made = {(name, thread) for name, thread, _, _ in result["calls"]}
    # The paths ran, each calling CUDA on a thread of DeadPool's:
    for call in [
        ("cudaEventQuery", "deadpool-heartbeat"),
        ("cudaEventSynchronize", "deadpool-post"),
        ("ncclCommAbort", "deadpool-abort"),
        ("ncclCommAbort", "deadpool-nccl-abort"),
        ("ncclCommDestroy", "deadpool-free-group"),
    ]:
        assert call in made, (call, result["calls"])
    assert result["off_device"] == [], (
        "CUDA calls on a thread whose current device was not the rank's (3): each makes a "
        f"context on that GPU: {result['off_device']}"
    )
    assert result["seen"]["heartbeat"]["deadpool-heartbeat"] == 3
    round_threads = result["seen"]["round"]
    assert round_threads["deadpool-post"] == 3 and round_threads["deadpool-verify"] == 3
    assert set(round_threads.values()) == {3}, round_threads  # every live DeadPool thread


def test_every_thread_start_goes_through_the_devices_layer() -> None:
    """By construction: no module starts a thread but `devices/threads.py` (a
    `threading.Thread(...)`, a subclass of `threading.Thread`, a `ThreadPoolExecutor(...)`)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "devices" / "threads.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Call):
                targets = [node.func]
            elif isinstance(node, ast.ClassDef):
                targets = list(node.bases)
            for target in targets:
                name = ast.unparse(target)
                if name in ("threading.Thread", "Thread", "ThreadPoolExecutor"):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}")
    assert found == [], "start threads with devices.threads (start_thread, DeviceThread, pool)"


# ------------------------------------------------------------------ the helpers on their own


@pytest.fixture
def recorded_devices(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`torch.cuda.set_device` recording (thread name, index); the rank's device forgotten
    afterwards."""
    import torch

    from megatron_deadpool.devices import threads

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda i: calls.append((threading.current_thread().name, i))
    )
    yield calls
    threads.note_device(None)


def test_threads_select_the_noted_device_and_follow_it(recorded_devices: Any) -> None:
    from megatron_deadpool.devices.threads import (
        DeviceThread,
        device_threads,
        note_device,
        pool,
        start_thread,
    )
    from megatron_deadpool.replication.daemon_worker import DaemonWorker

    note_device(5)
    release = threading.Event()
    ran: list[str] = []

    class Watcher(DeviceThread):
        def run(self) -> None:
            ran.append(self.name)
            release.wait(30)

    watcher = Watcher(name="t-watcher", daemon=True)
    watcher.start()
    plain = start_thread(release.wait, 30, name="t-plain")
    with pool(2, "t-pool") as executor:
        assert executor.submit(lambda: threading.current_thread().name).result(30) == "t-pool_0"
    deadline = time.monotonic() + 30
    while ran != ["t-watcher"] or "t-plain" not in {name for name, _ in recorded_devices}:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert device_threads()["t-watcher"] == 5 and device_threads()["t-plain"] == 5
    assert {("t-watcher", 5), ("t-plain", 5), ("t-pool_0", 5)} <= set(recorded_devices)

    worker = DaemonWorker("t-worker")  # started before the device changes: follows it per call
    worker.submit(lambda: None).result(30)
    note_device(6)
    worker.submit(lambda: None).result(30)
    assert [i for name, i in recorded_devices if name == "t-worker"] == [5, 6]
    assert device_threads()["t-worker"] == 6
    worker.shutdown()
    release.set()
    watcher.join(30)
    plain.join(30)
    assert "t-watcher" not in device_threads()  # only live threads


def test_no_cuda_call_where_no_device_is_known(recorded_devices: Any) -> None:
    """A CPU-only process (a launcher, a coordinator, the CPU mode): nothing is selected and
    `torch.cuda` is never called."""
    from megatron_deadpool.devices.threads import device_threads, note_device, start_thread

    note_device(None)
    thread = start_thread(time.sleep, 0.5, name="t-cpu")
    assert device_threads()["t-cpu"] is None
    thread.join(30)
    assert recorded_devices == []


@pytest.mark.parametrize("bad", [-1, True, 1.5, "0"])
def test_a_device_index_is_checked(bad: Any) -> None:
    from megatron_deadpool.devices.threads import note_device
    from megatron_deadpool.errors import ConfigError

    with pytest.raises(ConfigError, match="device index"):
        note_device(bad)
