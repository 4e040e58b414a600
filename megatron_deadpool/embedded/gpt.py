"""Builds the embedded job's Megatron-Core objects: GPTModel, DDP, DistributedOptimizer, LR.

The same calls a Megatron-LM user's training makes (local layer spec - with experts the
decoder block spec of local MoE layers -, distributed optimizer - with experts a second one
over the expert data-parallel group, chained -, `OptimizerParamScheduler`), sized by
`JobConfig`. Also the one training step, through Megatron's `get_forward_backward_func()`, so
tensor, pipeline and expert parallelism run for real.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

from ..config.job import JobConfig
from ..devices.groups import tensor_device
from .data import iteration_batches


@dataclass
class TrainingObjects:
    """What a rank trains with; survivors keep these across a hot swap."""

    model: list[DistributedDataParallel]
    optimizer: Any  # MegatronOptimizer (a ChainedOptimizer or DistributedOptimizer)
    scheduler: OptimizerParamScheduler
    config: TransformerConfig


def transformer_config(job: JobConfig) -> TransformerConfig:
    m, p = job.model, job.parallel
    moe: dict[str, Any] = {}
    if m.num_experts is not None:  # Megatron-Core's local MoE layers, tokens sent all-to-all
        moe = {
            "num_moe_experts": m.num_experts,
            "moe_router_topk": m.moe_router_topk,
            "moe_ffn_hidden_size": m.moe_ffn,
            "moe_layer_freq": m.moe_layer_freq,
            "moe_token_dispatcher_type": "alltoall",
            "expert_model_parallel_size": p.ep,
            "expert_tensor_parallel_size": p.expert_tp,
            "add_bias_linear": False,  # core_v0.19.0's local experts add their bias in place
        }
    return TransformerConfig(
        **moe,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        init_method_std=0.02,
    )


def seed_rng(seed: int) -> None:
    """Megatron's RNG set-up (data-parallel and model-parallel tracker seeds)."""
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build(job: JobConfig) -> TrainingObjects:
    """Build model, DDP wrapper, distributed optimizer and LR scheduler on this rank.

    Requires `parallel_state` initialised. Issues the same collectives on every rank
    (`get_megatron_optimizer` aligns parameter-group keys with two world all-gathers).
    """
    cfg = transformer_config(job)
    seed_rng(job.train.seed)
    spec = (
        get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
        if cfg.num_moe_experts
        else get_gpt_layer_local_spec()
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=job.model.vocab_size,
        max_sequence_length=job.model.seq_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=True,
    )
    # Megatron-LM moves each model chunk to its GPU before wrapping it (training.py,
    # `get_model`): the parameters are initialised on the CPU (the same values on any device)
    # and every buffer follows them. In the CPU mode this is a no-op.
    model.cuda(torch.cuda.current_device())
    ddp = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=job.train.lr,
        min_lr=job.train.lr * 0.1,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        clip_grad=1.0,
        use_distributed_optimizer=True,
    )
    optimizer = get_megatron_optimizer(opt_cfg, [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=job.train.lr,
        min_lr=job.train.lr * 0.1,
        lr_warmup_steps=job.train.lr_warmup_iters,
        lr_decay_steps=max(job.train.iters, job.train.lr_warmup_iters + 1),
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=job.train.iters,
        wd_incr_style="constant",
    )
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = ddp.no_sync
    return TrainingObjects(
        model=[ddp],
        optimizer=optimizer,
        scheduler=scheduler,
        config=cfg,
    )


def _forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], None, labels=batch["labels"]
    )  # [b, s] per-token losses on the last stage, activations elsewhere
    return output, partial(_loss_func, batch["loss_mask"])


def _loss_func(loss_mask: torch.Tensor, per_token: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loss = (per_token.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


class StepResult(NamedTuple):
    """What every rank learns from one iteration (identical on all ranks)."""

    loss: float
    grad_norm: float
    stop: bool
    replicas_ok: bool | None = None
    """Every rank verified the replication round settled in this step (None: none was)."""


def train_step(
    job: JobConfig,
    objs: TrainingObjects,
    iteration: int,
    stop_vote: bool = False,
    settle: Callable[[], bool | None] | None = None,
) -> StepResult:
    """One iteration: forward/backward over the micro-batches, optimizer step, LR step.

    Returns the loss averaged over micro-batches and data-parallel ranks, the grad norm, and
    whether any rank voted to stop after this iteration (preemption), all agreed through one
    small world all-reduce that runs with and without DeadPool. `settle` (DeadPool's
    `Replicator.settle`, run after the optimizer step so the replication round in flight has
    had the whole step to arrive) gives this rank's verdict on the replicas it received; the
    verdicts ride on the same all-reduce and come back as `replicas_ok`.
    """
    t = job.train
    for chunk in objs.model:
        chunk.zero_grad_buffer()
    objs.optimizer.zero_grad()
    data = iteration_batches(
        seed=t.seed,
        iteration=iteration,
        dp_rank=ps.get_data_parallel_rank(),
        num_microbatches=t.num_microbatches,
        mbs=t.micro_batch_size,
        seq=job.model.seq_length,
        vocab=job.model.vocab_size,
        device=next(objs.model[0].parameters()).device,
    )
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=data,
        model=objs.model,
        num_microbatches=t.num_microbatches,
        seq_length=job.model.seq_length,
        micro_batch_size=t.micro_batch_size,
        forward_only=False,
    )
    _, grad_norm, _ = objs.optimizer.step()
    objs.scheduler.step(increment=1)
    contributes = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    settled = settle() if settle is not None else None
    total = torch.zeros(4, dtype=torch.float64, device=tensor_device())  # WORLD's device
    if contributes and losses:
        total[0] = torch.stack([x["lm loss"] for x in losses]).double().mean()
        total[1] = 1.0
    total[2] = float(stop_vote)
    total[3] = float(settled is False)
    torch.distributed.all_reduce(total)
    return StepResult(
        loss=float(total[0] / total[1]),
        grad_norm=float(grad_norm or 0.0),
        stop=bool(total[2] > 0),
        replicas_ok=None if settled is None else bool(total[3] == 0),
    )
