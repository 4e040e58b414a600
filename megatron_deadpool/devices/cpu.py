"""CPU development mode: redirect Megatron-Core's CUDA assumptions onto the CPU.

Real megatron-core (GPTModel, DDP, DistributedOptimizer, parallel_state) then runs on CPU
with gloo, unmodified. Activated once per process, and only when no GPU is used (see
`devices.base.select_device`). What is redirected and why (all verified on
megatron-core 0.16.1, see shared/CPU_MODE.md):

- `torch.cuda.current_device()` is used as a `device=` argument: it answers the CPU device.
- Factory calls with `device='cuda'` (e.g. `torch.tensor([0], device='cuda')` in the
  optimizer): a `TorchFunctionMode` rewrites any CUDA `device=` to CPU; `Tensor.cuda()`
  returns the tensor itself.
- Streams, events and `synchronize()` are no-ops: CPU work is already ordered.
- `Tensor.type()` without arguments reports the CUDA type names that `distrib_optimizer.py`
  compares against ('torch.cuda.FloatTensor').
- The CUDA RNG functions Megatron's RNG tracker calls act on the CPU generator.
- megatron-core's MoE layers work on tensors in host memory (`_mend_moe`).
- With `pretend_cuda=True` (Megatron-LM's training scripts assert CUDA), `is_available()`,
  device counts/properties, memory statistics and NVTX get CPU answers too, and
  `torch.accelerator` answers "none" as in a CPU-only build of torch (on a CUDA build without a
  GPU, e.g. PyPI's torch for Python 3.12, the DataLoader would otherwise pin memory).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, ParamSpec, Self, TypeVar

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE: dict[str, Any] = {}
_CUDA_TYPES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}
_CPU = torch.device("cpu")
P = ParamSpec("P")
R = TypeVar("R")


def _is_cuda(dev: object) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


def plain_torch(fn: Callable[P, R]) -> Callable[P, R]:
    """Run `fn` without torch-function modes (`activate` installs one): for hot paths whose
    many small torch calls would each pay the mode's Python hook and that create no tensor on
    a device needing redirection."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)

    return wrapper


