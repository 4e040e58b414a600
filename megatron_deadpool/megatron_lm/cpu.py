"""Megatron-LM's training scripts on a machine without a GPU: the CPU development mode.

`needs_cpu()` decides (no CUDA device, or `DEADPOOL_DEVICE=cpu`); `activate()` installs the
redirections of `devices.cpu` with `pretend_cuda=True` (Megatron-LM asserts CUDA), skips the
fused-kernel build (it probes nvcc) and turns torch.compile off (megatron-core's MoE is mended
for tensors in host memory by `devices.cpu` itself); `with_cpu_flags(argv)` adds
the Megatron flags a CPU run needs unless the user already gave them (see shared/CPU_MODE.md:
gloo, the local transformer implementation, CPU initialisation, no fusions).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

# (flag, value or None): added when the flag (or its opposite) is absent from the command line.
CPU_FLAGS: tuple[tuple[str, str | None], ...] = (
    ("--distributed-backend", "gloo"),
    ("--transformer-impl", "local"),
    ("--use-cpu-initialization", None),
    ("--no-gradient-accumulation-fusion", None),
    ("--no-masked-softmax-fusion", None),
    ("--no-bias-gelu-fusion", None),
    ("--no-bias-swiglu-fusion", None),
    ("--no-bias-dropout-fusion", None),
    ("--no-rope-fusion", None),
    ("--no-persist-layer-norm", None),
)


def needs_cpu() -> bool:
    """True when this process must run Megatron-LM in the CPU development mode."""
    forced = os.environ.get("DEADPOOL_DEVICE")
    if forced in ("cpu", "cuda"):
        return forced == "cpu"
    from ..devices.cpu import is_active

    if is_active():  # it answers CUDA questions with "yes" from now on
        return True
    import torch

    return not (torch.cuda.is_available() and torch.cuda.device_count() > 0)


def _given(argv: Sequence[str], flag: str) -> bool:
    stem = flag.removeprefix("--no-").removeprefix("--")
    names = {f"--{stem}", f"--no-{stem}"}
    return any(a in names or a.split("=", 1)[0] in names for a in argv)


def with_cpu_flags(argv: Sequence[str]) -> list[str]:
    """`argv` plus every CPU flag the user did not set (either way) themselves."""
    out = list(argv)
    for flag, value in CPU_FLAGS:
        if not _given(argv, flag):
            out += [flag] if value is None else [flag, value]
    return out


class _TritonStandIn:
    """Any attribute, call or decorator of the absent `triton`: decorators return the function
    unchanged, everything else another stand-in. Only module-level definitions ever touch it
    (Megatron's Triton kernels are for GPUs and never run in the CPU mode)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _TritonStandIn()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _TritonStandIn()


def _stand_in_for_triton() -> None:
    """Megatron-LM imports Triton kernel modules unconditionally (core_v0.16.1: in
    `megatron.training.initialize`; core_v0.19.0: already in `megatron.core`); CPU-only torch
    comes without Triton. The stand-in reports version 0.0.0, so that Megatron's guarded
    imports that check the version take their no-Triton paths."""
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stand_in = _TritonStandIn()
    for name in ("triton", "triton.language"):
        module = types.ModuleType(name)
        module.__getattr__ = stand_in.__getattr__  # type: ignore[method-assign]
        module.__deadpool_stand_in__ = True  # type: ignore[attr-defined]
        module.__version__ = "0.0.0"  # type: ignore[attr-defined]  # "too old": no kernels
        sys.modules[name] = module
    sys.modules["triton"].language = sys.modules["triton.language"]  # type: ignore[attr-defined]


def _load_before_the_first_step() -> None:
    """`--load` with the distributed optimizer and torch's Adam (no Apex/TE, as on CPU):
    Megatron builds the optimizer's checkpoint template before any step, and its
    `DistributedOptimizer.state_dict` then asserts that Adam's per-parameter states carry one
    'step' value - there are none yet. For that call alone, one state holds step 0 (the
    template's step is overwritten by the checkpoint's)."""
    import torch
    from megatron.core.optimizer import distrib_optimizer as dopt

    if dopt.HAVE_APEX_OR_TE or getattr(dopt.DistributedOptimizer.state_dict, "_deadpool", False):
        return
    real = dopt.DistributedOptimizer.state_dict

    def state_dict(self: Any) -> Any:
        inner = self.optimizer
        params = [p for group in inner.param_groups for p in group["params"]]
        if not params or any(inner.state.get(p) for p in params):
            return real(self)
        inner.state[params[0]]["step"] = torch.tensor(0.0)
        try:
            return real(self)
        finally:
            inner.state.pop(params[0], None)

    state_dict._deadpool = True  # type: ignore[attr-defined]
    dopt.DistributedOptimizer.state_dict = state_dict


class _DropMessage(logging.Filter):
    """Drops the records of one exact message."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


def _quiet_rng_fork_check() -> None:
    """core_v0.19.0's RNG tracker warns when the CPU generator changed inside a forked CUDA RNG
    state; in the CPU mode the CUDA generator *is* the CPU generator, so it warns on every
    fork (several lines per step and rank) about nothing."""
    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage("CPU RNG state changed within GPU RNG context"))


def activate() -> None:
    """Install the CPU mode in this process (idempotent); call before `pretrain()`."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    import torch._dynamo  # the script may have imported it before the variable was set

    torch._dynamo.config.disable = True
    # After torch._dynamo (torch decides on import that Triton is absent), before the first
    # import of megatron.core (core_v0.19.0 imports a Triton kernel module there).
    _stand_in_for_triton()
    from ..devices.cpu import activate as activate_cpu

    activate_cpu(pretend_cuda=True)
    _load_before_the_first_step()
    _quiet_rng_fork_check()
    try:
        from megatron.legacy import fused_kernels
    except ImportError:  # not a Megatron-LM tree: nothing to skip
        return
    fused_kernels.load = lambda args: None
