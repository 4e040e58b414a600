"""Pack a rank's shard tensors into one flat byte buffer and checksum it in the same pass.

Every iteration a rank gathers the tensors of its optimizer shard (fp32 main params, Adam's
``exp_avg`` / ``exp_avg_sq``, ``step``, bf16/fp16 tensors, RNG bytes, ...) into one contiguous
``uint8`` buffer that peers hold as a replica, together with a 64-bit checksum the holders
verify. This module is the one interface for that: `pack`, `unpack`, `checksum`,
`packed_nbytes`, and `PackPlan` for packing the same tensors again and again (the layout and
the copy lists are worked out once; on CPU each chunk is then filled by one `torch.cat`). It
reads every byte once - the checksum is computed while the bytes are copied (on CPU chunk by
chunk while each chunk is still in cache; on CUDA in one fused kernel, or with a handful of
whole-buffer torch ops where the kernel is not available: see Backends).

Packed layout
-------------
Tensor ``j`` (``nbytes_j = numel * element_size``, its raw bytes in memory order, any dtype)
starts at ``offset_0 = 0`` and ``offset_{j+1} = align(offset_j + nbytes_j)`` where
``align(x)`` rounds ``x`` up to a multiple of ``ALIGN = 16``. The bytes between the end of a
tensor and the next offset are zero. ``packed_nbytes = align(offset_last + nbytes_last)``, a
multiple of 16 (0 for no tensors), so the packed region always holds a whole number of 4-byte
words, and is at most ``MAX_PACKED_BYTES`` = 16 GiB.

Checksum
--------
View the buffer as ``n`` little-endian 4-byte words and let ``w_i`` be word ``i`` read as a
SIGNED int32. Then::

    checksum = ( sum_{i=0}^{n-1} (i + 1) * w_i )  mod 2**64,   a Python int in [0, 2**64).

Examples: words ``[1, 2, 3]`` give 14; the single word ``-1`` gives ``2**64 - 1``.

Why it detects the faults we care about, for ``n <= 2**32`` words (buffers up to 16 GiB;
larger ones are refused with `PackError`):

* One flipped bit (bit ``b`` of word ``i``) changes ``w_i`` by ``+-2**b`` with ``b <= 31`` (the
  sign bit changes the signed value by exactly ``2**31``), so the sum changes by
  ``(i + 1) * 2**b``: nonzero, and of magnitude ``<= 2**32 * 2**31 = 2**63 < 2**64``, hence
  nonzero mod ``2**64``.
* Swapping two distinct words ``i != j`` (``w_i != w_j``) changes the sum by
  ``(i + 1) w_j + (j + 1) w_i - (i + 1) w_i - (j + 1) w_j = (i - j) (w_j - w_i)``: a product of
  two nonzero integers with ``|i - j| < 2**32`` and ``|w_j - w_i| < 2**32``, so nonzero with
  magnitude ``< 2**64``, hence nonzero mod ``2**64``.

It is a guard against accidental corruption and misplaced data (bit rot, torn or shifted
copies, stale pages), not a cryptographic hash.

The 16 GiB limit is this proof's, not an indexing limit: the CUDA kernel indexes vectors with
int64 and computes in uint64, and the torch fallback's int64 partial sums are bounded (below)
for up to 2**32 words. Beyond it a weight ``i + 1`` can be a multiple of ``2**33``, and a flip of
bit 31 of that word changes the sum by a multiple of ``2**64``: undetected. Lifting it needs
another checksum (e.g. per-16-GiB blocks combined with odd factors, which keeps single-bit
detection but loses the swap guarantee across blocks); until then a rank's shard must stay
below 16 GiB (12 bytes per parameter with Adam: about 1.4 billion parameters per rank).

Backends
--------
Three backends compute the same value exactly; callers never see which one ran
(`backend_for` reports it, `kernel_status` says why the kernel is or is not in use):

* ``cuda`` (tensors on a CUDA device): one fused kernel copies, zero-fills and checksums
  (uint64 arithmetic, whose wraparound is exactly mod ``2**64``), enqueued on the current
  stream with the checksum left in a device slot (`PackPlan.pack_on_device`). The extension
  ``deadpool_cuda_kernels`` comes from an install-time build (``cuda_kernels/``) or, when that
  does not import, is compiled on first use from the sources shipped in the package into a
  per-user cache (`kernel_build`, about 30 s once per environment and GPU architecture).
* ``numpy`` (host buffers up to ``_NUMPY_MAX_BYTES``, where it is the faster, and host
  buffers of any size checked on one core: `checksum`'s ``one_core``): the buffer goes in
  cache-sized chunks, each checksummed right after it is copied while it is still in cache;
  each chunk's words are sign-extended to uint64 and multiplied by their weights ``1..n`` and
  summed in one numpy call - uint64 wraparound again, so ``sum_k (start + k + 1) w_k = sum_k
  (k + 1) w_k + start * sum_k w_k`` (mod ``2**64``) combines the chunks.
* ``torch`` (larger host buffers; device memory when the kernel cannot be built or loaded; or
  anywhere with ``DEADPOOL_PACK_BACKEND=torch``): torch has no uint64 arithmetic, so rows of
  ``_ROW_WORDS`` words are widened to int64 and reduced to their row sums and column sums,
  and with ``k = g * L + c`` (row ``g``, column ``c``, ``L`` words per row)::

      sum_k (k + 1) w_k = L * sum_g g * rowsum_g + sum_c (c + 1) * colsum_c

  On the host this runs chunk by chunk like numpy's (cache-sized chunks, combined exactly
  from bounded int64 partial sums and Python integers; the bounds are noted where they are
  used). On a GPU it runs on the whole buffer (`whole_buffer`: one ``torch.cat`` for the
  copy, the checksum on the device into a slot, no host sync - so `PackPlan.pack_on_device`
  works here too), and the first pack of a process logs a warning with its measured cost and
  how to get the kernel. The checksum there is one Triton kernel where triton is installed
  (torch's CUDA wheels bring it) and passed its check on the device (`triton_checksum`: the
  words read once, a pack moving 1.5 times the bytes of a plain copy, in three launches), or
  else two torch ops per 64 MiB slab (`whole_buffer.DeviceChecksum`: a float64 conversion
  and one matrix product, 3.5 times a copy's bytes, since torch widens int32 only through a
  copy of its input);
  `fallback_checksum` chooses, ``deadpool bench pack --traffic`` counts both.
"""