class _CudaToCpu(TorchFunctionMode):
    """Rewrites `device='cuda'` (and `.to('cuda')`) in every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func in (torch.Tensor.to, torch.Tensor.new_tensor) and args:
            args = tuple(_CPU if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


class _NullStream:
    """A CUDA stream stand-in: ordering on CPU is program order."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: object = None) -> _NullEvent:
        return _NullEvent()

    def query(self) -> bool:
        return True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _NullEvent:
    """A CUDA event stand-in."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: object) -> float:
        return 0.0


_NULL_STREAM = _NullStream()


def _tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if args or kwargs:
        return _ACTIVE["Tensor.type"](self, *args, **kwargs)
    name = _ACTIVE["Tensor.type"](self)
    return _CUDA_TYPES.get(name, name)


def _set(obj: Any, name: str, value: Any) -> None:
    key = f"{getattr(obj, '__name__', type(obj).__name__)}.{name}"
    _ACTIVE.setdefault(key, getattr(obj, name, None))
    setattr(obj, name, value)


def _noop_fn() -> Callable[..., None]:
    """A fresh no-op: torch._dynamo rejects one function object standing in for several."""

    def noop(*args: object, **kwargs: object) -> None:
        return None

    return noop


def activate(pretend_cuda: bool = False) -> None:
    """Install the redirections in this process (idempotent)."""
    if "mode" not in _ACTIVE:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        # Megatron's jit fusers call torch.compile, which cannot trace a faked CUDA.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        cuda = torch.cuda
        _ACTIVE["Tensor.type"] = torch.Tensor.type
        torch.Tensor.type = _tensor_type  # type: ignore[method-assign,assignment]
        _set(torch.Tensor, "cuda", lambda self, *a, **k: self)
        _set(cuda, "current_device", lambda: _CPU)
        _set(cuda, "Stream", _NullStream)
        _set(cuda, "Event", _NullEvent)
        _set(cuda, "stream", lambda s=None: contextlib.nullcontext())
        _set(cuda, "current_stream", lambda device=None: _NULL_STREAM)
        _set(cuda, "default_stream", lambda device=None: _NULL_STREAM)
        _set(cuda, "synchronize", _noop_fn())
        # torch.manual_seed itself calls cuda.manual_seed_all: seed the CPU generator directly.
        _set(cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
        _set(cuda, "manual_seed_all", _noop_fn())
        _set(cuda, "get_rng_state", lambda device=None: torch.get_rng_state())
        _set(cuda, "set_rng_state", lambda state, device=None: torch.set_rng_state(state))
        _set(cuda.random, "get_rng_state", lambda device=None: torch.get_rng_state())
        _set(cuda.random, "set_rng_state", lambda state, device=None: torch.set_rng_state(state))
        _redirect_megatron_rng()
        _mend_moe()
        mode = _CudaToCpu()
        mode.__enter__()
        _ACTIVE["mode"] = mode
    if pretend_cuda and "pretend" not in _ACTIVE:
        _pretend_cuda()
        _ACTIVE["pretend"] = True


def _mend_moe() -> None:
    """megatron-core's MoE layers on CPU (shared/CPU_MODE.md, "MoE, FP16, VPP and CP on CPU"):

    - core_v0.16.1's `moe_utils` names `te_general_gemm` in the router's gating without
      defining it when Transformer Engine is absent (NameError; core_v0.19.0 sets it to None):
      it is defined as None, which takes the torch path.
    - `maybe_move_tensor_to_cpu(..., as_numpy=True)` turns split sizes into numpy only for
      CUDA tensors, so the all-to-all dispatcher would hand CPU tensors to
      `all_to_all_single` as split sizes (TypeError): CPU tensors become numpy too.
    """
    try:
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    except ImportError:  # not a Megatron tree with MoE
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    real = moe_utils.maybe_move_tensor_to_cpu
    if getattr(real, "_deadpool", False):
        return

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, **kwargs: Any) -> Any:
        out = real(tensor, as_numpy=as_numpy, **kwargs)
        if as_numpy and torch.is_tensor(out) and out.device.type == "cpu":
            return out.numpy()
        return out

    maybe_move_tensor_to_cpu._deadpool = True  # type: ignore[attr-defined]
    for module in (moe_utils, token_dispatcher):
        if getattr(module, "maybe_move_tensor_to_cpu", None) is real:
            module.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _redirect_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: object = None, clone: bool = False, graph_safe: bool = False) -> Any:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    _set(mrandom, "_get_cuda_rng_state", get_state)
    _set(mrandom, "_set_cuda_rng_state", set_state)


def _pretend_cuda() -> None:
    """Answers for Megatron-LM's training scripts, which insist on seeing a GPU."""
    cuda = torch.cuda
    props = SimpleNamespace(
        name="CPU (deadpool development mode)",
        total_memory=64 << 30,
        major=8,
        minor=0,
        multi_processor_count=1,
    )
    zero: Callable[..., int] = lambda *a, **k: 0
    answers: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "set_device": _noop_fn(),
        "get_device_properties": lambda *a, **k: props,
        "get_device_capability": lambda *a, **k: (8, 0),
        "get_device_name": lambda *a, **k: props.name,
        "memory_allocated": zero,
        "memory_reserved": zero,
        "max_memory_allocated": zero,
        "max_memory_reserved": zero,
        "memory_stats": lambda *a, **k: {},
        "mem_get_info": lambda *a, **k: (props.total_memory, props.total_memory),
        "reset_peak_memory_stats": _noop_fn(),
        "reset_max_memory_allocated": _noop_fn(),
        "empty_cache": _noop_fn(),
        "is_initialized": lambda: True,
    }
    for name, value in answers.items():
        _set(cuda, name, value)
    # torch's device-generic layer asks `torch.cuda.is_available()` (answered True above) when
    # torch is a CUDA build (PyPI's for Python 3.12 is one, even on a machine without a GPU):
    # the DataLoader would then pin memory, initialising CUDA ("driver version is
    # insufficient"). It answers as a CPU-only build of torch does: no accelerator.
    _set(torch.accelerator, "is_available", lambda: False)
    _set(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    _set(torch.accelerator, "device_count", zero)
    _set(cuda.nvtx, "range_push", _noop_fn())
    _set(cuda.nvtx, "range_pop", _noop_fn())


def is_active() -> bool:
    """True once `activate()` ran in this process."""
    return "mode" in _ACTIVE
