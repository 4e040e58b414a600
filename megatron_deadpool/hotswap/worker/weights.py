"""Model weights re-derived from the restored optimizer state (megatron-core DDP + optimizer).

A snapshot holds the fp32 main params, not the model's weights: after a rank restored its
shard (from its own snapshot or a holder's copy), the weights are copied from the main params
and, with the distributed optimizer, all-gathered over the data-parallel group, exactly as
megatron-core does after every optimizer step. A step that failed midway may have left
in-flight communication handles in DDP's bucket groups; they are dropped first. Answers the
optimizer computed once by a world collective and cached are dropped on every rank
(`forget_cached_collectives`): a newcomer's optimizer has none, and all ranks must issue the
same collectives at the next step.
"""

from __future__ import annotations

from typing import Any


def forget_inflight_communication(model: list[Any]) -> None:
    """Drop the grad-reduce and param-gather handles a failed step left in DDP's buckets."""
    for chunk in model:
        for bg in [
            *getattr(chunk, "bucket_groups", []),
            *getattr(chunk, "expert_parallel_bucket_groups", []),
        ]:
            for name in ("grad_reduce_handle", "param_gather_handle"):
                if hasattr(bg, name):
                    setattr(bg, name, None)
            if hasattr(bg, "param_gather_dispatched"):
                bg.param_gather_dispatched = False


def sync_params_from_main(model: list[Any], optimizer: Any) -> None:
    """Model weights from the (restored) main params: copy, then - with the distributed
    optimizer - the param all-gather over data-parallel peers."""
    forget_inflight_communication(model)
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in chained:
        if hasattr(opt, "_copy_main_params_to_model_params"):
            opt._copy_main_params_to_model_params()
    for chunk in model:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.use_distributed_optimizer:
            chunk.start_param_sync(force_sync=True)


def forget_cached_collectives(optimizer: Any) -> None:
    """Drop answers the optimizer computed once by a world collective and cached, so that every
    rank computes them again at the next step (a newcomer's objects have none yet, and ranks
    must issue the same collectives). megatron-core 0.19: `has_grad_norm_group` (an all-reduce
    on the first step); 0.16's optimizers cache nothing."""
    for opt in [optimizer, *(getattr(optimizer, "chained_optimizers", None) or [])]:
        if getattr(opt, "_has_grad_norm_group_cache", None) is not None:
            opt._has_grad_norm_group_cache = None
