"""A stand-in CUDA runtime for a CPU machine: the per-thread current device and every call, with
the thread that made it and that thread's current device at the time.

The CUDA runtime keeps the current device per thread, and a new thread's is device 0; a call on
a thread whose current device is not the rank's creates (or uses) a context on that device.
`CudaStandIn.install()` replaces the parts of `torch.cuda` DeadPool's threads use - the device
(`current_device`, `set_device`, `device`), events, streams (the pool's `Stream`,
`ExternalStream`, `current_stream`, `stream`), `synchronize` - and makes `torch.version.cuda`
and the device count say CUDA is present, so that `devices.base.active_device()` answers CUDA.
Install it only in a process of its own (a test's subprocess): nothing is restored.

`in_own_process("module:function")` runs a scenario in such a process.

`runtime()` stands for ``libcudart`` (`devices.streams.cudart`): its
``cudaStreamCreateWithPriority`` hands out a fresh handle and records the call.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEVICES = 8
HERE = Path(__file__).resolve().parent
MARK = "SCENARIO-RESULT "


def in_own_process(target: str, timeout_s: float = 240.0) -> Any:
    """Run `target` ("module:function", a module of tests/devices) in a fresh interpreter (the
    stand-in replaces parts of `torch.cuda` for good; the CPU mode is for good too); its JSON
    result. The child is killed if it runs past `timeout_s`."""
    module, function = target.split(":")
    code = (
        f"import sys; sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent)!r}]\n"
        f"import json, {module} as t\n"
        f"print({MARK!r} + json.dumps(t.{function}()), flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(HERE.parents[1]))}
    env.pop("DEADPOOL_DEVICE", None)
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith(MARK)]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-5000:]
    return json.loads(lines[-1][len(MARK) :])


@dataclass(frozen=True)
class Call:
    """One call into the stand-in runtime."""

    name: str
    thread: str
    device: int
    """The calling thread's current device when it made the call."""
    detail: str = ""


class CudaStandIn:
    """The runtime: `calls` in the order made (module docstring)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._handles = 0x7000

    # ------------------------------------------------------------------ the runtime's state
    def current(self) -> int:
        return int(getattr(self._local, "device", 0))  # a new thread's current device is 0

    def record(self, name: str, detail: str = "") -> None:
        with self._lock:
            self.calls.append(Call(name, threading.current_thread().name, self.current(), detail))

    def set_device(self, device: Any) -> None:
        """`torch.cuda.set_device`: as c10/cuda/CUDAFunctions.cpp's `SetDevice`, which calls
        ``cudaSetDevice`` (recorded) only when the thread's current device differs."""
        index = device.index if isinstance(device, torch.device) else int(device)
        if not 0 <= index < DEVICES:
            raise RuntimeError(f"invalid device ordinal {index}")
        if index == self.current():  # c10::cuda::SetDevice: no cudaSetDevice then
            return
        self.record("cudaSetDevice", str(index))
        self._local.device = index

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        before = self.current()
        self.set_device(device)
        try:
            yield
        finally:
            self._local.device = before

    def runtime(self) -> Any:
        """``libcudart`` as `ctypes` would give it (only what `devices.streams` calls)."""
        standin = self

        class Runtime:
            def cudaStreamCreateWithPriority(self, out: Any, flags: int, priority: int) -> int:
                standin.record("cudaStreamCreateWithPriority", f"flags={flags} priority={priority}")
                standin._handles += 0x10
                out._obj.value = standin._handles  # `ctypes.byref(handle)` -> the handle
                return 0

        return Runtime()

    # ------------------------------------------------------------------ torch.cuda's surface
    def install(self) -> None:
        standin = self

        class Event:
            def __init__(self, *args: object, **kwargs: object) -> None:
                standin.record("cudaEventCreate")

            def record(self, stream: object = None) -> None:
                standin.record("cudaEventRecord")

            def query(self) -> bool:
                standin.record("cudaEventQuery")
                return True

            def synchronize(self) -> None:
                standin.record("cudaEventSynchronize")

            def wait(self, stream: object = None) -> None:
                standin.record("cudaStreamWaitEvent")

        class Stream:
            def __init__(self, device: object = None, priority: int = 0, **kwargs: Any) -> None:
                standin.record("getStreamFromPool", str(device))
                self.device = device

            def wait_stream(self, other: object) -> None:
                standin.record("cudaStreamWaitEvent")

            def wait_event(self, event: object) -> None:
                standin.record("cudaStreamWaitEvent")

            def synchronize(self) -> None:
                standin.record("cudaStreamSynchronize")

            def record_event(self, event: Any = None) -> Any:
                event = event or Event()
                event.record(self)
                return event

        class ExternalStream(Stream):
            def __init__(self, stream_ptr: int, device: object = None, **kwargs: Any) -> None:
                standin.record("ExternalStream", f"{stream_ptr:#x} {device}")
                self.device = device
                self.stream_ptr = stream_ptr

        default = Stream.__new__(Stream)
        cuda = torch.cuda
        torch.version.cuda = "12.8"  # type: ignore[misc]
        answers: dict[str, Any] = {
            "is_available": lambda: True,
            "device_count": lambda: DEVICES,
            "is_initialized": lambda: True,
            "current_device": self.current,
            "set_device": self.set_device,
            "device": self.device,
            "Event": Event,
            "Stream": Stream,
            "ExternalStream": ExternalStream,
            "current_stream": lambda device=None: default,
            "default_stream": lambda device=None: default,
            "stream": lambda stream=None: contextlib.nullcontext(),
            "synchronize": lambda device=None: self.record("cudaDeviceSynchronize"),
        }
        for name, value in answers.items():
            setattr(cuda, name, value)

    # ------------------------------------------------------------------ reading the record
    def off_device(self, device: int) -> list[Call]:
        """Calls made on a thread whose current device was not `device` (`cudaSetDevice` to
        `device` itself aside: that is how a thread selects it)."""
        return [
            c
            for c in self.calls
            if c.device != device and not (c.name == "cudaSetDevice" and c.detail == str(device))
        ]
