"""The devices layer's decisions that need no second process: NCCL settings, GPU assignment,
which failures are a peer's, which device a group's tensors use, where replicas fit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_deadpool.devices import gloo, nccl
from megatron_deadpool.devices.base import Device
from megatron_deadpool.devices.failures import is_peer_failure
from megatron_deadpool.devices.gpus import assign_gpus
from megatron_deadpool.devices.groups import (
    device_for,
    host_transfer_group,
    parse_backend_config,
    replication_backend,
    verdict_ahead,
)
from megatron_deadpool.devices.memory import GIB, ReplicaMemory, decide, fits_on_gpu
from megatron_deadpool.errors import ConfigError, DeadpoolRuntimeError

# ---------------------------------------------------------------------- NCCL settings


def test_nccl_settings_are_applied_where_unset() -> None:
    env: dict[str, str] = {}
    applied = nccl.apply_settings(env)
    assert (
        env
        == applied
        == {
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
            "TORCH_NCCL_ENABLE_MONITORING": "0",
        }
    )


def test_a_users_monitoring_choice_is_kept_and_a_matching_setting_accepted() -> None:
    env = {"TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    applied = nccl.apply_settings(env)
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "1"
    assert "TORCH_NCCL_ENABLE_MONITORING" not in applied


@pytest.mark.parametrize(
    "env,name",
    [
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, "TORCH_NCCL_ASYNC_ERROR_HANDLING=3"),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, "TORCH_NCCL_ASYNC_ERROR_HANDLING=1"),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, "TORCH_NCCL_ASYNC_ERROR_HANDLING=2"),
        ({"NCCL_ASYNC_ERROR_HANDLING": "1"}, "NCCL_ASYNC_ERROR_HANDLING=1"),
    ],
)
def test_a_setting_that_breaks_recovery_is_refused_in_one_line(env: dict, name: str) -> None:
    before = dict(env)
    with pytest.raises(ConfigError) as info:
        nccl.apply_settings(env)
    message = str(info.value)
    assert message.startswith(name) and "\n" not in message
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=0" in message  # the fix
    assert env == before  # nothing applied


def test_gloo_lazy_init_is_refused() -> None:
    gloo.check_settings({"TORCH_GLOO_LAZY_INIT": "0"})
    with pytest.raises(ConfigError, match="TORCH_GLOO_LAZY_INIT=1: .*unset it"):
        gloo.check_settings({"TORCH_GLOO_LAZY_INIT": "1"})


def test_torchs_detail_debug_level_is_refused_in_one_line() -> None:
    gloo.check_settings({"TORCH_DISTRIBUTED_DEBUG": "INFO"})
    with pytest.raises(ConfigError) as info:
        gloo.check_settings({"TORCH_DISTRIBUTED_DEBUG": "detail"})
    message = str(info.value)
    assert message.startswith("TORCH_DISTRIBUTED_DEBUG=detail: ") and "\n" not in message
    assert "TORCH_DISTRIBUTED_DEBUG=INFO or unset it" in message


def test_eager_communicators_for_nccl_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # set_device(3) ran
    assert nccl.init_kwargs("nccl") == {"device_id": torch.device("cuda", 3)}
    assert nccl.init_kwargs("cpu:gloo,cuda:nccl") == {"device_id": torch.device("cuda", 3)}
    assert nccl.init_kwargs("gloo") == {}


def _select_device_in_a_fresh_process(setup: str, device: str) -> subprocess.CompletedProcess:
    """`select_device(device)` in a fresh interpreter after the Python line `setup`; prints the
    `ConfigError` it raises."""
    code = (
        f"{setup}\n"
        "from megatron_deadpool.devices import select_device\n"
        "from megatron_deadpool.errors import ConfigError\n"
        f"try:\n    select_device({device!r})\nexcept ConfigError as exc:\n    print(exc)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_a_process_with_lazy_gloo_connections_is_refused_before_any_group() -> None:
    out = _select_device_in_a_fresh_process(
        "import os; os.environ['TORCH_GLOO_LAZY_INIT'] = '1'", "cpu"
    )
    assert out.stdout.startswith("TORCH_GLOO_LAZY_INIT=1: "), out.stdout + out.stderr


# ---------------------------------------------------------------------- GPU assignment


def test_actives_then_spares_each_get_their_own_gpu() -> None:
    plan = assign_gpus(actives=6, spares=2, gpus=8)
    assert plan.actives == (0, 1, 2, 3, 4, 5) and plan.spares == (6, 7)
    assert [plan.local_rank(t) for t in range(8)] == list(range(8))
    cpu = assign_gpus(actives=4, spares=3, gpus=None)  # the CPU mode: indices only
    assert cpu.spares == (4, 5, 6)


def test_too_few_gpus_is_one_clear_message() -> None:
    with pytest.raises(ConfigError) as info:
        assign_gpus(actives=8, spares=1, gpus=8)
    message = str(info.value)
    assert "8 active ranks + 1 spares need 9 GPUs, this node has 8" in message
    assert "--nproc 7" in message and "\n" not in message
    for bad in ({"actives": 0, "spares": 1}, {"actives": 2, "spares": -1}):
        with pytest.raises(ConfigError):
            assign_gpus(gpus=8, **bad)


def test_the_local_launcher_core_gives_every_process_its_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LocalJob` (both launchers' core) refuses too few GPUs before starting anything, and
    sets LOCAL_RANK per process: actives first, then spares."""
    from megatron_deadpool.config.deadpool import DeadpoolConfig
    from megatron_deadpool.hotswap.launch import local_job

    cfg = DeadpoolConfig(enabled=True, spares=1)
    monkeypatch.setattr(local_job, "local_gpu_count", lambda: 4)
    with pytest.raises(ConfigError, match="4 active ranks \\+ 1 spares need 5 GPUs"):
        local_job.LocalJob(cfg, world_size=4, token="t", run_dir=tmp_path)
    monkeypatch.setattr(local_job, "local_gpu_count", lambda: 5)
    job = local_job.LocalJob(cfg, world_size=4, token="t", run_dir=tmp_path)
    try:
        assert [job.local_rank(m) for m in job.members] == [0, 1, 2, 3, 4]
        assert job.local_rank("s1") == 0  # a spare added later (chaos runs) wraps around
    finally:
        job.close(grace_s=0)


