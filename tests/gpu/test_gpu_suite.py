"""The GPU suite: what the CPU tests cannot see, on one CUDA device (``pytest -m gpu``).

Skipped without CUDA. Needs the fused kernel for the tests that say so
(``pip install --no-build-isolation ./cuda_kernels``); set ``DEADPOOL_GPU_REPORT=DIR`` to get
the measured figures as JSON next to the printed ones. One GPU cannot host two NCCL ranks, so
every multi-rank NCCL behaviour (mutual pairs, rings, aborts with a dead or stopped peer) is
out of its reach: `deadpool selftest` on a real node covers those.

1. the pack kernel against the host checksum, up to several GiB and misaligned, timed against
   a plain device copy (figure: GB/s of both);
2. capture into GPU and into pinned host memory: checksummed at once, i.e. complete as soon
   as the capture's event has passed (#7), and restorable bitwise;
3. the host is not stalled by a capture (#9): while the GPU is busy for a second, a capture
   returns to the host before that work ends;
4. a world-size-1 NCCL world with Megatron's distributed optimizer (torch Adam, or TE's
   FusedAdam when TE is installed - Megatron picks it at import): snapshot, restore into a
   freshly built model and optimizer, the next step bitwise (#8);
5. one embedded training step and replication rounds on NCCL (#1, #2, #3: batches on the
   model's device, the world all-reduce on CUDA, a batched self-round on the NCCL-only
   replication group);
6. the overlap figure: a 1.5 GB shard captured and copied to pinned host memory while a
   matmul loop runs on the main stream; the loop's slowdown is reported.

The checks shared with the first contact and `deadpool selftest` come from
`megatron_deadpool.selftest.gpu_checks` (the pack kernel against the host, N2's probe, the
timing helper and the matmul loop).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# cuBLAS picks deterministic kernels only with a fixed workspace, set before it initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from optimizers import Scheduler, Wrapped

from megatron_deadpool.selftest.gpu_checks.base import elapsed_ms, matmul_loop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GIB = 1 << 30


def _report(name: str, figures: dict[str, Any]) -> None:
    print(f"\n[gpu-suite] {name}: {json.dumps(figures)}")
    where = os.environ.get("DEADPOOL_GPU_REPORT")
    if where:
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, f"{name}.json"), "w") as out:
            json.dump(figures, out, indent=1)


def _needs_kernel() -> None:
    from megatron_deadpool.replication import pack

    if pack.backend_for(torch.empty(1, device="cuda")) != "cuda":
        pytest.skip("deadpool_cuda_kernels is not installed (pip install ./cuda_kernels)")


def _free_gib() -> float:
    return torch.cuda.mem_get_info()[0] / GIB


# ---------------------------------------------------------------------- 1. the pack kernel


@pytest.mark.timeout(900)
@pytest.mark.parametrize("gib", [0.001, 1.0, 4.0])
def test_pack_kernel_matches_the_host_checksum_and_is_timed_against_a_copy(gib: float) -> None:
    """The shared check (`selftest.gpu_checks.pack_check`, also the first contact's and the
    selftest's): misaligned checksum, mixed-dtype pack, unpack and the torch fallback's
    checksum, each against the host; timed against a plain device copy."""
    from megatron_deadpool.selftest.gpu_checks.pack_check import pack_against_host

    _needs_kernel()
    nbytes = int(gib * GIB) // 16 * 16
    if _free_gib() < 4 * nbytes / GIB + 1:
        pytest.skip(f"needs {4 * nbytes / GIB + 1:.1f} GiB of free GPU memory")
    problems, figures = pack_against_host(nbytes)
    _report(f"pack_kernel_{gib}gib", figures)
    assert figures["backend"] == "cuda" and figures["fallback_checksum_ok"]
    assert problems == []


# ---------------------------------------------------------------------- 2.-3. capture


def _gpu_state(numel: int, seed: int = 0) -> Any:
    """A torch Adam over CUDA parameters after one step (its `step` is a CPU scalar)."""
    from megatron_deadpool.replication.snapshot import RankState

    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(numel, device="cuda", generator=gen)),
        torch.nn.Parameter(torch.randn(1000, 3, device="cuda", generator=gen)),
    ]
    opt = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen)
    opt.step()
    assert opt.state[params[0]]["step"].device.type == "cpu"
    return RankState(Wrapped(opt), Scheduler())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["gpu", "pinned", "segment"])
def test_capture_is_complete_once_its_event_passed(where: str, shm_path: Path) -> None:
    """`segment`: pinned host memory that is a node's segment file (`replication.segments`),
    page-locked with cudaHostRegister; once unregistered and unmapped, the file holds the
    capture, as the process respawned in its place reads it."""
    from megatron_deadpool.devices.pinned import buffer
    from megatron_deadpool.replication.snapshot import Snapshotter, verify

    state = _gpu_state(64 << 20)  # 3 x 256 MiB
    snap = Snapshotter(state, owner=0)
    segment = shm_path / "r0-o0-s0"
    if where == "gpu":
        out = torch.zeros(snap.flat_nbytes(), dtype=torch.uint8, device="cuda")
    elif where == "pinned":
        out = torch.zeros(snap.flat_nbytes(), dtype=torch.uint8, pin_memory=True)
    else:
        out = buffer(snap.flat_nbytes(), torch.device("cpu"), pinned=True, path=segment)
        assert out.is_pinned()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        header = snap.capture(5, out)
        event = torch.cuda.Event()
        event.record()
    event.synchronize()  # what the replicator waits on before sending and marking verified
    verified = verify(out, owner=0, iteration=5)
    if header is not None:  # without the fused kernel the checksum came back synchronously
        assert verified == header
    if where == "segment":
        del out  # unregistered and unmapped: what the file keeps when its process dies
        out = buffer(snap.flat_nbytes(), torch.device("cpu"), pinned=False, path=segment)
        assert verify(out, owner=0, iteration=5) == verified
        segment.unlink()
    fresh = _gpu_state(64 << 20, seed=1)
    Snapshotter.restore_into(fresh, out, owner=0, iteration=5)
    for a, b in zip(state.state_tensors(), fresh.state_tensors()):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.fixture
def shm_path() -> Iterator[Path]:
    """A folder in the node's memory file system, as the launcher gives a node's processes."""
    where = Path(tempfile.mkdtemp(prefix="deadpool-gpu-", dir="/dev/shm"))
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.mark.timeout(120)
def test_a_segment_file_that_cannot_be_page_locked_is_one_clear_error_and_cuda_goes_on(
    tmp_path: Path,
) -> None:
    """Linux page-locks shared file mappings only on a memory file system: a segment folder
    elsewhere is refused naming the fix, and the registration's error does not surface as
    the next kernel's ('CUDA error: invalid argument' from torch.randn, seen on an H100)."""
    from megatron_deadpool.devices.pinned import buffer
    from megatron_deadpool.errors import DeadpoolRuntimeError

    try:
        out = buffer(1 << 20, torch.device("cpu"), pinned=True, path=tmp_path / "r0-o0-s0")
    except DeadpoolRuntimeError as exc:
        assert "memory file system" in str(exc) and str(tmp_path) in str(exc)
    else:
        del out
        pytest.skip(f"{tmp_path} is on a file system this kernel page-locks")
    assert float(torch.ones(4, device="cuda").sum()) == 4.0  # a kernel launch and its check


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["gpu", "pinned"])
def test_capture_does_not_stall_the_host(where: str) -> None:
    from megatron_deadpool.replication.snapshot import Snapshotter

    _needs_kernel()
    snap = Snapshotter(_gpu_state(64 << 20), owner=0)
    pin = where == "pinned"
    device = "cpu" if pin else "cuda"
    out = torch.zeros(snap.flat_nbytes(), dtype=torch.uint8, device=device, pin_memory=pin)
    side = torch.cuda.Stream()
    snap.capture(1, out)  # warm-up: allocations, the staging buffer
    torch.cuda.synchronize()
    busy = torch.cuda.Event()
    torch.cuda._sleep(int(2e9))  # about a second of GPU time on the main stream
    busy.record()
    t0 = time.perf_counter()
    side.wait_stream(torch.cuda.current_stream())  # the capture follows the "optimizer step"
    with torch.cuda.stream(side):
        header = snap.capture(2, out)
        done = torch.cuda.Event()
        done.record()
    host_s = time.perf_counter() - t0
    still_busy = not busy.query()
    done.synchronize()
    _report(f"capture_host_time_{where}", {"host_s": host_s, "gpu_still_busy": still_busy})
    assert header is None  # the checksum stayed on the device
    assert still_busy, "the capture made the host wait for the GPU"


