"""The checks that need no training run: communication settings, replica memory, pack kernel.

`settings` applies DeadPool's rules (`devices.gloo.check_settings`, and on CUDA
`devices.nccl.apply_settings`) to a copy of the environment the training processes inherit,
and reports what each variable will be. `capture` is a replica's life in miniature: a shard's
tensors packed and checksummed on the device (`replication.pack`), copied into replica memory
of the kind `devices.memory.ReplicaMemory` picks (GPU memory or pinned host memory), checksummed
there and unpacked into fresh tensors, each step compared with a host-side reference pack.
`pack_kernel` is the shared GPU check (`selftest.gpu_checks`): on CUDA, the fused kernel must
be what packs, and its pack must equal the host's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import torch

from ..devices import gloo, nccl
from ..devices.base import Device
from ..devices.memory import Choice, ReplicaMemory
from ..devices.pinned import buffer
from ..errors import ConfigError
from ..replication import pack
from ..units import human_bytes
from .gpu_checks import kernel
from .gpu_checks.pack_check import pack_against_host
from .table import Row

SETTINGS = "settings"
REPLICA_MEMORY = "replica memory"
PACK_KERNEL = "pack kernel"
NO_CUDA = "skipped: no CUDA"


def settings(cuda: bool, environ: Mapping[str, str] | None = None) -> Row:
    """What DeadPool's communication settings make of `environ` (default: this process's),
    or the refusal of a user setting that breaks recovery."""
    t0 = time.perf_counter()
    env = dict(os.environ if environ is None else environ)
    user = dict(env)
    try:
        gloo.check_settings(env)
        applied = nccl.apply_settings(env) if cuda else {}
    except ConfigError as exc:
        return Row(SETTINGS, "fail", time.perf_counter() - t0, str(exc))
    lazy = user.get("TORCH_GLOO_LAZY_INIT")
    lines = [
        "gloo: TORCH_GLOO_LAZY_INIT "
        + (f"={lazy} (not lazy)" if lazy else "unset")
        + ": a group connects its peers at creation (what an abort shuts down)"
    ]
    data: dict[str, object] = {"TORCH_GLOO_LAZY_INIT": lazy}
    if cuda:
        for name in (*nccl.REQUIRED, *nccl.DEFAULTS):
            how = "your value, kept" if name in user else "applied by DeadPool"
            if name in nccl.REQUIRED:
                how = "required; " + how
            lines.append(f"nccl: {name}={env[name]} ({how})")
            data[name] = env[name]
        blocking = user.get("TORCH_NCCL_BLOCKING_WAIT")
        lines.append(f"nccl: TORCH_NCCL_BLOCKING_WAIT {blocking or 'unset'} (left as is)")
        data["applied"] = applied
    else:
        lines.append("nccl: not used (no CUDA): the TORCH_NCCL_* settings apply on GPUs only")
    return Row(SETTINGS, "pass", time.perf_counter() - t0, "\n".join(lines), data)


def sample_shard(device: torch.device, scale: int = 1) -> list[torch.Tensor]:
    """Tensors like a rank's optimizer shard (fp32 main params, Adam moments, a bf16 tensor, the
    step count, RNG bytes), deterministic, with odd sizes so the packed layout has padding;
    `scale` multiplies the large ones' sizes."""
    g = torch.Generator().manual_seed(1234)
    n = 1001 * scale
    tensors = [
        torch.randn(n, generator=g),
        torch.randn(n, generator=g),
        torch.rand(n, generator=g),
        torch.randn(333 * scale, generator=g).to(torch.bfloat16),
        torch.tensor([7], dtype=torch.int64),
        torch.randint(0, 256, (37,), generator=g, dtype=torch.uint8),
    ]
    return [t.to(device) for t in tensors]


def verify(replica: torch.Tensor, reference: torch.Tensor, expected: int, where: str) -> list[str]:
    """What is wrong with `replica` (on any device) against the host `reference` bytes and
    their checksum `expected`: its checksum (computed where it lives) and its bytes."""
    problems = []
    found = pack.checksum(replica)
    if found != expected:
        problems.append(f"{where}: checksum {found:#x}, expected {expected:#x}")
    if not torch.equal(replica.cpu(), reference):
        problems.append(f"{where}: bytes differ from the host reference")
    return problems


