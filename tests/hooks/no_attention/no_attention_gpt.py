"""A GPT layer without attention, for `pretrain_gpt.py --spec no_attention_gpt layer`.

Megatron-Core runs context parallelism only in Transformer Engine's attention
(`DotProductAttention` asserts "Context parallelism is only supported by
TEDotProductAttention!"), and Transformer Engine needs a GPU. Everything else context
parallelism changes - the groups, the sequence split of every batch
(`get_batch_on_this_cp_rank`), the gradients and the distributed optimizer reduced and sharded
over the data- and context-parallel group - runs on CPU with this layer: Megatron's local GPT
layer whose attention and its bias-dropout-add are Megatron's own `IdentityOp`s (as its
heterogeneous and hybrid models skip attention), so each token goes through the layer's MLP
alone. Put this folder on PYTHONPATH of the job's processes.
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

_LOCAL = get_gpt_layer_local_spec()
layer = dataclasses.replace(
    _LOCAL,
    submodules=dataclasses.replace(
        _LOCAL.submodules,
        input_layernorm=IdentityOp,
        self_attention=IdentityOp,
        self_attn_bda=IdentityFuncOp,
    ),
)
"""Megatron's local GPT layer spec with attention replaced by the identity."""