# ---------------------------------------------------------------------- 4.-5. NCCL world


@pytest.fixture(scope="module")
def nccl_world() -> Any:
    """A world-size-1 NCCL world with Megatron's groups (eager communicator, DeadPool's
    settings), aborted at the end."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_deadpool.devices import nccl, select_device
    from megatron_deadpool.devices.abort import abort_groups

    device = select_device("cuda", local_rank=0)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group(
        backend="nccl",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
        **nccl.init_kwargs("nccl"),
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    yield device
    ps.destroy_model_parallel()
    abort_groups()


def _job(iters: int) -> Any:
    from megatron_deadpool.config.job import JobConfig, ParallelConfig, TrainConfig

    return JobConfig(parallel=ParallelConfig(tp=1, pp=1, dp=1), train=TrainConfig(iters=iters))


@pytest.mark.timeout(600)
def test_megatron_distributed_optimizer_snapshot_restore_next_step_bitwise(
    nccl_world,
) -> None:
    from megatron_deadpool.digest import rank_digest
    from megatron_deadpool.embedded import gpt
    from megatron_deadpool.hotswap.worker.weights import sync_params_from_main
    from megatron_deadpool.replication.snapshot import (
        RankState,
        Snapshotter,
        inner_optimizers,
    )

    job = _job(iters=3)
    live = gpt.build(job)
    assert next(live.model[0].parameters()).is_cuda
    for it in (1, 2):
        gpt.train_step(job, live, it)
    state = RankState(live.optimizer, live.scheduler)
    snap = Snapshotter(state, owner=0)
    flat = torch.zeros(snap.flat_nbytes(), dtype=torch.uint8, device=snap.device)
    snap.capture(2, flat)
    torch.cuda.synchronize()
    fresh = gpt.build(job)  # a newcomer: initial weights, no optimizer state
    Snapshotter.restore_into(
        RankState(fresh.optimizer, fresh.scheduler), flat, owner=0, iteration=2
    )
    sync_params_from_main(fresh.model, fresh.optimizer)
    assert rank_digest(fresh.model) == rank_digest(live.model)
    a = gpt.train_step(job, live, 3)
    b = gpt.train_step(job, fresh, 3)
    optimizer = type(inner_optimizers(live.optimizer)[0]).__name__
    _report("megatron_round_trip", {"optimizer": optimizer, "loss": a.loss})
    assert a.loss == b.loss and a.grad_norm == b.grad_norm
    assert rank_digest(fresh.model) == rank_digest(live.model)


@pytest.mark.timeout(600)
def test_embedded_steps_and_replication_rounds_on_nccl(nccl_world: Any) -> None:
    import torch.distributed as dist

    from megatron_deadpool.devices.groups import backends, replication_backend
    from megatron_deadpool.devices.memory import ReplicaMemory
    from megatron_deadpool.embedded import gpt
    from megatron_deadpool.replication.placement import Layout, Placement
    from megatron_deadpool.replication.replicator import Replicator
    from megatron_deadpool.replication.snapshot import RankState, Snapshotter

    device = nccl_world
    group = dist.new_group(backend=replication_backend(device))
    assert backends(group) == {"cuda": "nccl"}  # no world-wide gloo group on CUDA
    # One GPU, one rank: the rank holds its own replica (a self send/receive in the batch).
    placement = Placement(Layout(tp=1, pp=1, dp=1, ranks_per_node=1), 1, ((0,),))
    job = _job(iters=4)
    objs = gpt.build(job)
    repl: Replicator | None = None
    committed = []
    for it in range(1, 5):
        step = gpt.train_step(job, objs, it, settle=repl.settle if repl else None)
        if repl is None:
            state = RankState(objs.optimizer, objs.scheduler)
            memory = ReplicaMemory("gpu", device)
            repl = Replicator(Snapshotter(state, 0), placement, 0, group, memory)
            assert repl.device.type == "cuda"
        committed.append(repl.commit(step.replicas_ok))
        repl.start_round(it)
    committed.append(repl.finish_round())
    assert committed == [None, 1, 2, 3, 4]
    assert repl.holdings() == {"local": [3, 4], "0": [3, 4]}


@pytest.mark.timeout(600)
def test_a_buffer_changed_right_after_start_round_is_restored_from_before_the_round(
    nccl_world: Any,
) -> None:
    """N2 (`selftest.gpu_checks.n2_probe`, also a first-contact row): the next forward pass
    writes a model buffer right after `start_round`; every round's restore gives the value
    from before the round."""
    import torch.distributed as dist

    from megatron_deadpool.selftest.gpu_checks import n2_probe

    _needs_kernel()
    if _free_gib() < 5 * n2_probe.SHARD_GB + 2:
        pytest.skip(f"needs {5 * n2_probe.SHARD_GB + 2:.1f} GiB of free GPU memory")
    rounds = n2_probe.measure(group=dist.new_group(backend="nccl"))
    ok, note = n2_probe.judge(rounds)
    _report("n2_probe", {"rounds_wrong": sum(1 for r in rounds if r.wrong)})
    assert ok, note


# ---------------------------------------------------------------------- 6. overlap figure


@pytest.mark.timeout(900)
def test_overlap_figure_capture_and_copy_of_a_1_5_gb_shard_under_a_matmul_loop() -> None:
    from megatron_deadpool.replication import pack

    _needs_kernel()
    shard_bytes = 1_500_000_000
    if _free_gib() < 2 * shard_bytes / GIB + 2:
        pytest.skip("needs about 5 GiB of free GPU memory")
    per = shard_bytes // 3 // 4  # fp32 main params, exp_avg, exp_avg_sq (the 65B/512 size)
    shard = [torch.randn(per, device="cuda") for _ in range(3)]
    plan = pack.PackPlan(shard)
    staged = torch.empty(plan.nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    loop = matmul_loop()
    loop()
    torch.cuda.synchronize()
    alone_ms = elapsed_ms(loop)
    pack_ms = elapsed_ms(lambda: plan.pack_on_device(staged))
    d2h_ms = elapsed_ms(lambda: host.copy_(staged, non_blocking=True))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    c_start, c_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        c_start.record()
        slot = plan.pack_on_device(staged)
        host.copy_(staged, non_blocking=True)
        c_end.record()
    loop()
    end.record()
    torch.cuda.synchronize()
    with_ms = start.elapsed_time(end)
    capture_ms = c_start.elapsed_time(c_end)
    assert pack.checksum(host) == int(slot.item()) & ((1 << 64) - 1)
    _report(
        "overlap_1_5gb",
        {
            "shard_bytes": plan.nbytes,
            "matmul_loop_alone_ms": alone_ms,
            "matmul_loop_with_capture_ms": with_ms,
            "slowdown_percent": 100.0 * (with_ms / alone_ms - 1.0),
            "capture_and_copy_ms_concurrent": capture_ms,
            "pack_ms_alone": pack_ms,
            "d2h_copy_ms_alone": d2h_ms,
            "device": torch.cuda.get_device_name(),
        },
    )