# ---------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    "exc,expected",
    [
        (dist.DistBackendError("NCCL communicator was aborted on rank 3"), True),
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error"), True),
        (RuntimeError("Connection closed by peer [127.0.0.1]:1234"), True),
        (RuntimeError("Application timeout caused pair closure"), True),
        (dist.DistNetworkError("failed to connect to the store"), False),
        (dist.DistStoreError("wait timeout"), False),
        (torch.OutOfMemoryError("CUDA out of memory. Connection closed by peer"), False),
        (DeadpoolRuntimeError("Connection closed by peer"), False),
        (RuntimeError("shape mismatch"), False),
        (ValueError("Connection closed by peer"), False),
    ],
)
def test_is_peer_failure(exc: BaseException, expected: bool) -> None:
    assert is_peer_failure(exc) is expected


# ---------------------------------------------------------------------- groups and memory


def test_which_device_small_tensors_of_a_group_use() -> None:
    assert parse_backend_config("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert device_for(parse_backend_config("cuda:nccl")) == "cuda"  # NCCL-only: GPU tensors
    assert device_for(parse_backend_config("cpu:gloo,cuda:nccl")) == "cpu"
    assert device_for(parse_backend_config("cpu:gloo,cuda:gloo")) == "cpu"
    assert replication_backend(Device("cpu", "gloo")) == "gloo"
    assert replication_backend(Device("cuda", "nccl", 1)) == "nccl"  # no world-wide gloo


def test_auto_replica_memory_takes_the_gpu_only_with_headroom() -> None:
    total = 80 * GIB
    headroom = 4 * GIB  # 5 % of 80 GiB (more than the 2 GiB floor)
    assert fits_on_gpu(10 * GIB, 10 * GIB + headroom, total)
    assert not fits_on_gpu(10 * GIB, 10 * GIB + headroom - 1, total)
    assert not fits_on_gpu(1, 2 * GIB - 1, 16 * GIB)  # the floor on small devices
    cpu = ReplicaMemory("auto", Device("cpu", "gloo"))
    assert cpu.local_choice(1 << 40) == "host" and not cpu.pinned("host")
    pinned = ReplicaMemory("cpu", Device("cuda", "nccl", 0))
    assert pinned.local_choice(1) == "host" and pinned.pinned("host")
    assert ReplicaMemory("gpu", Device("cuda", "nccl", 2)).torch_device("gpu") == torch.device(
        "cuda", 2
    )
    with pytest.raises(ConfigError, match="'gpu' needs CUDA"):
        ReplicaMemory("gpu", Device("cpu", "gloo"))


def test_replication_groups_and_verdicts_by_device() -> None:
    """CPU: the world gloo group carries everything, verdicts agreed at once. CUDA: NCCL only
    world-wide, verdicts posted ahead; a gloo group of data-parallel peers only where replicas
    may live in host memory."""
    cpu, cuda = Device("cpu", "gloo"), Device("cuda", "nccl", 0)
    assert not verdict_ahead(cpu) and verdict_ahead(cuda)
    assert not host_transfer_group(cpu, "auto") and not host_transfer_group(cpu, "cpu")
    assert host_transfer_group(cuda, "auto") and host_transfer_group(cuda, "cpu")
    assert not host_transfer_group(cuda, "gpu")


def test_auto_keeps_the_first_choice_across_recoveries() -> None:
    """A rebuilt replicator decides while its predecessor's 2(k+1) buffers still fill the GPU:
    it votes what it holds; only a rank without buffers reads free memory."""
    total, need = 80 * GIB, 40 * GIB
    # The first replicator: 50 GiB free after the step's peak - fits with 4 GiB headroom.
    assert decide("auto", "cuda", need, (50 * GIB, total)) == "gpu"
    # After a recovery its own 40 GiB are still allocated: 10 GiB free would vote host...
    assert decide("auto", "cuda", need, (10 * GIB, total)) == "host"
    # ...so a survivor votes where its buffers are, without reading free memory at all.
    assert decide("auto", "cuda", need, None, previous="gpu") == "gpu"
    assert decide("auto", "cuda", need, None, previous="host") == "host"
    # A rank that reads free memory counts GPU buffers it would take over as free.
    assert decide("auto", "cuda", need, (10 * GIB, total), reusable=40 * GIB) == "gpu"
    assert decide("auto", "cuda", need, (5 * GIB, total), reusable=38 * GIB) == "host"
    # The user's settings and the CPU mode are never overridden.
    assert decide("cpu", "cuda", 1, None, previous="gpu") == "host"
    assert decide("gpu", "cuda", 1 << 50, None, previous="host") == "gpu"
    assert decide("auto", "cpu", 1, None) == "host"
    with pytest.raises(ValueError, match="memory reading"):
        decide("auto", "cuda", 1, None)


def test_a_survivor_reads_no_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_reading(index: int) -> tuple[int, int]:
        raise AssertionError("a rank with buffers must not read free memory")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_reading)
    memory = ReplicaMemory("auto", Device("cuda", "nccl", 0))
    assert memory.local_choice(1 << 40, previous="gpu") == "gpu"
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (3 * GIB, 80 * GIB))
    assert memory.local_choice(GIB, reusable=4 * GIB) == "gpu"  # 7 GiB >= 1 + 4 headroom
    assert memory.local_choice(GIB) == "host"


def test_select_device_refuses_a_spare_without_a_gpu_of_its_own() -> None:
    """`LOCAL_RANK` beyond the node's GPUs: a clear error, not a crash in set_device."""
    out = _select_device_in_a_fresh_process(
        "import torch, os; torch.cuda.is_available = lambda: True; "
        "torch.cuda.device_count = lambda: 2; os.environ['LOCAL_RANK'] = '2'",
        "auto",
    )
    assert "LOCAL_RANK=2: this node has 2 GPUs" in out.stdout, out.stdout + out.stderr
