"""Exact parameter counts of a Megatron-Core `GPTModel`, whole and per (pipeline stage, TP rank).

Pure arithmetic over `ModelConfig`'s dimensions, matching the tensors Megatron-Core builds with
its local layer spec (checked against a real `GPTModel` in the tests):

- embedding: word embeddings `V x h` (split over TP along the vocabulary; V padded to a
  multiple of TP as the embedded job does - Megatron-LM pads further to 128 x TP, < 0.1% more
  for the paper's models) plus, for learned absolute positions, `seq x h` (not split);
- per layer: input norm; QKV `h x (heads + 2 groups) x head_dim` (+ bias), column-parallel;
  output projection `h x h` (+ bias h, replicated), row-parallel; pre-MLP norm; MLP fc1
  `h x ffn` (x2 gated for SwiGLU, + bias) column-parallel and fc2 `ffn x h` (+ bias h,
  replicated) row-parallel; a norm is `2h` (LayerNorm) or `h` (RMSNorm), replicated;
- final norm on the last stage; output layer `V x h` (split over TP) on the last stage when
  embeddings are untied - or, tied, as the last stage's copy of the embedding when pp > 1.
- mixture of experts (`model.num_experts` E, an MoE layer every `moe_layer_freq` layers): an
  MoE layer has the same norms and attention, a router `E x h` (+ bias E; `TopKRouter`, not
  split) and, instead of the MLP, E experts - each an MLP of hidden size `moe_ffn` split over
  the expert-tensor-parallel size etp (`SequentialMLP` of `MLP(is_expert=True)`, whose linear
  layers use the expert TP group) - of which one rank holds E / ep (`MoELayer`:
  `num_local_experts = num_moe_experts // ep_size`).

Dense and expert parameters live in different buffers: Megatron-Core's linear layers mark an
expert weight `allreduce=False` when ep > 1 (`tensor_parallel/layers.py`, `ColumnParallelLinear`
and `RowParallelLinear`: `not (is_expert and expert_parallel)`), and `DistributedDataParallel`
puts those into `expert_parallel_buffers` over the expert data-parallel group
(`intra_expt_dp_group`), the rest into `buffers` over the data-parallel group. With ep = 1 the
experts are ordinary parameters of the dense buffer. `stage_tensors` / `stage_expert_tensors`
follow that split.

`total` counts each distinct parameter once (a tied output layer is the embedding); `active`
the parameters one token passes through (top-k of the E experts per MoE layer), which sizes the
FLOPs.
`per_stage[s]` is what one TP rank of pipeline stage s holds, copies included, and
`buffer_numel` the size of Megatron's param/grad buffer for it (with the distributed
optimizer's alignment padding): the figure that sizes weights, gradients and the optimizer
shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.job import ModelConfig

PARAM_ALIGN = 64
"""Megatron's distributed optimizer starts every parameter at a multiple of 64 elements."""

BUCKET_ALIGN = 128
"""... and pads the buffer's end to a multiple of lcm(dp, 128) elements, for even shards."""


@dataclass(frozen=True, kw_only=True)
class ParamCount:
    """Parameters of a model, whole and per pipeline stage for one (tensor, expert) rank."""

    total: int
    """Distinct parameters of the whole model (vocabulary unpadded, tied weights once)."""

    active: int
    """Parameters one token is computed with: `total` less the experts it is not routed to."""

    stage_tensors: tuple[tuple[int, ...], ...]
    """stage_tensors[s]: element counts of the dense-buffer tensors one rank of stage s holds."""

    stage_expert_tensors: tuple[tuple[int, ...], ...] = ()
    """stage_expert_tensors[s]: ... of its expert-buffer tensors (empty without ep > 1)."""

    @property
    def per_stage_expert(self) -> tuple[int, ...]:
        """per_stage_expert[s]: expert-buffer parameters one rank of stage s holds."""
        if not self.stage_expert_tensors:
            return tuple(0 for _ in self.stage_tensors)
        return tuple(sum(t) for t in self.stage_expert_tensors)

    @property
    def per_stage(self) -> tuple[int, ...]:
        """per_stage[s]: parameters one rank of pipeline stage s holds (both buffers)."""
        return tuple(sum(t) + e for t, e in zip(self.stage_tensors, self.per_stage_expert))

    @property
    def max_stage(self) -> int:
        """The stage whose ranks hold the most parameters (the first one on ties)."""
        sizes = self.per_stage
        return max(range(len(sizes)), key=lambda s: (sizes[s], -s))

    @property
    def per_gpu(self) -> int:
        """The largest per-rank count over stages: what sizes per-GPU memory."""
        return self.per_stage[self.max_stage]

    def buffer_numel(self, stage: int, dp: int) -> int:
        """Elements of Megatron's (dense) param/grad buffer on `stage` with the distributed
        optimizer over `dp` ranks: each tensor starts 64-aligned, the end is padded to
        lcm(dp, 128). (One bucket; Megatron-LM's ~40M-element buckets each pad their end the
        same way, under 128 x dp elements per bucket more.)"""
        return _buffer(self.stage_tensors[stage], dp)

    def expert_buffer_numel(self, stage: int, expert_dp: int) -> int:
        """Elements of the expert param/grad buffer on `stage`, sharded over the `expert_dp`
        ranks of the expert data-parallel group (0 without one)."""
        if not self.stage_expert_tensors or not self.stage_expert_tensors[stage]:
            return 0
        return _buffer(self.stage_expert_tensors[stage], expert_dp)