from __future__ import annotations

import importlib
import logging
import os
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from ..devices.cpu import plain_torch
from . import kernel_build
from .whole_buffer import Checksummer, DeviceChecksum, WholeBufferPlan

log = logging.getLogger(__name__)

ALIGN = 16
"""Every tensor starts at a multiple of this many bytes; gap bytes are zero."""

WORD_BYTES = 4
MAX_PACKED_BYTES = WORD_BYTES * 2**32
"""Largest buffer `checksum` accepts (16 GiB = 2**32 words); the detection proof needs it."""

EXTENSION_NAME = kernel_build.EXTENSION_NAME
EXTENSION_ABI = kernel_build.EXTENSION_ABI
"""The ``ABI`` attribute the CUDA extension must carry to be used (2: the GPU entry points
only enqueue; segment tables and checksum slots are device tensors owned by this module)."""

_MASK64 = (1 << 64) - 1

# Host geometry of the chunked schemes (GPU memory uses `whole_buffer`). A row is _ROW_WORDS
# int32 words; a chunk is _CPU_CHUNK_BYTES (whole rows). Bounds used for exact int64 arithmetic, with L = _ROW_WORDS = 256, R = rows per chunk
# <= 4096 and at most 2**32 words in all:
#   |rowsum|                 <= L * 2**31                 = 2**39
#   |sum_r r * rowsum_r|     <= R**2 / 2 * 2**39          <= 2**62   (per chunk)
#   |colsum over all rows|   <= (2**32 / L) * 2**31       = 2**55
# Everything combined across chunks or weighted by (c + 1) is done with Python ints.
_ROW_WORDS = 256
_CPU_CHUNK_BYTES = 2 << 20
_MAX_CHUNK_ROWS = 4096  # the bounds above cap a chunk at 4096 rows = 4 MiB
# The numpy backend's per-call cost is a few numpy calls, the torch scheme's a dozen torch ops,
# but numpy's uint64 multiply-add is scalar while the torch scheme only adds (vectorized):
# numpy wins on small buffers (2.3x at 0.4 MB), ties at 4 MB and loses beyond (0.8x at 64 MB).
_NUMPY_MAX_BYTES = 4 << 20


class PackError(ValueError):
    """A tensor or buffer handed to pack/unpack/checksum is unusable; the message says why."""


