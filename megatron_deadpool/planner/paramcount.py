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

`total` counts each distinct parameter once (a tied output layer is the embedding).
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
    """Parameters of a model, whole and per pipeline stage for one tensor-parallel rank."""

    total: int
    """Distinct parameters of the whole model (vocabulary unpadded, tied weights once)."""

    stage_tensors: tuple[tuple[int, ...], ...]
    """stage_tensors[s]: element counts of the tensors one TP rank of stage s holds."""

    @property
    def per_stage(self) -> tuple[int, ...]:
        """per_stage[s]: parameters one tensor-parallel rank of pipeline stage s holds."""
        return tuple(sum(t) for t in self.stage_tensors)

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
        """Elements of Megatron's param/grad buffer on `stage` with the distributed optimizer
        over `dp` ranks: each tensor starts 64-aligned, the end is padded to lcm(dp, 128).
        (One bucket; Megatron-LM's ~40M-element buckets each pad their end the same way,
        under 128 x dp elements per bucket more.)"""
        aligned = sum(_round_up(n, PARAM_ALIGN) for n in self.stage_tensors[stage])
        return _round_up(aligned, math.lcm(dp, BUCKET_ALIGN))


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of `tp` (rows of the split embedding)."""
    return _round_up(vocab_size, tp)


def layer_tensors(model: ModelConfig, tp: int = 1) -> list[int]:
    """Element counts of one transformer layer's tensors held by one of `tp` TP ranks."""
    h, f = model.hidden_size, model.ffn
    head_dim = h // model.num_attention_heads
    qkv_out = (model.num_attention_heads + 2 * model.query_groups) * head_dim
    fc1_out = 2 * f if model.swiglu else f
    norm = [h, h] if model.normalization == "LayerNorm" else [h]
    out = [*norm, h * qkv_out // tp, model.num_attention_heads * head_dim * h // tp]
    out += [*norm, h * fc1_out // tp, f * h // tp]
    if model.add_bias_linear:  # column-parallel biases split, row-parallel ones replicated
        out += [qkv_out // tp, h, fc1_out // tp, h]
    return out


def layer_params(model: ModelConfig, tp: int = 1) -> int:
    """Parameters of one transformer layer held by one of `tp` tensor-parallel ranks."""
    return sum(layer_tensors(model, tp))


def count_params(model: ModelConfig, *, tp: int = 1, pp: int = 1) -> ParamCount:
    """Count `model`'s parameters; `tp`/`pp` give the per-stage, per-TP-rank split."""
    if model.num_layers % pp:
        raise ValueError(f"pp ({pp}) must divide num_layers ({model.num_layers})")
    h = model.hidden_size
    norm = [h, h] if model.normalization == "LayerNorm" else [h]
    learned = model.position_embedding_type == "learned_absolute"
    positions = [model.seq_length * h] if learned else []
    vocab_rows = padded_vocab(model.vocab_size, tp) // tp

    stages = [layer_tensors(model, tp) * (model.num_layers // pp) for _ in range(pp)]
    stages[0] += [vocab_rows * h, *positions]
    stages[-1] += norm
    if not model.tie_embeddings or pp > 1:
        stages[-1].append(vocab_rows * h)

    total = (
        model.num_layers * layer_params(model, 1)
        + model.vocab_size * h * (1 if model.tie_embeddings else 2)
        + sum(positions)
        + sum(norm)
    )
    return ParamCount(total=total, stage_tensors=tuple(tuple(t) for t in stages))
