"""The pack kernel against the host: what the first contact's `kernel` and `pack` rows, the
selftest's pack-kernel row and the GPU suite each check, written once.

On the device: a checksum of a misaligned buffer (starting 1 byte in, a 12-byte tail past 16)
and a pack of mixed dtypes (fp32, bf16, a bf16 tensor 2 bytes into its storage, an odd-length
byte tensor) compared with the host's pack of the same tensors, checksum and bytes; an unpack
into fresh tensors, bitwise; with the fused kernel, the torch fallback's checksums of the packed
buffer too (the one it uses, and its torch ops where it uses the Triton kernel); timed (optional) against a plain device `copy_` of the same bytes.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ...replication import pack
from .base import elapsed_ms

MIN_BYTES = 64 << 10
"""The smallest buffer the check lays its four tensors into."""


def pack_against_host(
    nbytes: int, *, timed: bool = True, seed: int = 7, device: str = "cuda"
) -> tuple[list[str], dict[str, Any]]:
    """(problems, figures) of the pack on `device` of about `nbytes` bytes against the host's.

    Needs about 4 x `nbytes` of device memory and 2 x `nbytes` of host memory. `timed` (CUDA
    only): pack and plain copy timed with CUDA events. On the CPU it checks the check itself."""
    if nbytes < MIN_BYTES:
        raise ValueError(f"nbytes: {nbytes} is below {MIN_BYTES}; give a larger buffer")
    nbytes = nbytes // 16 * 16
    gen = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes + 20,), dtype=torch.uint8, device=device, generator=gen)
    host = raw.cpu() if raw.is_cuda else raw.clone()  # a copy of its own either way
    problems: list[str] = []
    if pack.checksum(raw[1 : nbytes + 13]) != pack.checksum(host[1 : nbytes + 13]):
        problems.append("checksum of a misaligned buffer differs from the host's")
    quarter = nbytes // 4
    tensors = [
        raw[:quarter].view(torch.float32),
        raw[quarter : 2 * quarter].view(torch.bfloat16),
        raw[2 * quarter + 2 : 3 * quarter + 2].view(torch.bfloat16),  # 2-byte aligned source
        raw[3 * quarter + 4 : 3 * quarter + 4 + 4096 * 3 + 4],  # odd length
    ]
    plan = pack.PackPlan(tensors)
    out = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    checksum = plan.pack(out)
    host_out = torch.empty(plan.nbytes, dtype=torch.uint8)
    expected = pack.pack([t.cpu() for t in tensors], host_out)
    if checksum != expected:
        problems.append(f"pack checksum {checksum:#x}, the host's {expected:#x}")
    if not torch.equal(out.cpu(), host_out):
        problems.append("packed bytes differ from the host's")
    del host_out
    figures: dict[str, Any] = {"bytes": plan.nbytes, "backend": plan.backend}
    if plan.backend == "cuda":  # the fallback on the same device must agree with the kernel
        before = os.environ.get("DEADPOOL_PACK_BACKEND")
        os.environ["DEADPOOL_PACK_BACKEND"] = "torch"
        try:
            fallback = pack.checksum(out)
        finally:
            if before is None:
                del os.environ["DEADPOOL_PACK_BACKEND"]
            else:
                os.environ["DEADPOOL_PACK_BACKEND"] = before
        figures["fallback_checksum_ok"] = fallback == checksum
        if fallback != checksum:
            problems.append(
                f"the torch fallback's checksum {fallback:#x}, the kernel's {checksum:#x}"
            )
        # The fallback's torch ops too, which the line above skips where triton is installed.
        slot = torch.zeros(1, dtype=torch.int64, device=out.device)
        pack.fallback_checksum(out.numel(), out.device, "torch").enqueue(out, slot)
        torch_ops = int(slot.item()) % 2**64
        figures["fallback_torch_ops_ok"] = torch_ops == checksum
        if torch_ops != checksum:
            problems.append(f"the torch ops' checksum {torch_ops:#x}, the kernel's {checksum:#x}")
    restored = [torch.empty_like(t) for t in tensors]
    if pack.unpack(out, restored) != checksum:
        problems.append("unpack checksum differs from the pack's")
    # Bytes, not values: random bytes viewed as floats hold NaNs, which equal nothing.
    if not all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(restored, tensors)
    ):
        problems.append("unpacked tensors differ from the originals")
    del restored, host
    if timed and raw.is_cuda:
        pack_ms = elapsed_ms(lambda: plan.pack_on_device(out))
        copy_dst = torch.empty_like(out)
        src = raw[: plan.nbytes]
        copy_ms = elapsed_ms(lambda: copy_dst.copy_(src))
        figures.update(
            pack_ms=round(pack_ms, 3),
            copy_ms=round(copy_ms, 3),
            pack_gb_s=round(plan.nbytes / pack_ms / 1e6, 1),
            copy_gb_s=round(plan.nbytes / copy_ms / 1e6, 1),
        )
    return problems, figures