def _buffer(tensors: tuple[int, ...], dp: int) -> int:
    aligned = sum(_round_up(n, PARAM_ALIGN) for n in tensors)
    return _round_up(aligned, math.lcm(dp, BUCKET_ALIGN))


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of `tp` (rows of the split embedding)."""
    return _round_up(vocab_size, tp)


def _norm(model: ModelConfig) -> list[int]:
    h = model.hidden_size
    return [h, h] if model.normalization == "LayerNorm" else [h]


def attention_tensors(model: ModelConfig, tp: int = 1) -> list[int]:
    """A layer's input norm and attention, held by one of `tp` TP ranks."""
    h = model.hidden_size
    head_dim = h // model.num_attention_heads
    qkv_out = (model.num_attention_heads + 2 * model.query_groups) * head_dim
    out = [*_norm(model), h * qkv_out // tp, model.num_attention_heads * head_dim * h // tp]
    if model.add_bias_linear:  # column-parallel bias split, row-parallel one replicated
        out += [qkv_out // tp, h]
    return out


def mlp_tensors(model: ModelConfig, ffn: int, tp: int = 1) -> list[int]:
    """An MLP of hidden size `ffn` (fc1 column-, fc2 row-parallel) on one of `tp` TP ranks."""
    h = model.hidden_size
    fc1_out = 2 * ffn if model.swiglu else ffn
    out = [h * fc1_out // tp, ffn * h // tp]
    if model.add_bias_linear:
        out += [fc1_out // tp, h]
    return out


def layer_tensors(model: ModelConfig, tp: int = 1) -> list[int]:
    """Element counts of one dense transformer layer's tensors held by one of `tp` TP ranks."""
    return attention_tensors(model, tp) + _norm(model) + mlp_tensors(model, model.ffn, tp)


def moe_dense_tensors(model: ModelConfig, tp: int = 1) -> list[int]:
    """An MoE layer's non-expert tensors on one of `tp` TP ranks: norms, attention, router."""
    experts = model.num_experts or 0
    router = [experts * model.hidden_size] + ([experts] if model.add_bias_linear else [])
    return attention_tensors(model, tp) + _norm(model) + router


def expert_tensors(model: ModelConfig, *, ep: int = 1, etp: int = 1) -> list[int]:
    """The expert tensors of one MoE layer held by one (ep, etp) rank: E / ep experts, each an
    MLP of `moe_ffn` split over etp."""
    local = (model.num_experts or 0) // ep
    return mlp_tensors(model, model.moe_ffn, etp) * local


def layer_params(model: ModelConfig, tp: int = 1) -> int:
    """Parameters of one dense transformer layer held by one of `tp` tensor-parallel ranks."""
    return sum(layer_tensors(model, tp))


def count_params(
    model: ModelConfig, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None
) -> ParamCount:
    """Count `model`'s parameters; `tp`/`pp` (and `ep`/`etp`, default tp, for the experts)
    give the per-stage, per-rank split."""
    if model.num_layers % pp:
        raise ValueError(f"pp ({pp}) must divide num_layers ({model.num_layers})")
    etp = tp if etp is None else etp
    h = model.hidden_size
    norm = _norm(model)
    learned = model.position_embedding_type == "learned_absolute"
    positions = [model.seq_length * h] if learned else []
    vocab_rows = padded_vocab(model.vocab_size, tp) // tp
    per_stage = model.num_layers // pp
    moe = model.moe_layers
    experts = expert_tensors(model, ep=ep, etp=etp)

    stages: list[list[int]] = []
    expert_stages: list[list[int]] = []
    for s in range(pp):
        dense: list[int] = []
        expert: list[int] = []
        for i in range(s * per_stage, (s + 1) * per_stage):
            if not moe[i]:
                dense += layer_tensors(model, tp)
            elif ep > 1:  # Megatron's own buffer for the experts only with expert parallelism
                dense += moe_dense_tensors(model, tp)
                expert += experts
            else:
                dense += moe_dense_tensors(model, tp) + experts
        stages.append(dense)
        expert_stages.append(expert)
    stages[0] += [vocab_rows * h, *positions]
    stages[-1] += norm
    if not model.tie_embeddings or pp > 1:
        stages[-1].append(vocab_rows * h)

    n_moe = sum(moe)
    one_expert = sum(mlp_tensors(model, model.moe_ffn, 1))
    moe_layer = sum(moe_dense_tensors(model, 1))
    outside = model.vocab_size * h * (1 if model.tie_embeddings else 2) + sum(positions) + sum(norm)
    dense_total = (model.num_layers - n_moe) * layer_params(model, 1) + n_moe * moe_layer
    total = dense_total + outside + n_moe * (model.num_experts or 0) * one_expert
    active = dense_total + outside + n_moe * model.moe_router_topk * one_expert
    return ParamCount(
        total=total,
        active=active,
        stage_tensors=tuple(tuple(t) for t in stages),
        stage_expert_tensors=tuple(tuple(t) for t in expert_stages) if ep > 1 else (),
    )
