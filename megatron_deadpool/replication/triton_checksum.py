"""The torch fallback's checksum on a GPU as one Triton kernel: every word is read once.

Why not torch ops alone. The checksum (`pack`) needs 64-bit sums of 32-bit words, and every torch
reduction that accumulates int32 into a wider type first writes a widened copy of its whole
input (ATen's ``make_reduction`` calls ``self.to(...)``): counted with `bench.traffic`,
``torch.sum(int32, dtype=int64)`` over N bytes moves 5N. The whole-buffer scheme
(`whole_buffer.DeviceChecksum`) converts to float64 once and reads that once: 5N per checksum,
and with the copy a pack moves 7N, 3.5 times a plain copy of the same bytes. Summing in int32
does not widen but wraps at 2**32, and a word's bytes read as int8 (``torch._int_mm``
accumulates them into int32 without a copy) lose the carries of the low bytes' sign bits; the
combinations of those found need the words read three times (5N per pack with the copy, still
2.5 times a copy), with row and column sums in int32 that wrap on purpose.

Here a program of the kernel loads `BLOCK_WORDS` words once, sign-extends them in registers and
sums ``(k + 1) * w_k`` in int64 - two's-complement multiply and add, exact mod 2**64, the
checksum's own modulus - into its partial; one ``torch.sum`` of the int64 partials (adds that
wrap the same way) writes the value into the caller's slot. A checksum of N bytes thus moves
N plus 2 partials per 16 KiB (3N for a pack with its copy: 1.5 times a plain copy), in two
launches and a few microseconds of host time, whatever N is.

Triton ships with torch's CUDA wheels and compiles with its own ``ptxas``: it needs no nvcc,
which is what leaves a GPU without the fused kernel (`kernel_build`). The kernel is a torch
custom op (``deadpool::checksum_blocks``), so it runs on the caller's current stream and
`bench.traffic` counts it like any other op. Before its first use on a device, `unusable`
checks it against the value in Python integers on a buffer with a tail and sums that wrap; a
failure (no triton, a compile error, a different value) leaves that device on the torch ops,
saying why. ``DEADPOOL_PACK_TRITON=0`` turns it off. On the host it runs only under Triton's
interpreter (``TRITON_INTERPRET=1``), which is how the tests check it without a GPU.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from .whole_buffer import WORD_BYTES, DeviceChecksum

log = logging.getLogger(__name__)

BLOCK_WORDS = 4096
"""Words summed by one program of the kernel (16 KiB; one int64 partial each)."""

DISABLE_ENV = "DEADPOOL_PACK_TRITON"
"""Set to ``0`` to keep GPU memory on the torch ops (`whole_buffer.DeviceChecksum`)."""

_lock = threading.Lock()
_verdicts: dict[str, str] = {}  # device -> "" (usable) or why not

try:
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]
except ImportError as exc:  # torch's CPU wheels come without triton
    _IMPORT_ERROR = f"triton is not importable ({exc})"
else:
    _IMPORT_ERROR = ""

    @triton.jit  # type: ignore[misc, unused-ignore]
    def _checksum_blocks(  # type: ignore[no-untyped-def, unused-ignore]
        words, partials, nwords, BLOCK: tl.constexpr
    ):
        # Program p: words [p * BLOCK, (p + 1) * BLOCK), the tail masked; int64 indices (a
        # word index reaches 2**32) and products, whose sum wraps around 2**64 as it should.
        pid = tl.program_id(0)
        index = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        word = tl.load(words + index, mask=index < nwords, other=0).to(tl.int64)
        tl.store(partials + pid, tl.sum(word * (index + 1), axis=0))

    @torch.library.custom_op("deadpool::checksum_blocks", mutates_args=("partials",))
    def _checksum_blocks_op(words: torch.Tensor, partials: torch.Tensor) -> None:
        """partials[p] = sum over the words of program p of (k + 1) * w_k (mod 2**64)."""
        grid = (partials.numel(),)
        if words.device.type == "cuda":  # the launch goes to the current device's stream
            with torch.cuda.device(words.device):
                _checksum_blocks[grid](words, partials, words.numel(), BLOCK=BLOCK_WORDS)
        else:  # Triton's interpreter (TRITON_INTERPRET=1)
            _checksum_blocks[grid](words, partials, words.numel(), BLOCK=BLOCK_WORDS)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def unusable(device: torch.device) -> str:
    """Why the Triton checksum cannot serve memory on `device`, or ``""`` when it can: checked
    once per device and process (module docstring)."""
    if os.environ.get(DISABLE_ENV, "") == "0":
        return f"turned off by {DISABLE_ENV}=0"
    if device.type != "cuda" and not (device.type == "cpu" and _interpreted()):
        return f"{device} is not a CUDA device (on the host only under TRITON_INTERPRET=1)"
    key = str(device)
    with _lock:
        if key not in _verdicts:
            _verdicts[key] = _self_check(device)
            if _verdicts[key] and not _IMPORT_ERROR:
                log.warning("deadpool: the Triton checksum is not used: %s", _verdicts[key])
        return _verdicts[key]


def _self_check(device: torch.device) -> str:
    """Run the kernel on a buffer with whole blocks, a tail and sums that wrap around 2**64,
    against the value in Python integers: ``""`` when they agree, else why not."""
    if _IMPORT_ERROR:
        return _IMPORT_ERROR
    gen = torch.Generator().manual_seed(39)
    nwords = 3 * BLOCK_WORDS + 77
    words = torch.randint(-(2**31), 2**31, (nwords,), dtype=torch.int64, generator=gen)
    words[: BLOCK_WORDS // 2] = -(2**31)
    exact = sum((k + 1) * w for k, w in enumerate(words.tolist())) % 2**64
    try:
        buf = words.to(torch.int32).view(torch.uint8).to(device)
        slot = torch.zeros(1, dtype=torch.int64, device=device)
        TritonChecksum(buf.numel(), device).enqueue(buf, slot)
        got = int(slot.item()) % 2**64
    except Exception as exc:  # noqa: BLE001 - a compile or launch failure: the torch ops work
        return f"the kernel failed its check on {device}: {type(exc).__name__}: {exc}"
    if got != exact:
        return f"the kernel's checksum on {device} is wrong ({got} != {exact})"
    return ""


class TritonChecksum:
    """The checksum of buffers of `nbytes` bytes (a multiple of 4) on `device` by the Triton
    kernel, enqueued into an int64 slot - the interface of `whole_buffer.DeviceChecksum`. A
    buffer that is not 4-byte aligned goes to a `DeviceChecksum` (its bounce buffer)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if nbytes < 0 or nbytes % WORD_BYTES:
            raise ValueError(f"nbytes {nbytes} must be a non-negative multiple of {WORD_BYTES}")
        self.nbytes = nbytes
        self.device = device
        self.kind = "Triton kernel"
        nwords = nbytes // WORD_BYTES
        if _IMPORT_ERROR:
            raise ImportError(_IMPORT_ERROR)
        nblocks = max(1, -(-nwords // BLOCK_WORDS))
        self._partials = torch.empty(nblocks, dtype=torch.int64, device=device)
        self._unaligned: DeviceChecksum | None = None

    def enqueue(self, buf: torch.Tensor, slot: torch.Tensor) -> None:
        """Enqueue the checksum of `buf` (1-D uint8, `nbytes` long) into ``slot`` (int64 [1],
        the value's uint64 bits); nothing waits for the device."""
        if buf.numel() != self.nbytes or buf.dtype != torch.uint8:
            raise ValueError(f"buffer must be {self.nbytes} uint8 bytes, got {buf.numel()}")
        with torch.no_grad():
            if not self.nbytes:
                slot.zero_()
            elif buf.storage_offset() % WORD_BYTES:
                if self._unaligned is None:
                    self._unaligned = DeviceChecksum(self.nbytes, self.device)
                self._unaligned.enqueue(buf, slot)
            else:
                _checksum_blocks_op(buf.view(torch.int32), self._partials)
                torch.sum(self._partials, 0, keepdim=True, out=slot)
