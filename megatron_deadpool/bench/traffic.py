"""Memory traffic of torch ops, counted from the ops themselves: a structural figure, not a time.

A replication round on a GPU is memory-bound, so its GPU time follows the bytes its kernels read
and write. `measure` runs a function under a `TorchDispatchMode` that sees every aten op and
sums, per op:

* the bytes (``numel * element_size``) of each distinct tensor among its arguments (lists
  included) and results - an ``out=`` tensor once, an in-place op's tensor once;
* twice the bytes of every temporary the op allocates inside its own kernel and does not
  return (written once, read once): ``torch.sum(int32, dtype=int64)`` widens its whole input
  into such a temporary (ATen's ``make_reduction`` calls ``self.to(int64)``), which a count
  of arguments and results alone would miss. To see them the meter runs each op's kernel with
  itself still active (a redispatch to the backend key), so the op's internal calls come back
  through it; an internal allocation whose storage is not among the op's results is hidden.

Custom ops (a Triton kernel registered as ``deadpool::...``) count by their arguments and
results. Views and other metadata-only ops (``view``, ``slice``, ``as_strided``, ``empty``, ...) move
no bytes and are left out; every other op counts as one op (about one kernel launch; a hidden
temporary adds one more, the kernel that fills it). The counts depend only on the ops and the
shapes, so they are the same on every run and on any device: on CPU they measure what a GPU
would move, and a test can assert them. The reference is a plain ``copy_`` of the same N
bytes: 2N (read N, write N), one op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet
from torch.utils._python_dispatch import TorchDispatchMode

_NO_WORK = frozenset(
    {
        "aten::empty",
        "aten::empty_strided",
        "aten::empty_like",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::detach",
        "aten::alias",
        "aten::lift_fresh",
        "aten::resize_",
    }
)
"""Ops that allocate or relabel memory without moving bytes (views are found by schema)."""

_ALLOCATING = frozenset(
    {
        "aten::empty",
        "aten::empty_strided",
        "aten::empty_like",
        "aten::new_empty",
        "aten::new_empty_strided",
    }
)

_BACKEND_KEYS = {"cpu": DispatchKey.CPU, "cuda": DispatchKey.CUDA}


@dataclass
class Traffic:
    """What the ops of one call moved: `nbytes` in all, in `ops` ops (hidden temporaries'
    fill kernels included), `hidden_bytes` of it through temporaries no op returned; `by_op`
    maps an op's name to ``[count, bytes]``."""

    nbytes: int = 0
    ops: int = 0
    hidden_bytes: int = 0
    by_op: dict[str, list[int]] = field(default_factory=dict)

    def add(self, name: str, nbytes: int, kernels: int) -> None:
        """Count one op `name` that moved `nbytes` in `kernels` kernels."""
        self.nbytes += nbytes
        self.ops += kernels
        entry = self.by_op.setdefault(name, [0, 0])
        entry[0] += kernels
        entry[1] += nbytes


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _key(tensor: torch.Tensor) -> tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]:
    return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class TrafficMeter(TorchDispatchMode):
    """Counts the traffic of every aten op run under it into `traffic` (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.traffic = Traffic()
        self._depth = 0
        self._allocated: list[torch.Tensor] = []

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        if self._depth:  # inside an op's kernel: only its hidden allocations matter
            out = self._run(func, args, kwargs)
            if name in _ALLOCATING:
                self._allocated.extend(_tensors(out))
            return out
        self._allocated = []
        out = self._run(func, args, kwargs)
        if func.is_view or name in _NO_WORK:
            return out
        seen: dict[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]], int] = {}
        for tensor in (*_tensors(args), *_tensors(kwargs), *_tensors(out)):
            seen[_key(tensor)] = _nbytes(tensor)
        results = {_storage(t) for t in _tensors(out)} | {_storage(t) for t in _tensors(kwargs)}
        hidden = [t for t in self._allocated if _storage(t) not in results and t.numel()]
        hidden_bytes = sum(_nbytes(t) for t in hidden)
        self.traffic.hidden_bytes += 2 * hidden_bytes
        self.traffic.add(name, sum(seen.values()) + 2 * hidden_bytes, 1 + len(hidden))
        self._allocated = []
        return out

    def _run(self, func: torch._ops.OpOverload, args: Any, kwargs: dict[str, Any]) -> Any:
        """Run `func`'s kernel with this mode active again, so that the ops it calls come back
        here. Run unobserved inside: plain views (they allocate nothing, nor redispatch), ops
        on a device without a known backend key, and custom ops (another namespace than
        ``aten``: a Triton or CUDA kernel, whose traffic is its arguments and results - under
        Triton's interpreter its torch calls emulate the kernel, they are not its traffic)."""
        device = next((t.device.type for t in _tensors((args, kwargs))), None)
        if device is None:
            found = kwargs.get("device")
            device = torch.device(found).type if found is not None else "cpu"
        key = _BACKEND_KEYS.get(device)
        if key is None or (func.is_view and not _composite(func)) or func.namespace != "aten":
            return func(*args, **kwargs)
        self._depth += 1
        try:
            with self:
                return func.redispatch(DispatchKeySet(key), *args, **kwargs)
        finally:
            self._depth -= 1


def _composite(func: torch._ops.OpOverload) -> bool:
    """Whether `func` is made of other ops (``to``, ``reshape``: views that may copy)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


def measure(fn: Callable[[], Any]) -> Traffic:
    """The traffic of the aten ops `fn` runs (module docstring); its result is dropped."""
    meter = TrafficMeter()
    with torch.no_grad(), meter:
        fn()
    return meter.traffic