def capture(memory: ReplicaMemory, choice: Choice, scale: int = 1) -> tuple[list[str], int, str]:
    """Pack a sample shard on `memory`'s device, copy it into a replica of `choice`, check
    it and unpack it; returns (problems, packed bytes, pack backend)."""
    device = memory.device.torch_device
    tensors = sample_shard(device, scale)
    host = [t.cpu() for t in tensors]
    reference = torch.zeros(pack.packed_nbytes(host), dtype=torch.uint8)
    expected = pack.pack(host, reference)
    plan = pack.PackPlan(tensors, device)
    snapshot = torch.zeros(plan.nbytes, dtype=torch.uint8, device=device)
    problems = []
    packed = plan.pack(snapshot)
    if packed != expected:
        problems.append(f"pack on {device}: checksum {packed:#x}, expected {expected:#x}")
    problems += verify(snapshot, reference, expected, f"snapshot on {device}")
    pinned = memory.pinned(choice)
    replica = buffer(plan.nbytes, memory.torch_device(choice), pinned=pinned)  # as replicas are
    replica.copy_(snapshot, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    where = "pinned host replica" if pinned else f"replica on {replica.device}"
    if pinned and not replica.is_pinned():
        problems.append(f"{where}: not pinned")
    problems += verify(replica, reference, expected, where)
    restored = [torch.zeros_like(t) for t in tensors]
    if pack.unpack(replica.to(device), restored) != expected:
        problems.append(f"unpack from {where}: checksum differs from the packed one")
    if not all(torch.equal(a.cpu(), b) for a, b in zip(restored, host)):
        problems.append(f"unpack from {where}: restored tensors differ from the originals")
    return problems, plan.nbytes, plan.backend


def replica_memory(cuda: bool) -> Row:
    """A sample shard captured into GPU memory and into pinned host memory (CUDA only)."""
    if not cuda:
        return Row(REPLICA_MEMORY, "skipped", 0.0, NO_CUDA)
    t0 = time.perf_counter()
    memory = ReplicaMemory(
        setting="auto", device=Device("cuda", "nccl", torch.cuda.current_device())
    )
    problems, nbytes, backend = capture(memory, "gpu")
    problems += capture(memory, "host")[0]
    seconds = time.perf_counter() - t0
    data = {"bytes": nbytes, "pack_backend": backend}
    if problems:
        return Row(REPLICA_MEMORY, "fail", seconds, "; ".join(problems), data)
    detail = (
        f"a {human_bytes(nbytes)} shard packed on {memory.device.torch_device} ({backend} "
        "backend), copied into GPU memory and into pinned host memory: checksums and bytes "
        "equal to a host reference, unpacked bitwise"
    )
    return Row(REPLICA_MEMORY, "pass", seconds, detail, data)


PACK_KERNEL_BYTES = 16 << 20


def pack_kernel(cuda: bool) -> Row:
    """The fused CUDA pack/checksum kernel (`deadpool_cuda_kernels`): on CUDA it must be the
    backend that packs (`gpu_checks.kernel`: the torch fallback FAILs, naming the fix), and its
    pack of a 16 MiB misaligned, mixed-dtype buffer must equal the host's
    (`gpu_checks.pack_check`); skipped without CUDA."""
    if not cuda:
        status, detail = kernel.judge(None)
        return Row(PACK_KERNEL, status, 0.0, detail)
    t0 = time.perf_counter()
    state = kernel.kernel_state(torch.device("cuda", torch.cuda.current_device()))
    status, detail = kernel.judge(state)
    data: dict[str, object] = {"pack_backend": state.backend}
    if status != "pass":
        return Row(PACK_KERNEL, status, time.perf_counter() - t0, detail, data)
    problems, figures = pack_against_host(PACK_KERNEL_BYTES, timed=False)
    seconds = time.perf_counter() - t0
    data.update(figures)
    if problems:
        return Row(PACK_KERNEL, "fail", seconds, "; ".join(problems), data)
    detail = (
        f"{pack.EXTENSION_NAME}: a {human_bytes(figures['bytes'])} misaligned, mixed-dtype "
        "buffer packed, checksummed and unpacked on the GPU, equal to the host's"
    )
    return Row(PACK_KERNEL, "pass", seconds, detail, data)
