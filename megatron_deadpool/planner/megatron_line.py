"""Read a Megatron-LM `pretrain_gpt.py` argument line: what `deadpool plan -- ARGS` plans.

`parse_megatron_line(argv)` takes the arguments as Megatron-LM spells them (``--x=v`` or
``--x v``) and returns the model, the parallel sizes, the batch and recompute settings, and
the training schedule the planner and `deadpool plan --megatron-args` use. Flags it leaves out
take Megatron-LM's defaults (tp, pp, cp, ep 1; etp = tp; tied embeddings; biases; LayerNorm;
learned positions; no recompute; micro-batch 1). Flags the planner does not need (data paths,
logging, ...) are ignored; the sizes a plan cannot do without (--num-layers, --hidden-size,
--num-attention-heads, --seq-length, --vocab-size) must be there. The world size is not in a
Megatron line (torchrun gives it): `deadpool plan --dp` or the job file supplies dp.
`deadpool plan --megatron-args` prints a line this reads back to the same plan.
Pure: argparse only, no torch, no Megatron.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, NoReturn

from ..config.job import ModelConfig
from ..config.numbers import number_arg
from ..errors import ConfigError
from .capacity import Recompute

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")


@dataclass(frozen=True, kw_only=True)
class MegatronLine:
    """What a Megatron-LM argument line says about a job."""

    model: ModelConfig
    tp: int
    pp: int
    ep: int
    etp: int | None
    """None: tp (Megatron's default)."""
    tp_pp_dp: bool
    """--use-tp-pp-dp-mapping."""
    micro_batch_size: int
    global_batch_size: int | None
    """None: micro-batch x dp (Megatron's default)."""
    recompute: Recompute
    """none, selective or full."""
    train: dict[str, Any]
    """TrainConfig fields the line sets: iters, lr, lr_warmup_iters, seed."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"Megatron-LM argument line (after --): {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", add_help=False, allow_abbrev=False)
    count = number_arg(integer=True, minimum=1)
    for flag in (
        "--num-layers",
        "--hidden-size",
        "--num-attention-heads",
        "--ffn-hidden-size",
        "--seq-length",
        "--max-position-embeddings",
        "--num-query-groups",
        "--vocab-size",
        "--num-experts",
        "--moe-router-topk",
        "--moe-ffn-hidden-size",
        "--moe-layer-freq",
        "--micro-batch-size",
        "--global-batch-size",
        "--train-iters",
        "--recompute-num-layers",
    ):
        p.add_argument(flag, type=count)
    for flag, default in (
        ("--tensor-model-parallel-size", 1),
        ("--pipeline-model-parallel-size", 1),
        ("--context-parallel-size", 1),
        ("--expert-model-parallel-size", 1),
    ):
        p.add_argument(flag, type=count, default=default)
    p.add_argument("--expert-tensor-parallel-size", type=count)
    p.add_argument("--lr-warmup-iters", type=number_arg(integer=True, minimum=0))
    p.add_argument("--seed", type=number_arg(integer=True, minimum=0))
    p.add_argument("--lr", type=number_arg(above=0))
    p.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"])
    p.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"])
    p.add_argument("--recompute-granularity", choices=["full", "selective"])
    for flag in (
        "--group-query-attention",
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--use-tp-pp-dp-mapping",
        "--recompute-activations",
    ):
        p.add_argument(flag, action="store_true")
    return p


def parse_megatron_line(argv: list[str]) -> MegatronLine:
    """`argv` (a `pretrain_gpt.py` argument list) read as the module docstring says;
    `ConfigError` naming the flag on bad or missing values."""
    ns, _ignored = _parser().parse_known_args(argv)
    missing = [n for n in REQUIRED if getattr(ns, n) is None]
    if missing:
        flags = ", ".join("--" + n.replace("_", "-") for n in missing)
        raise ConfigError(
            f"Megatron-LM argument line (after --): {flags} missing: the planner needs the "
            "model's sizes (the tokenizer's vocabulary is not read: give --vocab-size)"
        )
    if ns.context_parallel_size != 1:
        raise ConfigError(
            f"--context-parallel-size {ns.context_parallel_size}: the planner models context "
            "parallelism 1 only; plan with --context-parallel-size 1"
        )
    if ns.num_query_groups is not None and not ns.group_query_attention:
        raise ConfigError(
            "--num-query-groups applies with --group-query-attention (Megatron-LM ignores it "
            "otherwise): add --group-query-attention or drop it"
        )
    fields: dict[str, Any] = {
        "num_layers": ns.num_layers,
        "hidden_size": ns.hidden_size,
        "num_attention_heads": ns.num_attention_heads,
        "ffn_hidden_size": ns.ffn_hidden_size,
        "seq_length": ns.seq_length,
        "vocab_size": ns.vocab_size,
        "swiglu": ns.swiglu,
        "num_query_groups": ns.num_query_groups if ns.group_query_attention else None,
        "tie_embeddings": not ns.untie_embeddings_and_output_weights,
        "normalization": ns.normalization or "LayerNorm",
        "add_bias_linear": not ns.disable_bias_linear,
        "position_embedding_type": ns.position_embedding_type or "learned_absolute",
        "num_experts": ns.num_experts,
    }
    for name in ("moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq"):
        if getattr(ns, name) is not None:
            fields[name] = getattr(ns, name)
    model = ModelConfig(**fields)
    # The defaults in effect, spelled out (as --megatron-args prints them), are the defaults.
    if model.ffn_hidden_size == 4 * model.hidden_size:
        model = dataclasses.replace(model, ffn_hidden_size=None)
    if model.num_experts is not None and model.moe_ffn_hidden_size == model.ffn:
        model = dataclasses.replace(model, moe_ffn_hidden_size=None)
    recompute: Recompute
    if ns.recompute_granularity == "full":
        recompute = "full"
    elif ns.recompute_activations or ns.recompute_granularity == "selective":
        recompute = "selective"
    else:
        recompute = "none"
    train = {
        name: getattr(ns, flag)
        for name, flag in (
            ("iters", "train_iters"),
            ("lr", "lr"),
            ("lr_warmup_iters", "lr_warmup_iters"),
            ("seed", "seed"),
        )
        if getattr(ns, flag) is not None
    }
    return MegatronLine(
        model=model,
        tp=ns.tensor_model_parallel_size,
        pp=ns.pipeline_model_parallel_size,
        ep=ns.expert_model_parallel_size,
        etp=ns.expert_tensor_parallel_size,
        tp_pp_dp=ns.use_tp_pp_dp_mapping,
        micro_batch_size=ns.micro_batch_size or 1,
        global_batch_size=ns.global_batch_size,
        recompute=recompute,
        train=train,
    )
