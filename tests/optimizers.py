"""Shared by the snapshot and replication tests: small optimizers as Megatron's and TE's keep
their state, and the two Megatron interfaces a `RankState` uses, without Megatron.

- `GroupStepAdam`: AdamW as Transformer Engine's / apex's `FusedAdam` computes it, keeping
  ``step`` in ``param_groups[i]["step"]`` (an int) and optionally fp16 exp_avg behind TE's
  per-state scales (``optimizer._scales[p][name]``).
- `Wrapped`: what `snapshot.inner_optimizers` expects of a Megatron optimizer (`.optimizer`,
  `.grad_scaler`); `Chained`: Megatron's `ChainedOptimizer` (`.chained_optimizers`);
  `dynamic_grad_scaler()`: Megatron's own `DynamicGradScaler`, built on the CPU.
- `Scheduler`: the scheduler interface `RankState` uses (Megatron's `OptimizerParamScheduler`).
- `make_optimizer(kind, seed)` and `set_grads(params, step)`: reproducible parameters,
  optimizers ("torch-adam", "fused", "fused-fp16") and gradients; `stepped_state(seed)`: the
  `RankState` of a torch Adam after one step, what the replication tests' ranks replicate.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


class GroupStepAdam(torch.optim.Optimizer):
    """AdamW as TE's FusedAdam computes it (`multi_tensor_adam`, adam_w_mode=1), keeping the
    step per param group as an int, optionally with exp_avg in fp16 behind a per-state scale
    (TE's `_scales`, `set_scaled_state` / `get_unscaled_state`)."""

    def __init__(self, params: Any, lr: float = 1e-2, fp16_exp_avg: bool = False) -> None:
        super().__init__(
            params, {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
        )
        self.fp16_exp_avg = fp16_exp_avg
        self._scales: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def _exp_avg(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if not self.fp16_exp_avg:
            return state["exp_avg"]
        return state["exp_avg"].float() * self._scales[p]["exp_avg"]

    def _store_exp_avg(self, p: torch.Tensor, value: torch.Tensor) -> None:
        if not self.fp16_exp_avg:
            self.state[p]["exp_avg"].copy_(value)
            return
        scale = self._scales[p]["exp_avg"]
        torch.div(value.abs().max().reshape(1), 32000.0, out=scale)
        scale.clamp_(min=1e-30)
        self.state[p]["exp_avg"].copy_((value / scale).half())

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            bc1 = 1 - beta1 ** group["step"]
            bc2 = 1 - beta2 ** group["step"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    dtype = torch.float16 if self.fp16_exp_avg else torch.float32
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    if self.fp16_exp_avg:
                        self._scales[p] = {"exp_avg": torch.ones(1)}
                m = self._exp_avg(p).mul(beta1).add_(p.grad, alpha=1 - beta1)
                self._store_exp_avg(p, m)
                v = state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (v / bc2).sqrt_().add_(group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m / bc1, denom, value=-group["lr"])


class Wrapped:
    """What `snapshot.inner_optimizers` expects of a Megatron optimizer: `.optimizer`, and
    Megatron's loss scaler (`grad_scaler`, None without one)."""

    def __init__(self, opt: torch.optim.Optimizer, grad_scaler: Any = None) -> None:
        self.optimizer = opt
        self.param_groups = opt.param_groups
        self.grad_scaler = grad_scaler


class Chained:
    """Megatron's `ChainedOptimizer` as a snapshot sees it: `chained_optimizers`."""

    def __init__(self, *optimizers: Wrapped) -> None:
        self.chained_optimizers = list(optimizers)


def dynamic_grad_scaler(initial_scale: float = 2.0**20, window: int = 2) -> Any:
    """Megatron's own `DynamicGradScaler` (hysteresis 2, growth and backoff 2), built on the CPU
    (it places its tensors with ``device='cuda'``: the CPU mode's redirection, for its
    construction only). Its module is loaded from its file: it imports only torch, while
    importing it by name imports all of `megatron.core.optimizer` (~20 s on 2 busy cores)."""
    import importlib.util

    from megatron_deadpool.devices.cpu import _CudaToCpu

    spec = importlib.util.find_spec("megatron.core")
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0]) / "optimizer" / "grad_scaler.py"
    module_spec = importlib.util.spec_from_file_location("megatron_grad_scaler", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    with _CudaToCpu():
        return module.DynamicGradScaler(
            initial_scale=initial_scale,
            min_scale=1.0,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=window,
            hysteresis=2,
        )


class Scheduler:
    """The scheduler interface `RankState` uses (Megatron's `OptimizerParamScheduler`)."""

    def __init__(self) -> None:
        self.num_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_steps += state["num_steps"]


def make_params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(5, 3, generator=gen)),
        torch.nn.Parameter(torch.randn(7, generator=gen)),
    ]


def set_grads(params: Sequence[torch.Tensor], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def make_optimizer(kind: str, seed: int) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    params = make_params(seed)
    if kind == "torch-adam":
        return params, torch.optim.Adam(params, lr=1e-2)
    return params, GroupStepAdam(params, fp16_exp_avg=kind == "fused-fp16")


def stepped_state(seed: int) -> Any:
    """The `RankState` (with `Scheduler`) of a "torch-adam" optimizer after one step: Adam's
    state exists, as a rank's does once it replicates."""
    from megatron_deadpool.replication.snapshot import RankState

    params, opt = make_optimizer("torch-adam", seed=seed)
    set_grads(params, 0)
    opt.step()
    return RankState(Wrapped(opt), Scheduler())
