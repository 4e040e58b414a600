"""Replica buffers: GPU memory, or page-locked host memory of exactly the size asked for.

torch's ``pin_memory=True`` takes host memory from its caching host allocator
(`CachingHostAllocator.h`), which rounds every block up to a power of two: a 9 GiB shard pins
16 GiB, times the 2 (k + 1) buffers of a rank, times the ranks of a node. Host replica buffers
are made here instead (`buffer`): anonymous memory mapped at the size asked for, rounded up to
whole pages only (`mmap`: zero-filled and page-aligned), page-locked with ``cudaHostRegister``
(through `torch.cuda.cudart()`, flag ``cudaHostRegisterPortable`` as torch's own
`torch.cuda._pin_memory_utils` does), and unregistered when the last tensor viewing it is
freed, before its pages are unmapped: a finalizer on the numpy array that owns the mapping,
which the tensor's storage keeps alive (`torch.from_numpy`). Whole pages, because two
registrations may not share one (``cudaErrorHostMemoryAlreadyRegistered``).

torch treats such memory as pinned: `Tensor.is_pinned()` asks ``cudaPointerGetAttributes``
(host memory registered with the driver is ``cudaMemoryTypeHost``), and a non-blocking copy
between it and the GPU is asynchronous. The CUDA calls themselves run only on a GPU; the
allocation path and the pairing of registration and unregistration are tested on the CPU
with a stand-in runtime.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import DeadpoolRuntimeError

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
PORTABLE = 1
"""``cudaHostRegisterPortable``: the memory counts as pinned in every CUDA context."""


def mapped_length(nbytes: int) -> int:
    """Bytes mapped for a buffer of `nbytes`: whole pages, at least one."""
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


def buffer(
    nbytes: int,
    device: torch.device,
    *,
    pinned: bool,
    runtime: Any | None = None,
    path: Path | None = None,
) -> torch.Tensor:
    """A zero-filled 1-D uint8 tensor of exactly `nbytes` on `device`: GPU memory, plain host
    memory, or (`pinned`) page-locked host memory of `nbytes` rounded up to whole pages.
    `runtime`: the CUDA runtime's Python binding (default `torch.cuda.cudart()`). `path`
    (host memory): a shared mapping of that file instead (created at the size, zero-filled,
    or mapped as it is when it has the size already): memory that outlives this process
    when the file is in a memory file system (`replication.segments`)."""
    if device.type != "cpu":
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    if not pinned and path is None:
        return torch.zeros(nbytes, dtype=torch.uint8)
    length = mapped_length(nbytes)
    array = np.frombuffer(_mapping(length, path), dtype=np.uint8)
    if not pinned:
        return torch.from_numpy(array)[:nbytes]
    pointer = int(array.ctypes.data)
    cudart = runtime if runtime is not None else torch.cuda.cudart()
    code = int(cudart.cudaHostRegister(pointer, length, PORTABLE))
    if code != 0:
        _forget_error(cudart)
        if path is None:
            raise DeadpoolRuntimeError(
                f"cudaHostRegister of {length} B of host memory for a replica failed (cudaError "
                f"{code}); free host memory, or keep replicas on the GPU "
                "(--deadpool-replica-device gpu)"
            )
        raise DeadpoolRuntimeError(
            f"cudaHostRegister of {length} B of the segment file {path} failed (cudaError "
            f"{code}): Linux page-locks shared mappings of files only on a memory file system "
            "(tmpfs, e.g. /dev/shm); put the node's segment folder (DEADPOOL_SEGMENTS) there, "
            "or keep replicas on the GPU (--deadpool-replica-device gpu)"
        )
    finalizer = weakref.finalize(array, _unregister, cudart, pointer, length)
    finalizer.atexit = False  # at exit the process's memory goes anyway; no CUDA call then
    return torch.from_numpy(array)[:nbytes]


def _mapping(length: int, path: Path | None) -> mmap.mmap:
    """`length` bytes of anonymous memory, or of the file `path` (made that long if it is not;
    its contents kept if it is)."""
    if path is None:
        return mmap.mmap(-1, length)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size != length:
            os.ftruncate(fd, 0)  # another size: another shard; start from zeros
            os.ftruncate(fd, length)
        return mmap.mmap(fd, length)
    finally:
        os.close(fd)  # the mapping keeps the file


def _forget_error(cudart: Any) -> None:
    """Read away the error of a failed registration: it stays the thread's last CUDA error,
    which torch's next kernel launch check reports as that kernel's own ("CUDA error: invalid
    argument" from an unrelated op, seen on an H100). torch's binding of the runtime has no
    ``cudaGetLastError``; the process's libcudart has."""
    get = getattr(cudart, "cudaGetLastError", None) or _process_cudart("cudaGetLastError")
    if get is None:
        log.warning("no cudaGetLastError found: the failed registration's error stays pending")
        return
    get()


def _process_cudart(name: str) -> Any:
    """Function `name` of the libcudart this process has loaded (torch's), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        where = line.split()[-1]
        if os.path.basename(where).startswith("libcudart.so"):
            return getattr(ctypes.CDLL(where), name, None)
    return None


def _unregister(cudart: Any, pointer: int, length: int) -> None:
    code = int(cudart.cudaHostUnregister(pointer))
    if code != 0:
        log.warning(
            "cudaHostUnregister of %d B at %#x failed (cudaError %d)", length, pointer, code
        )
