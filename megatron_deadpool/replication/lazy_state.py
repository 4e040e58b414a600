"""Optimizer state that a skipped first step has not created yet, made as that step would.

A snapshot's layout - which tensors it holds - is fixed when its `Snapshotter` is built, after
the first optimizer step (`snapshot.py`). Optimizers create their per-parameter state lazily, in
their first `step()`. Under FP16 Megatron skips the inner optimizer's step while the loss
scaler still overflows (`MixedPrecisionOptimizer.step`: `prepare_grads` finds inf, returns
before `self.optimizer.step()`), and with Megatron's default initial scale (2^32) the first
several steps are skipped: the layout would be fixed without Adam's ``exp_avg``,
``exp_avg_sq`` and ``step``, and a rollback or a newcomer after the first real step would miss
them.

So before the layout is fixed, `create_lazy_state` gives every parameter without state the
state its optimizer's first step would create - the same tensors with the same values, so the
step that later finds them computes exactly what it would have computed from its own:

- torch `Adam` / `AdamW` (Megatron's choice without TE and apex; read in torch 2.13's
  `Adam._init_group`): ``step`` a 0-dim tensor of `_get_scalar_dtype` (on the parameter's
  device if ``capturable`` or ``fused``, else on the CPU), ``exp_avg`` and ``exp_avg_sq`` (and
  ``max_exp_avg_sq`` under ``amsgrad``) zeros like the parameter;
- Transformer Engine's `FusedAdam` (its `step` calls ``self.initialize_state(p,
  store_param_remainders)`` for a parameter without state, with
  ``store_param_remainders = self.store_param_remainders and p.dtype == torch.bfloat16``):
  the same call. Not run here (no Transformer Engine on these machines).

Any other optimizer is left as it is; `LazyStateWatch` then notices state that appears after
the layout was fixed and refuses to go on with a snapshot that would miss it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..errors import ConfigError


def create_lazy_state(opt: torch.optim.Optimizer) -> None:
    """Give every parameter of `opt` without state the state `opt`'s first step would create
    (torch Adam/AdamW, TE FusedAdam); other optimizers are left as they are."""
    empty = [p for group in opt.param_groups for p in group["params"] if not opt.state.get(p)]
    if not empty:
        return
    if isinstance(opt, torch.optim.Adam):
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state.get(p):
                    opt.state[p].update(_torch_adam_state(group, p))
        return
    initialize = getattr(opt, "initialize_state", None)  # Transformer Engine's FusedAdam
    if callable(initialize) and hasattr(opt, "store_param_remainders"):
        two_args = len(inspect.signature(initialize).parameters) >= 2
        for p in empty:
            if two_args:
                remainders = bool(opt.store_param_remainders) and p.dtype == torch.bfloat16
                initialize(p, remainders)
            else:
                initialize(p)


def _torch_adam_state(group: dict[str, Any], p: torch.Tensor) -> dict[str, torch.Tensor]:
    """What torch `Adam._init_group` creates for `p` (torch 2.13)."""
    from torch.optim.optimizer import _get_scalar_dtype

    if group.get("capturable") or group.get("fused"):
        step = torch.zeros(
            (), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=p.device
        )
    else:
        step = torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
    state = {
        "step": step,
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


class LazyStateWatch:
    """The parameters that had no optimizer state when a snapshot layout was fixed; `check`
    refuses to capture once one of them has some (the layout would miss it)."""

    def __init__(self, opts: list[torch.optim.Optimizer]) -> None:
        self._empty = [
            (opt, p)
            for opt in opts
            for group in opt.param_groups
            for p in group["params"]
            if not opt.state.get(p)
        ]

    def check(self) -> None:
        """Raise `ConfigError` when state appeared after the layout was fixed (cheap: it looks
        only at the parameters that had none, usually none at all)."""
        for opt, p in self._empty:
            if opt.state.get(p):
                raise ConfigError(
                    f"{type(opt).__name__} created optimizer state after DeadPool fixed the "
                    "snapshot layout (its first steps were skipped, e.g. an FP16 loss-scale "
                    "overflow): DeadPool creates that state up front for torch Adam/AdamW and "
                    "Transformer Engine's FusedAdam only; use one of them, or an initial loss "
                    "scale (--initial-loss-scale) whose first step does not overflow"
                )
