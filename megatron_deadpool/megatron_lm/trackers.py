"""Megatron's per-step logging trackers, emptied where a recovery would leave them wrong.

The MoE auxiliary-loss tracker (`moe_utils.clear_aux_losses_tracker`), the multi-token
prediction and DSA indexer loss trackers collect values during a step's forward passes; the
step's `training_log` reads and empties them. They hold no training state (the model does not
read them), but what `training_log` prints must be the failure-free run's: a step cut short by
a failure leaves its partial values in them, and the steps a recovery recomputes are never
logged. So they are emptied after a restore and after each recomputed step, and the step that
is logged next reports only its own values.

The MoE tracker also keeps process-group handles outside `parallel_state` (each entry's
`reduce_group` and `avg_group`, set by the router in every forward pass): `tracker_roots`
names it, so that a recovery rebinds those handles with every other (`hotswap/worker/rebind.py`)
instead of leaving a released group referenced until the next forward pass.
"""

from __future__ import annotations

import importlib
from typing import Any

_CLEANERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # (module, object in it or "", method names across releases)
    ("megatron.core.transformer.moe.moe_utils", "", ("clear_aux_losses_tracker",)),
    (
        "megatron.core.transformer.multi_token_prediction",
        "MTPLossLoggingHelper",
        ("clean_metrics_in_tracker", "clean_loss_in_tracker"),
    ),
    (
        "megatron.core.transformer.experimental_attention_variant.dsa",
        "DSAIndexerLossLoggingHelper",
        ("clean_loss_in_tracker",),
    ),
)


def clear_logging_trackers() -> None:
    """Empty every per-step logging tracker this Megatron release has."""
    for module_name, owner, names in _CLEANERS:
        try:
            where: Any = importlib.import_module(module_name)
        except ImportError:  # a release without it
            continue
        if owner:
            where = getattr(where, owner, None)
            if not getattr(where, "tracker", None):  # nothing tracked yet (its cleaner would
                continue  # fail on the missing keys in core_v0.16.1)
        for name in names:
            clean = getattr(where, name, None)
            if callable(clean):
                clean()
                break


_HOLDERS: tuple[tuple[str, str], ...] = (
    # (module, global): the MoE tracker in core_v0.16.1 (a dict of dicts) and core_v0.19.0
    ("megatron.core.transformer.moe.moe_utils", "_MOE_LAYER_WISE_LOGGING_TRACKER"),
    ("megatron.core.transformer.moe.moe_logging", "_MOE_METRICS_TRACKER"),
)


def tracker_roots() -> list[Any]:
    """The logging trackers of this Megatron release that exist now and may hold process-group
    handles: roots for `hotswap/worker/rebind.py` (the trackers are module globals no model, DDP or
    optimizer object leads to)."""
    out = []
    for module_name, name in _HOLDERS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a release without it
            continue
        value = getattr(module, name, None)
        if value is not None:
            out.append(value)
    return out