# ---------------------------------------------------------------------------------------------
# Layout and validation


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def packed_offsets(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Byte offset of each tensor in the packed region (see the module docstring)."""
    offsets = []
    offset = 0
    for tensor in tensors:
        offsets.append(offset)
        offset = _align(offset + _nbytes(tensor))
    return offsets


def packed_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Total bytes of the packed region including padding; a multiple of `ALIGN`."""
    total = 0
    for tensor in tensors:
        total = _align(total + _nbytes(tensor))
    return total


def _check_tensors(tensors: Sequence[torch.Tensor], device: torch.device) -> None:
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise PackError(f"tensor {index} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.layout != torch.strided:
            raise PackError(f"tensor {index} has layout {tensor.layout}; only strided tensors pack")
        if not tensor.is_contiguous():
            raise PackError(
                f"tensor {index} (shape {tuple(tensor.shape)}, stride {tensor.stride()}) is not "
                "contiguous; pass tensor.contiguous() or the contiguous storage it views"
            )
        if tensor.is_conj() or tensor.is_neg():
            raise PackError(f"tensor {index} has a lazy conj/neg bit; call resolve_conj() first")
        if tensor.device != device:
            raise PackError(
                f"device mismatch: tensor {index} is on {tensor.device}, the packed buffer is "
                f"on {device}"
            )


def _check_flat(buf: torch.Tensor, role: str) -> None:
    if not isinstance(buf, torch.Tensor):
        raise PackError(f"the {role} buffer is a {type(buf).__name__}, not a torch.Tensor")
    if buf.dtype != torch.uint8:
        raise PackError(f"the {role} buffer must have dtype torch.uint8, got {buf.dtype}")
    if buf.dim() != 1:
        raise PackError(f"the {role} buffer must be 1-D, got shape {tuple(buf.shape)}")
    if buf.layout != torch.strided or (buf.numel() > 1 and buf.stride(0) != 1):
        raise PackError(f"the {role} buffer must be contiguous (stride 1)")


def _check_size(nbytes: int) -> None:
    if nbytes > MAX_PACKED_BYTES:
        raise PackError(
            f"buffer of {nbytes} B exceeds the checksum limit of {MAX_PACKED_BYTES} B "
            "(2**32 words); a larger data-parallel (or tensor/pipeline) size gives each rank a "
            "smaller optimizer shard"
        )


# ---------------------------------------------------------------------------------------------
# Backend selection


_EXTENSION: ModuleType | None = None
_EXTENSION_LOADED = False
_BUILD_TRIED = False
_NO_KERNEL = (
    f"extension {EXTENSION_NAME} not installed and no CUDA device in use to build it for",
    "pip install --no-build-isolation ./cuda_kernels",
)
_WHY_NOT = _NO_KERNEL  # (reason, fix) while `_EXTENSION` is None


@dataclass(frozen=True)
class KernelStatus:
    """Which backend packs a device's memory, and why the fused kernel is not the one."""

    backend: str
    """``"cuda"`` (the fused kernel), ``"torch"`` or ``"numpy"``."""
    reason: str
    """Why the kernel is not in use (empty when it is)."""
    fix: str
    """The command or step that makes it available (empty when it is, or not applicable)."""


def kernel_status(device: torch.device) -> KernelStatus:
    """The pack backend for memory on `device` and, on a CUDA device without the kernel, why
    not and how to fix it. On a CUDA device this builds or loads the kernel first if this
    process has not tried yet (`kernel_build`; about 30 s the first time in an environment)."""
    if device.type != "cuda":
        backend = "torch" if _forced_torch() else "numpy"
        return KernelStatus(backend, f"{device.type} memory: the kernel is for CUDA devices", "")
    if _forced_torch():
        return KernelStatus(
            "torch", "forced by DEADPOOL_PACK_BACKEND=torch", "unset DEADPOOL_PACK_BACKEND"
        )
    if _extension(device) is not None:
        return KernelStatus("cuda", "", "")
    return KernelStatus("torch", *_WHY_NOT)


def _extension(device: torch.device | None = None) -> ModuleType | None:
    """The CUDA extension if it is installed (or built for `device`, a CUDA device, on first
    use: `kernel_build`), compatible, not disabled and - checked once on the first CUDA
    device asked about - working there, else None (`_WHY_NOT` says why)."""
    global _EXTENSION, _EXTENSION_LOADED, _BUILD_TRIED, _WHY_NOT
    if _forced_torch():
        return None
    if not _EXTENSION_LOADED:
        _EXTENSION_LOADED = True
        try:
            module: ModuleType | None = importlib.import_module(EXTENSION_NAME)
        except ImportError:
            module = None
        if module is not None and getattr(module, "ABI", None) != EXTENSION_ABI:
            found = getattr(module, "ABI", None)
            reason = f"the installed {EXTENSION_NAME} has ABI {found}, need {EXTENSION_ABI}"
            fix = "pip install --no-build-isolation ./cuda_kernels (from this version's source)"
            _WHY_NOT = (reason, fix)
            module = None
        _EXTENSION = module
    if device is not None and device.type == "cuda" and not _BUILD_TRIED:
        _BUILD_TRIED = True  # once per process: check the installed kernel, else build one
        if _EXTENSION is not None:
            problem = _kernel_problem(_EXTENSION, device)
            if problem is not None:
                fix = "pip uninstall deadpool-cuda-kernels (then it is built for this GPU)"
                _fall_back(problem, fix)
        if _EXTENSION is None:
            try:
                built = kernel_build.load(kernel_build.device_arch(device))
            except kernel_build.KernelBuildError as exc:
                _fall_back(exc.reason, exc.fix)
            else:
                _EXTENSION = built.module
                problem = _kernel_problem(built.module, device)
                if problem is not None:
                    fix = f"rm -r {built.path.parent}; check that nvcc supports this GPU and driver"
                    _fall_back(problem, fix)
    return _EXTENSION


def _fall_back(reason: str, fix: str) -> None:
    global _EXTENSION, _WHY_NOT
    _EXTENSION = None
    _WHY_NOT = (reason, fix)
    log.warning("deadpool: the fused pack kernel is not in use: %s; fix: %s", reason, fix)


_PROBE_WORDS = 1024


def _kernel_problem(module: ModuleType, device: torch.device) -> str | None:
    """Why the extension's kernel does not work on `device` (it checksums 4 KiB of known
    words), or None when it does."""
    buf = torch.arange(_PROBE_WORDS, dtype=torch.int32, device=device).view(torch.uint8)
    slot = torch.zeros(1, dtype=torch.int64, device=device)
    try:
        if device.type == "cuda":
            with torch.cuda.device(device):
                module.checksum(buf, slot, _stream(device))
        else:
            module.checksum(buf, slot, 0)
        value = int(slot.item()) & _MASK64
    except RuntimeError as exc:
        return f"the kernel does not run on {device}: {str(exc).strip().splitlines()[0]}"
    expected = sum((i + 1) * i for i in range(_PROBE_WORDS))
    if value != expected:
        return f"the kernel's checksum of a probe on {device} is {value}, not {expected}"
    return None


def _forced_torch() -> bool:
    return os.environ.get("DEADPOOL_PACK_BACKEND", "").lower() == "torch"


def backend_for(tensor: torch.Tensor, *, one_core: bool = False) -> str:
    """The backend (module docstring) that handles a buffer like `tensor` (device and size;
    `one_core`: a host checksum that must not start an OpenMP team, see `checksum`)."""
    return _backend(tensor.device, tensor.numel() * tensor.element_size(), one_core)


def _backend(device: torch.device, nbytes: int, one_core: bool = False) -> str:
    if device.type == "cuda" and _extension(device) is not None:
        return "cuda"
    small = nbytes <= _NUMPY_MAX_BYTES or one_core
    return "numpy" if device.type == "cpu" and small and not _forced_torch() else "torch"


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _cuda_checksum(slot: torch.Tensor) -> int:
    """The value of a device checksum slot (waits for the kernel that fills it)."""
    return int(slot.item()) & _MASK64


# ---------------------------------------------------------------------------------------------
# Public operations


class PackPlan:
    """The packed layout of a fixed list of tensors, worked out once.

    Validation, offsets, the byte views of every tensor and the per-chunk copy lists depend
    only on the tensors' shapes, dtypes and storage, so a caller that packs the same live
    tensors every iteration (a rank's optimizer shard, updated in place) builds the plan once
    and each `pack`/`unpack` then only moves bytes. The tensors must keep their storage for
    the plan's life (in-place updates are fine; a reallocated tensor needs a new plan).
    """

    @plain_torch
    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> None:
        self.device = device if device is not None else _device_of(tensors)
        _check_tensors(tensors, self.device)
        self.tensors = list(tensors)
        self.offsets = packed_offsets(self.tensors)
        self.nbytes = packed_nbytes(self.tensors)
        _check_size(self.nbytes)
        # Per chunk: word range, the byte ranges it copies (None: zero padding), and the same
        # as one list of sources that `torch.cat` writes into the chunk in a single call.
        self._chunks: list[tuple[int, int, list[tuple[int, int, torch.Tensor | None]]]] = []
        self._sources: list[list[torch.Tensor]] = []
        self.backend = _backend(self.device, self.nbytes)
        self._whole: WholeBufferPlan | None = None
        if self.backend == "torch" and self.device.type == "cuda":
            self._whole = _whole_buffer_plan(self.tensors, self.offsets, self.nbytes, self.device)
            self._slot = torch.zeros(1, dtype=torch.int64, device=self.device)
        elif self.backend == "cuda":
            # Built once: the tensors keep their storage for the plan's life. The host table is
            # moved to the device here, not per pack (a pageable copy makes the host wait).
            ext = _extension()
            assert ext is not None
            table = ext.segment_table(self.tensors, self.offsets, self.nbytes)
            self._table = table.to(self.device)
            self._slot = torch.zeros(1, dtype=torch.int64, device=self.device)
        else:
            zeros = torch.zeros(ALIGN, dtype=torch.uint8, device=self.device)
            pieces = _pieces(self.tensors, self.offsets, self.nbytes)
            cursor = 0
            for start, stop in _chunk_bounds(self.nbytes // WORD_BYTES):
                lo, hi = start * WORD_BYTES, stop * WORD_BYTES
                found, cursor = _overlapping(pieces, lo, hi, cursor)
                copies = [
                    (a, b, None if p.data is None else p.data[a - p.start : b - p.start])
                    for p, a, b in found
                ]
                self._chunks.append((start, stop, copies))
                self._sources.append([zeros[: b - a] if t is None else t for a, b, t in copies])

    def _check_buffer(self, buf: torch.Tensor, role: str) -> None:
        _check_flat(buf, role)
        if buf.device != self.device:
            raise PackError(
                f"device mismatch: the tensors are on {self.device}, the {role} buffer is on "
                f"{buf.device}"
            )
        if buf.numel() < self.nbytes:
            raise PackError(f"{role} is too small: {buf.numel()} B < packed_nbytes {self.nbytes} B")

    @plain_torch
    def pack(self, out: torch.Tensor) -> int:
        """Copy the tensors into `out` (1-D contiguous uint8, at least `nbytes` long) in the
        packed layout and return the region's checksum; bytes beyond it are left untouched."""
        if self.backend == "cuda" or self._whole is not None:
            return _cuda_checksum(self.pack_on_device(out))
        self._check_buffer(out, "out")
        acc = _accumulator(self.nbytes // WORD_BYTES, self.backend, self.device)
        with torch.no_grad():
            for (start, stop, _), sources in zip(self._chunks, self._sources):
                chunk = out[start * WORD_BYTES : stop * WORD_BYTES]
                torch.cat(sources, out=chunk)
                acc.feed(start, chunk)
        return acc.result()

    @plain_torch
    def pack_on_device(self, out: torch.Tensor) -> torch.Tensor:
        """CUDA memory only (the kernel, or the torch fallback's whole-buffer ops): enqueue the
        pack on the current stream and return the device slot (int64 [1], the checksum's
        uint64 bits) it writes; nothing waits. The slot is reused by the next call: consume it
        on the same stream first."""
        if self.device.type != "cuda" or (self.backend != "cuda" and self._whole is None):
            raise PackError(
                f"pack_on_device needs CUDA memory, this plan packs {self.device} memory with "
                f"the {self.backend} backend"
            )
        self._check_buffer(out, "out")
        if self._whole is not None:
            if not _FALLBACK_ANNOUNCED:
                _announce_fallback(self._whole, out, self._slot)
            self._whole.pack(out, self._slot)
            return self._slot
        ext = _extension()
        assert ext is not None
        with torch.cuda.device(self.device):
            ext.pack(self._table, out, self.nbytes, self._slot, _stream(self.device))
        return self._slot

    @plain_torch
    def unpack(self, flat: torch.Tensor) -> int:
        """Copy the packed bytes of `flat` back into the tensors; returns the checksum of
        ``flat[:nbytes]`` computed in the same pass (the tensors are written either way)."""
        self._check_buffer(flat, "flat")
        if self._whole is not None:
            self._whole.unpack(flat, self._slot)
            return _cuda_checksum(self._slot)
        if self.backend == "cuda":
            ext = _extension()
            assert ext is not None
            with torch.cuda.device(self.device):
                ext.unpack(flat, self._table, self.nbytes, self._slot, _stream(self.device))
            return _cuda_checksum(self._slot)
        acc = _accumulator(self.nbytes // WORD_BYTES, self.backend, self.device)
        with torch.no_grad():
            for start, stop, copies in self._chunks:
                acc.feed(start, flat[start * WORD_BYTES : stop * WORD_BYTES])
                for a, b, dst in copies:
                    if dst is not None:
                        dst.copy_(flat[a:b])
        return acc.result()


CHECKSUMS = ("auto", "torch", "triton")
"""How the torch fallback checksums: ``triton`` (one kernel, `triton_checksum`), ``torch``
(whole-buffer torch ops, `whole_buffer.DeviceChecksum`) or ``auto`` (Triton on a CUDA device
where it passed its check, the torch ops elsewhere)."""


def fallback_checksum(nbytes: int, device: torch.device, kind: str = "auto") -> Checksummer:
    """The torch fallback's checksum of `nbytes`-byte buffers on `device`, by `kind` (one of
    `CHECKSUMS`); ``triton`` where the kernel cannot run raises `PackError` saying why."""
    if kind not in CHECKSUMS:
        raise PackError(f"checksum kind {kind!r} is not one of {', '.join(CHECKSUMS)}")
    if kind == "torch" or (kind == "auto" and device.type != "cuda"):
        return DeviceChecksum(nbytes, device)
    from . import triton_checksum  # imports triton (where it is) only when this needs it

    reason = triton_checksum.unusable(device)
    if not reason:
        return triton_checksum.TritonChecksum(nbytes, device)
    if kind == "triton":
        raise PackError(
            f"the Triton checksum cannot run on {device}: {reason}; use checksum 'torch' or "
            "'auto'"
        )
    return DeviceChecksum(nbytes, device)


def whole_buffer_plan(tensors: Sequence[torch.Tensor], checksum: str = "auto") -> WholeBufferPlan:
    """The torch fallback's whole-buffer plan of `tensors` on their own device, whatever the
    device, checksummed by `checksum` (`fallback_checksum`): what a GPU without the kernel
    runs, built on the host by benchmarks and tests that count or check it there
    (`bench.traffic`)."""
    device = _device_of(tensors)
    _check_tensors(tensors, device)
    nbytes = packed_nbytes(tensors)
    _check_size(nbytes)
    return _whole_buffer_plan(tensors, packed_offsets(tensors), nbytes, device, checksum)


def _whole_buffer_plan(
    tensors: Sequence[torch.Tensor],
    offsets: list[int],
    nbytes: int,
    device: torch.device,
    checksum: str = "auto",
) -> WholeBufferPlan:
    """The torch fallback's whole-buffer plan of `tensors` (for GPU memory; the tests also
    build it on the host to check it against the references)."""
    zeros = torch.zeros(ALIGN, dtype=torch.uint8, device=device)
    pieces = _pieces(tensors, offsets, nbytes)
    sources = [zeros[: p.stop - p.start] if p.data is None else p.data for p in pieces]
    copies = [(p.start, p.stop, p.data) for p in pieces if p.data is not None]
    summer = fallback_checksum(nbytes, device, checksum)
    return WholeBufferPlan(sources, copies, nbytes, device, checksum=summer)


_FALLBACK_ANNOUNCED = False


def _announce_fallback(plan: WholeBufferPlan, out: torch.Tensor, slot: torch.Tensor) -> None:
    """Once per process, on the first fallback pack on a GPU: pack once to warm up, time a
    second pack (CUDA events for the GPU, perf_counter for the host) and log the warning."""
    global _FALLBACK_ANNOUNCED
    _FALLBACK_ANNOUNCED = True
    plan.pack(out, slot)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    plan.pack(out, slot)
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    status = kernel_status(out.device)
    gpu_ms = start.elapsed_time(end)
    log.warning(fallback_message(status, plan.nbytes, gpu_ms, host_ms, plan.checksum.kind))


def fallback_message(
    status: KernelStatus, nbytes: int, gpu_ms: float, host_ms: float, checksum: str = ""
) -> str:
    """The warning a job logs when it packs GPU memory with the torch fallback (`checksum`:
    which checksum it runs, when said)."""
    how = f"; checksum: {checksum}" if checksum else ""
    return (
        f"deadpool: replication uses the torch fallback ({status.reason}{how}): a round of "
        f"{nbytes / 1e9:.2f} GB costs {gpu_ms:.1f} ms of GPU and {host_ms:.1f} ms of host "
        f"time; fix: {status.fix}"
    )


def _device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    return first.device if first is not None else torch.device("cpu")


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> int:
    """Copy `tensors` into `out` in the packed layout and return the region's checksum.

    `out` is a 1-D contiguous uint8 tensor on the tensors' device with at least
    `packed_nbytes(tensors)` elements; bytes beyond the packed region are left untouched.
    (One-off form of `PackPlan(tensors, out.device).pack(out)`.)
    """
    _check_flat(out, "out")
    return PackPlan(tensors, out.device).pack(out)


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> int:
    """Copy the packed bytes of `flat` back into the preallocated `tensors`.

    Returns the checksum of ``flat[:packed_nbytes(tensors)]`` computed in the same pass, so the
    caller can verify while restoring (the tensors are written either way).
    """
    _check_flat(flat, "flat")
    return PackPlan(tensors, flat.device).unpack(flat)


@plain_torch
def checksum(buf: torch.Tensor, *, one_core: bool = False) -> int:
    """The checksum (module docstring) of a 1-D uint8 buffer whose length is a multiple of 4.

    `one_core`: a host buffer is checksummed by the numpy backend on the calling thread alone,
    whatever its size - for checks that run beside the training or beside each other. The
    torch backend's thousands of small intra-op parallel regions start an OpenMP team of all
    cores, whose threads spin between regions: two processes' teams checking a 2 GiB replica
    each at once took 27 s and 220 s of CPU each on a 16-core GPU node (0.5 s with
    OMP_WAIT_POLICY=passive, 0.9-1.05 s with numpy on one core)."""
    _check_flat(buf, "checksum")
    if buf.numel() % WORD_BYTES:
        raise PackError(f"checksum buffer length {buf.numel()} B is not a multiple of 4")
    _check_size(buf.numel())
    backend = backend_for(buf, one_core=one_core)
    if backend == "cuda":
        ext = _extension()
        assert ext is not None
        slot = torch.zeros(1, dtype=torch.int64, device=buf.device)
        with torch.cuda.device(buf.device):
            ext.checksum(buf, slot, _stream(buf.device))
        return _cuda_checksum(slot)
    if buf.device.type == "cuda":  # the torch fallback on a GPU: whole-buffer ops
        slot = torch.zeros(1, dtype=torch.int64, device=buf.device)
        fallback_checksum(buf.numel(), buf.device).enqueue(buf, slot)
        return _cuda_checksum(slot)
    nwords = buf.numel() // WORD_BYTES
    acc = _accumulator(nwords, backend, buf.device)
    for start, stop in _chunk_bounds(nwords):
        acc.feed(start, buf[start * WORD_BYTES : stop * WORD_BYTES])
    return acc.result()


def checksum_bytes(data: bytes) -> int:
    """The checksum of a few bytes (a length a multiple of 4) in Python ints: for headers and
    other small records, where a tensor round trip would cost more than the arithmetic."""
    if len(data) % WORD_BYTES:
        raise PackError(f"checksum buffer length {len(data)} B is not a multiple of 4")
    words = struct.unpack(f"<{len(data) // WORD_BYTES}i", data)
    return sum((i + 1) * w for i, w in enumerate(words)) & _MASK64


# ---------------------------------------------------------------------------------------------
# Host and pure-torch backends


def _chunk_bounds(nwords: int) -> list[tuple[int, int]]:
    """Word ranges [start, stop) of the chunks of an `nwords`-word host buffer."""
    step = _chunk_rows() * _ROW_WORDS
    return [(start, min(start + step, nwords)) for start in range(0, nwords, step)]


def _accumulator(
    nwords: int, backend: str, device: torch.device
) -> _NumpyAccumulator | _TorchAccumulator:
    return _NumpyAccumulator() if backend == "numpy" else _TorchAccumulator(nwords, device)


class _NumpyAccumulator:
    """Exact checksum of host memory fed chunk by chunk, in order (uint64 numpy arithmetic)."""

    def __init__(self) -> None:
        self.total = 0

    def feed(self, start: int, chunk: torch.Tensor) -> None:
        """Account the bytes of `chunk` (uint8, a multiple of 4 long) that start at word `start`."""
        words = chunk.numpy().view(np.int32)  # numpy reads unaligned words as they are
        # int32 -> uint64 is sign extension mod 2**64; products and sums wrap mod 2**64.
        # einsum streams the products through small buffers: no temporary of the chunk's size.
        weights = _SCRATCH.weights(words.size)
        self.total += int(np.einsum("i,i->", words, weights, dtype=np.uint64, casting="unsafe"))
        if start:  # |sum of a chunk's words| <= 2**19 * 2**31: exact in int64
            self.total += start * int(words.sum(dtype=np.int64))

    def result(self) -> int:
        return self.total & _MASK64


class _Scratch(threading.local):
    """Per-thread reusable buffers (int64 rows, an aligned byte bounce buffer, row indices, and
    the host backend's uint64 weights)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}
        self.aranges: dict[tuple[int, torch.device], torch.Tensor] = {}
        self.host_weights = np.empty(0, dtype=np.uint64)

    def weights(self, n: int) -> np.ndarray:
        """The uint64 array [1, 2, ..., n] (grown as needed)."""
        if self.host_weights.size < n:
            self.host_weights = np.arange(1, n + 1, dtype=np.uint64)
        return self.host_weights[:n]

    def arange(self, n: int, device: torch.device) -> torch.Tensor:
        """The int64 tensor [0, 1, ..., n - 1] on `device` (cached)."""
        key = (n, device)
        if key not in self.aranges:
            self.aranges[key] = torch.arange(n, dtype=torch.int64, device=device)
        return self.aranges[key]

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, device, dtype)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel]


_SCRATCH = _Scratch()


def _chunk_rows() -> int:
    chunk = _CPU_CHUNK_BYTES
    rows = chunk // (WORD_BYTES * _ROW_WORDS)
    if not 1 <= rows <= _MAX_CHUNK_ROWS:
        raise AssertionError(f"chunk of {chunk} B gives {rows} rows; need 1..{_MAX_CHUNK_ROWS}")
    return rows


class _TorchAccumulator:
    """Exact checksum of a buffer of `nwords` words fed chunk by chunk, in order (torch ops,
    row and column sums)."""

    def __init__(self, nwords: int, device: torch.device) -> None:
        self.device = device
        self.nwords = nwords
        self.nrows = nwords // _ROW_WORDS
        self.chunk_rows = _chunk_rows()
        nchunks = -(-self.nrows // self.chunk_rows)
        self.rowsums = torch.empty(self.nrows, dtype=torch.int64, device=device)
        self.colsums = torch.empty(nchunks, _ROW_WORDS, dtype=torch.int64, device=device)
        rows = min(self.chunk_rows, self.nrows)
        self.wide = _SCRATCH.get("wide", rows * _ROW_WORDS, torch.int64, device)
        self.tail = 0

    def feed(self, start: int, chunk: torch.Tensor) -> None:
        """Account the bytes of `chunk` that start at word `start` (a chunk of `_chunk_bounds`)."""
        words = _as_words(chunk)
        row0 = start // _ROW_WORDS
        rows = min(words.numel() // _ROW_WORDS, self.nrows - row0)
        if rows:
            block = words[: rows * _ROW_WORDS].view(rows, _ROW_WORDS)
            wide = self.wide[: rows * _ROW_WORDS].view(rows, _ROW_WORDS)
            wide.copy_(block)  # widen while the chunk is in cache; both sums read it there
            torch.sum(wide, 1, out=self.rowsums[row0 : row0 + rows])
            torch.sum(wide, 0, out=self.colsums[row0 // self.chunk_rows])
        rest = words[rows * _ROW_WORDS :]
        if rest.numel():
            first = start + rows * _ROW_WORDS + 1
            values = rest.tolist()
            self.tail += sum((first + k) * w for k, w in enumerate(values))

    def result(self) -> int:
        """The checksum of everything fed so far (call once, after the last chunk)."""
        total = self.tail
        if self.nrows:
            total += self._rows_part() + self._columns_part()
        return total & _MASK64

    def _rows_part(self) -> int:
        # L * sum_g g * rowsum_g, with g = b * R + r: per chunk b, A_b = sum_r rowsum and
        # X_b = sum_r r * rowsum (both exact in int64, see the bounds above), then Python ints.
        per = self.chunk_rows
        nfull = self.nrows // per
        index = _SCRATCH.arange(per, self.device)
        sums: list[int] = []
        weighted: list[int] = []
        if nfull:
            full = self.rowsums[: nfull * per].view(nfull, per)
            sums += full.sum(1).tolist()
            weighted += (full * index).sum(1).tolist()
        last = self.rowsums[nfull * per :]
        if last.numel():
            sums.append(int(last.sum().item()))
            weighted.append(int((last * index[: last.numel()]).sum().item()))
        part = sum(b * per * a + x for b, (a, x) in enumerate(zip(sums, weighted)))
        return _ROW_WORDS * part

    def _columns_part(self) -> int:
        columns = self.colsums.sum(0).tolist()
        return sum((c + 1) * v for c, v in enumerate(columns))


def _as_words(chunk: torch.Tensor) -> torch.Tensor:
    """`chunk` (uint8, length a multiple of 4) as int32 words, via a bounce copy if misaligned."""
    if chunk.storage_offset() % WORD_BYTES == 0:
        return chunk.view(torch.int32)
    bounce = _SCRATCH.get("bounce", chunk.numel(), torch.uint8, chunk.device)
    bounce.copy_(chunk)
    return bounce.view(torch.int32)


@dataclass(frozen=True)
class _Piece:
    """Bytes [start, stop) of the packed region: a tensor's bytes, or zero padding if None."""

    start: int
    stop: int
    data: torch.Tensor | None


def _pieces(tensors: Sequence[torch.Tensor], offsets: list[int], total: int) -> list[_Piece]:
    pieces: list[_Piece] = []
    for tensor, offset, stop in zip(tensors, offsets, [*offsets[1:], total]):
        nbytes = _nbytes(tensor)
        if nbytes:
            pieces.append(_Piece(offset, offset + nbytes, tensor.reshape(-1).view(torch.uint8)))
        if stop > offset + nbytes:
            pieces.append(_Piece(offset + nbytes, stop, None))
    return pieces


def _overlapping(
    pieces: list[_Piece], lo: int, hi: int, cursor: int
) -> tuple[list[tuple[_Piece, int, int]], int]:
    """Pieces meeting bytes [lo, hi) as (piece, clip_start, clip_stop), from index `cursor`."""
    found = []
    while cursor < len(pieces) and pieces[cursor].stop <= lo:
        cursor += 1
    index = cursor
    while index < len(pieces) and pieces[index].start < hi:
        piece = pieces[index]
        found.append((piece, max(piece.start, lo), min(piece.stop, hi)))
        index += 1
    return found, cursor
