"""Whether the fused pack kernel packs on this device, and the verdict on it.

On CUDA the torch fallback is a failure, not a skip: it packs in many small operations, so a
round costs the training loop GPU time and holds the host (issue 39 measured +15 ms and 21-26 ms
of host time per round at 1.5 GB on an H200). The state comes from
`replication.pack.kernel_status` where that exists; otherwise from `pack.backend_for`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from ...replication import pack

Verdict = Literal["pass", "fail", "skipped"]


@dataclass(frozen=True)
class KernelState:
    """Which backend packs on a device (`"cuda"`: the fused kernel; `"torch"`, `"numpy"`),
    why, and how to get the kernel when it is not used (empty when it is)."""

    backend: str
    reason: str
    fix: str


def build_command(device: torch.device) -> str:
    """The command that builds the kernel for `device`'s architecture from a clone."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"TORCH_CUDA_ARCH_LIST={major}.{minor} pip install --no-build-isolation ./cuda_kernels"


def kernel_state(device: torch.device) -> KernelState:
    """The pack backend on `device` (a CUDA device)."""
    status = getattr(pack, "kernel_status", None)
    if status is not None:
        found = status(device)
        return KernelState(str(found.backend), str(found.reason), str(found.fix))
    probe = torch.empty(4, dtype=torch.uint8, device=device)
    backend = pack.backend_for(probe)
    if backend == "cuda":
        return KernelState(backend, f"{pack.EXTENSION_NAME} loaded", "")
    if os.environ.get("DEADPOOL_PACK_BACKEND", "").lower() == "torch":
        return KernelState(
            backend,
            "DEADPOOL_PACK_BACKEND=torch forces the torch fallback",
            "unset DEADPOOL_PACK_BACKEND",
        )
    return KernelState(
        backend,
        f"the extension {pack.EXTENSION_NAME} is not installed (or built for another ABI)",
        f"{build_command(device)} (cuda_kernels/README.md)",
    )


def judge(state: KernelState | None) -> tuple[Verdict, str]:
    """The verdict on the pack backend: None means no CUDA device (skipped)."""
    if state is None:
        return "skipped", "skipped: no CUDA"
    if state.backend == "cuda":
        return "pass", f"the fused pack kernel packs on the GPU ({state.reason})"
    return "fail", (
        f"the fused pack kernel is not used on this GPU: {state.reason}; replicas are packed by "
        f"the {state.backend} fallback, which adds GPU time to every step and holds the host in "
        f"each round. Fix: {state.fix}"
    )
