"""The replication side stream: a CUDA stream of DeadPool's own, outside torch's stream pool.

`torch.cuda.Stream()` does not create a stream: it hands out one of a fixed pool, round robin,
and so does every `ProcessGroupNCCL` for its collectives
(``at::cuda::getStreamFromPool(options_->is_high_priority_stream)``: the low-priority pool by
default). Read in pytorch/pytorch ``c10/cuda/CUDAStream.cpp`` (stored snapshot 8be3e9fa173c,
the torch 2.x layout): ``kStreamsPerPoolBits = 5``, ``kStreamsPerPool = 1 <<
kStreamsPerPoolBits`` - 32 streams per priority and device, all made at once by
`initDeviceStreamState` with ``cudaStreamCreateWithPriority(&stream, kDefaultFlags =
cudaStreamNonBlocking, -p)`` - and ``getStreamFromPool(priority, device)`` returns
``streams[pri_idx][device][get_idx(priority_counters[pri_idx][device])]``, ``get_idx`` being
``counter++ % kStreamsPerPool``. An external stream's id is its ``cudaStream_t`` itself
(`getStreamFromExternal`), never one of the pool's.

With ~30 process groups per generation the capture could share a stream with a group's
collectives: its waits (`wait_stream` on the step, the capture's kernels) would then delay them,
and theirs the capture.

`own_stream(device)` creates one stream per device with the CUDA runtime's
``cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, 0)`` - the flags and the
(default, lowest) priority of the pool's low-priority streams - and wraps it in
`torch.cuda.ExternalStream`. Torch's own binding is not enough: of the stream functions,
pytorch/pytorch ``torch/csrc/cuda/shared/cudart.cpp`` (stored snapshot 069f098621fa) binds
``cudaStreamCreate`` and ``cudaStreamDestroy`` only, and ``cudaStreamCreate`` makes a *blocking* stream, which
serialises with the legacy default stream that torch's default stream is: the capture would
wait for the training's kernels and they for it. So the runtime is called through `ctypes` on
the ``libcudart`` torch has loaded (found in ``/proc/self/maps``; else by its name for
torch's CUDA major version). The stream is kept for the process's life, one per device (a few
hundred bytes; a successor replicator reuses it); nothing is destroyed under a capture still
in flight.

In the CPU development mode `torch.cuda.Stream` is the no-op stand-in (`devices.cpu`), and
that is what `own_stream` returns there. Unverified without a GPU: that a GPU run picks the
loaded ``libcudart`` (a torch linked with a static runtime finds a separate copy by name; its
streams live in the same primary context). Where no ``libcudart`` can be loaded the stream
comes from torch's pool, with a warning that says so.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, DeadpoolRuntimeError
from . import cpu

log = logging.getLogger(__name__)

NON_BLOCKING = 0x01
"""``cudaStreamNonBlocking`` (``driver_types.h``): no implicit order with the legacy default
stream, as torch's pool streams."""
PRIORITY = 0
"""The stream's priority: 0, CUDA's default and torch's ``kLowPriority``."""

_OWN: dict[int, Any] = {}
_LOCK = threading.Lock()


def own_stream(device: torch.device) -> Any:
    """DeadPool's side stream on CUDA `device` (created once per device; module docstring); in
    the CPU development mode the no-op stand-in stream."""
    if device.type != "cuda":
        raise ConfigError(f"device: a side stream needs a CUDA device, got {device}")
    if cpu.is_active():
        return torch.cuda.Stream()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK:
        if index not in _OWN:
            _OWN[index] = _create(index)
        return _OWN[index]


def _create(index: int) -> Any:
    try:
        runtime = cudart()
    except OSError as exc:
        log.warning(
            "no CUDA runtime library to create DeadPool's own stream (%s): the replication "
            "stream comes from torch's pool and may be shared with a process group's",
            exc,
        )
        return torch.cuda.Stream(torch.device("cuda", index))
    handle = ctypes.c_void_p()
    with torch.cuda.device(index):
        error = runtime.cudaStreamCreateWithPriority(ctypes.byref(handle), NON_BLOCKING, PRIORITY)
    if error != 0 or not handle.value:
        raise DeadpoolRuntimeError(
            f"cudaStreamCreateWithPriority on cuda:{index} failed with CUDA error {error}: "
            "check the GPU with `nvidia-smi` and `deadpool selftest`"
        )
    return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index))


def cudart() -> Any:
    """The CUDA runtime library torch uses, through `ctypes` (the one loaded in this process,
    else the one named for torch's CUDA major version). Raises `OSError` when none loads."""
    for path in loaded_libraries("libcudart.so"):
        return ctypes.CDLL(path)
    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libcudart.so.{major}"] if major else []
    errors = []
    for name in [*names, "libcudart.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    raise OSError("; ".join(errors))


def loaded_libraries(prefix: str, maps: Path = Path("/proc/self/maps")) -> list[str]:
    """Paths of the shared libraries mapped into this process whose file name starts with
    `prefix` (Linux; empty elsewhere)."""
    try:
        text = maps.read_text()
    except OSError:
        return []
    found: list[str] = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        if path.startswith("/") and Path(path).name.startswith(prefix) and path not in found:
            found.append(path)
    return found
