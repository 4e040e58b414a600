"""DeadPool's threads on the rank's GPU: every thread the project starts selects this process's
CUDA device before it runs anything.

The CUDA runtime keeps the current device per thread, and a new thread's is device 0. A thread
that calls the runtime without selecting a device - `cudaEventQuery` in the heartbeat's
`DeviceWatch`, `cudaEventSynchronize` on the poster of host replicas, an NCCL abort, freeing a
process group - creates a CUDA context on GPU 0 for every other rank of the node
(torchcomms#777: ~534 MiB each; rank 0 out of memory at 8 ranks per node). So every thread
DeadPool starts is started here and selects the rank's device first:

- `start_thread(target, *args, name=...)`: a daemon thread running `target(*args)`;
- `DeviceThread`: the base class of DeadPool's `threading.Thread` subclasses; the `run` of any
  subclass is wrapped at class creation so that it selects the device before its first line;
- `pool(workers, name)`: a `ThreadPoolExecutor` whose threads select it as they start;
- `select_rank_device()`: called again by long-lived threads before each piece of work they run
  (`DaemonWorker`'s calls, the heartbeat's after-beat checks, the store's call and wake-up
  threads), so that a thread started before
  the device was known (the Megatron-LM path connects and beats before Megatron selects the
  GPU) follows it once it is.

The rank's device is the one the process's `Device` names: `note_device` records it when
`devices.base.select_device` or `active_device` answers CUDA (the latter again after Megatron's
start-up selected the GPU). Until then, and always on a CPU-only process or in the CPU
development mode, nothing is selected and no `torch.cuda` function is called at all (a
launcher or coordinator process never initialises CUDA).

`device_threads()` reports, for each live thread started here, the device it selected (None:
none known yet) - what a GPU check reads after a round.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import ConfigError

_RANK: list[int] = []  # the rank's CUDA device index, once known
_LOCAL = threading.local()  # .index: the device this thread selected
_STARTED: weakref.WeakKeyDictionary[threading.Thread, int | None] = weakref.WeakKeyDictionary()
_REGISTRY = threading.Lock()


def note_device(index: int | None) -> None:
    """Record this process's CUDA device (`Device.index` of a CUDA `Device`); None: no CUDA
    device (nothing is selected from then on). Threads follow it at their next piece of work."""
    if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
        raise ConfigError(f"device index: expected a CUDA device index >= 0, got {index!r}")
    _RANK[:] = [] if index is None else [index]


def rank_device() -> int | None:
    """The CUDA device index recorded by `note_device`, None when none is."""
    return _RANK[0] if _RANK else None


def select_rank_device() -> int | None:
    """Make the rank's CUDA device current on the calling thread (once per thread and device:
    afterwards a dictionary lookup); returns its index, None where no device is known (then no
    `torch.cuda` function is called)."""
    index = rank_device()
    if index is not None and getattr(_LOCAL, "index", None) != index:
        import torch

        torch.cuda.set_device(index)
        _LOCAL.index = index
    me = threading.current_thread()
    with _REGISTRY:
        if me in _STARTED:
            _STARTED[me] = index
    return index


def _register(thread: threading.Thread) -> None:
    with _REGISTRY:
        _STARTED[thread] = None


def device_threads() -> dict[str, int | None]:
    """Name of each live thread DeadPool started -> the CUDA device index it selected (None: it
    selected none: no CUDA device was known when it last did). Threads sharing a name get
    ``#2``, ``#3``, ... after it, in no particular order."""
    with _REGISTRY:
        live = [(t.name, index) for t, index in _STARTED.items() if t.is_alive()]
    out: dict[str, int | None] = {}
    for name, index in sorted(live, key=lambda item: item[0]):
        key, n = name, 1
        while key in out:
            n += 1
            key = f"{name}#{n}"
        out[key] = index
    return out


def _on_rank_device(run: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(run)
    def wrapped(self: Any) -> None:
        select_rank_device()
        run(self)

    wrapped._selects_device = True  # type: ignore[attr-defined]
    return wrapped


class DeviceThread(threading.Thread):
    """A `threading.Thread` that selects the rank's device before its `run` (a subclass's `run`
    included: it is wrapped when the subclass is created) and is listed by `device_threads`."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        run = cls.__dict__.get("run")
        if run is not None and not getattr(run, "_selects_device", False):
            cls.run = _on_rank_device(run)  # type: ignore[method-assign,assignment]

    def start(self) -> None:
        _register(self)
        super().start()

    def run(self) -> None:
        select_rank_device()
        super().run()


def start_thread(
    target: Callable[..., object], *args: Any, name: str, daemon: bool = True
) -> DeviceThread:
    """Start `target(*args)` on a thread named `name` (a daemon unless told otherwise) that
    selects the rank's device first; returns the started thread."""
    thread = DeviceThread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def _pool_thread_started() -> None:
    _register(threading.current_thread())
    select_rank_device()


def pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool of up to `workers` threads named `name`_0, ... that select the rank's
    device as they start (use as a context manager, as `ThreadPoolExecutor`)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers: expected a thread count >= 1, got {workers!r}")
    return ThreadPoolExecutor(workers, name, initializer=_pool_thread_started)
