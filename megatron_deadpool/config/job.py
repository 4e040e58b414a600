"""The job schema shared by `deadpool train`, the planner and the cluster scripts.

A YAML job config has the sections `model`, `parallel`, `train` and `deadpool`, and optionally
`cluster`; each maps onto one dataclass here (or `DeadpoolConfig`, `ClusterConfig`) and is
validated against it: unknown keys, wrong types and impossible values raise `ConfigError`
naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError
from .cluster import ClusterConfig
from .deadpool import DeadpoolConfig
from .flags import from_mapping, to_mapping
from .numbers import check_number
from .yaml_file import read_yaml


def _positive(value: int, where: str) -> None:
    check_number(value, where, integer=True, minimum=1)


def _check_divides(divisor: tuple[str, int], size: tuple[str, int]) -> None:
    """Refuse a `divisor` (name, value) that does not divide `size` (name, value)."""
    (divisor_name, d), (size_name, n) = divisor, size
    if n % d:
        raise ConfigError(f"{divisor_name} ({d}) must divide {size_name} ({n})")


@dataclass(kw_only=True)
class ModelConfig:
    """A GPT-style decoder (Megatron-Core `GPTModel`)."""

    num_layers: int = 2
    """Transformer layers."""

    hidden_size: int = 64
    """Hidden size."""

    num_attention_heads: int = 4
    """Attention heads."""

    ffn_hidden_size: int | None = None
    """MLP hidden size (default 4 x hidden size)."""

    seq_length: int = 64
    """Sequence length in tokens."""

    vocab_size: int = 128
    """Vocabulary size (padded to a multiple of TP by the model builder)."""

    swiglu: bool = False
    """Gated SiLU MLP (LLaMA's SwiGLU: three weight matrices, Megatron's
    `gated_linear_unit=True` with SiLU) instead of the two-matrix GeLU MLP."""

    num_query_groups: int | None = None
    """Key/value head groups for grouped-query attention (default: one per attention head,
    i.e. plain multi-head attention)."""

    tie_embeddings: bool = False
    """Share the input embedding with the output layer (Megatron-LM's default; its flag
    `--untie-embeddings-and-output-weights` turns it off). Off here: the embedded job builds a
    separate output layer, as LLaMA does."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Normalization layers: LayerNorm (weight and bias) or RMSNorm (weight only)."""

    add_bias_linear: bool = True
    """Biases in the attention and MLP linear layers (LLaMA: false)."""

    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    """Learned absolute position embeddings (a seq_length x hidden table) or rotary (no
    parameters)."""

    num_experts: int | None = None
    """Mixture of experts: experts per MoE layer (Megatron-LM's `--num-experts`, Megatron-Core's
    `num_moe_experts`); None: a dense model. The embedded job (`deadpool train`) builds it with
    Megatron-Core's local MoE layers (all-to-all token dispatch) at tp 1."""

    moe_router_topk: int = 2
    """Experts each token is routed to (Megatron-LM's `--moe-router-topk`, default 2): sizes the
    FLOPs an iteration computes, not the parameters."""

    moe_ffn_hidden_size: int | None = None
    """Hidden size of each expert's MLP (Megatron-LM's `--moe-ffn-hidden-size`; default the MLP
    hidden size in effect, as Megatron-LM's `validate_args` sets it)."""

    moe_layer_freq: int = 1
    """One MoE layer every this many layers, starting with the first (Megatron-LM's integer
    `--moe-layer-freq`: layer i is MoE when i % freq == 0, `get_gpt_decoder_block_spec`); 1: every
    layer. Megatron's list patterns are not supported here."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            _positive(getattr(self, name), f"model.{name}")
        _positive(self.vocab_size, "model.vocab_size")
        if self.ffn_hidden_size is not None:
            _positive(self.ffn_hidden_size, "model.ffn_hidden_size")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_query_groups is not None:
            _positive(self.num_query_groups, "model.num_query_groups")
            heads = ("model.num_attention_heads", self.num_attention_heads)
            _check_divides(("model.num_query_groups", self.num_query_groups), heads)
        for name in ("swiglu", "tie_embeddings", "add_bias_linear"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"model.{name}: expected true or false")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(
                f"model.normalization: {self.normalization!r} is not one of LayerNorm, RMSNorm"
            )
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ConfigError(
                f"model.position_embedding_type: {self.position_embedding_type!r} is not one "
                "of learned_absolute, rope"
            )
        self._check_experts()

    def _check_experts(self) -> None:
        _positive(self.moe_router_topk, "model.moe_router_topk")
        _positive(self.moe_layer_freq, "model.moe_layer_freq")
        if self.moe_ffn_hidden_size is not None:
            _positive(self.moe_ffn_hidden_size, "model.moe_ffn_hidden_size")
        if self.num_experts is None:
            if self.moe_ffn_hidden_size is not None or self.moe_layer_freq != 1:
                raise ConfigError(
                    "model.moe_ffn_hidden_size / model.moe_layer_freq (--moe-ffn-hidden-size, "
                    "--moe-layer-freq) apply to MoE models only: set model.num_experts "
                    "(--num-experts) as well, or drop them"
                )
            return
        _positive(self.num_experts, "model.num_experts")
        if self.moe_router_topk > self.num_experts:
            raise ConfigError(
                f"model.moe_router_topk (--moe-router-topk {self.moe_router_topk}) exceeds "
                f"model.num_experts ({self.num_experts}): route each token to at most "
                f"{self.num_experts} experts"
            )
        if self.moe_layer_freq > self.num_layers:
            raise ConfigError(
                f"model.moe_layer_freq (--moe-layer-freq {self.moe_layer_freq}) exceeds "
                f"model.num_layers ({self.num_layers}): use 1 (every layer) to "
                f"{self.num_layers}"
            )

    @property
    def moe_ffn(self) -> int:
        """Each expert's MLP hidden size in effect (0 for a dense model)."""
        if self.num_experts is None:
            return 0
        return self.moe_ffn_hidden_size or self.ffn

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """moe_layers[i]: whether layer i is an MoE layer (Megatron-Core's
        `get_gpt_decoder_block_spec`: i % moe_layer_freq == 0 for an integer frequency)."""
        moe = self.num_experts is not None
        return tuple(moe and i % self.moe_layer_freq == 0 for i in range(self.num_layers))

    @property
    def ffn(self) -> int:
        """The MLP hidden size in effect."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """The key/value head groups in effect."""
        return self.num_query_groups or self.num_attention_heads


@dataclass(kw_only=True)
class ParallelConfig:
    """Megatron's parallel layout: world size = tp x pp x dp."""

    tp: int = 1
    """Tensor-parallel size."""

    pp: int = 1
    """Pipeline-parallel size."""

    dp: int = 2
    """Data-parallel size."""

    ep: int = 1
    """Expert-model-parallel size (Megatron-LM's `--expert-model-parallel-size`): an MoE layer's
    experts are split over this many ranks."""

    etp: int | None = None
    """Expert-tensor-parallel size (Megatron-LM's `--expert-tensor-parallel-size`); None: tp, as
    Megatron-LM's `validate_args` sets it."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep"):
            _positive(getattr(self, name), f"parallel.{name}")
        if self.etp is not None:
            _positive(self.etp, "parallel.etp")
        # Megatron-Core's `parallel_state.initialize_model_parallel` builds the expert layout
        # as etp x ep x expert-dp x pp and raises unless etp * ep * pp divides the world size
        # tp * pp * dp (context parallelism 1), i.e. unless etp * ep divides tp * dp.
        expert_mp, dense = self.expert_tp * self.ep, self.tp * self.dp
        if dense % expert_mp:
            step = expert_mp // math.gcd(self.tp, expert_mp)
            raise ConfigError(
                f"parallel.ep x parallel.etp (--expert-model-parallel-size {self.ep} x "
                f"--expert-tensor-parallel-size {self.expert_tp} = {expert_mp}) must divide "
                f"tp x dp = {self.tp} x {self.dp} = {dense} (Megatron's expert layout is "
                f"etp x ep x expert-dp x pp over the same world): lower ep or etp, or use a dp "
                f"that is a multiple of {step}"
            )

    @property
    def expert_tp(self) -> int:
        """The expert layers' tensor-parallel size in effect."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """The expert layers' data-parallel size: world / (etp x ep x pp) (Megatron-Core's
        `expert_data_parallel_size` in `initialize_model_parallel`)."""
        return self.tp * self.dp // (self.expert_tp * self.ep)

    @property
    def world_size(self) -> int:
        """Active ranks."""
        return self.tp * self.pp * self.dp


@dataclass(kw_only=True)
class TrainConfig:
    """The embedded training job's schedule."""

    iters: int = 8
    """Training iterations."""

    micro_batch_size: int = 2
    """Sequences per micro-batch."""

    num_microbatches: int = 2
    """Micro-batches per iteration and data-parallel rank (gradient accumulation)."""

    lr: float = 1e-3
    """Peak learning rate (linear warm-up, then cosine decay)."""

    lr_warmup_iters: int = 2
    """Warm-up iterations."""

    seed: int = 1234
    """Seed of model initialisation and of the mock data."""

    save: str | None = None
    """Directory for persistent Megatron checkpoints (torch_dist), as Megatron-LM's --save."""

    save_interval: int = 0
    """Save a persistent checkpoint every this many iterations (0: only when the run must
    stop: preemption, or a failure memory cannot recover)."""

    load: str | None = None
    """Resume from the latest persistent checkpoint in this directory, as Megatron-LM's --load."""

    def __post_init__(self) -> None:
        for name in ("iters", "micro_batch_size", "num_microbatches"):
            _positive(getattr(self, name), f"train.{name}")
        check_number(self.save_interval, "train.save_interval", integer=True, minimum=0)
        if self.save_interval and not self.save:
            raise ConfigError("train.save_interval: set train.save (--save DIR) as well")
        check_number(self.lr_warmup_iters, "train.lr_warmup_iters", integer=True, minimum=0)
        check_number(self.lr, "train.lr", above=0)


@dataclass(kw_only=True)
class JobConfig:
    """A whole job: model, layout, schedule and DeadPool settings."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deadpool: DeadpoolConfig = field(default_factory=lambda: DeadpoolConfig(enabled=True))
    cluster: ClusterConfig | None = None
    """The site's nodes (optional): the planner's hardware figures and the Slurm defaults."""

    def __post_init__(self) -> None:
        m, tp = self.model, ("parallel.tp", self.parallel.tp)
        _check_divides(tp, ("model.num_attention_heads", m.num_attention_heads))
        _check_divides(tp, ("model.num_query_groups", m.query_groups))
        _check_divides(tp, ("the MLP hidden size", m.ffn))
        self._check_experts()
        if (
            self.cluster is not None
            and self.deadpool.ranks_per_node is not None
            and self.deadpool.ranks_per_node != self.cluster.gpus_per_node
        ):
            raise ConfigError(
                f"deadpool.ranks_per_node ({self.deadpool.ranks_per_node}) differs from "
                f"cluster.gpus_per_node ({self.cluster.gpus_per_node}); drop one of them"
            )
        _check_divides(("parallel.pp", self.parallel.pp), ("model.num_layers", m.num_layers))
        if self.parallel.pp > 1 and self.train.num_microbatches < self.parallel.pp:
            raise ConfigError(
                f"train.num_microbatches ({self.train.num_microbatches}) must be >= parallel.pp "
                f"({self.parallel.pp}) for the pipeline schedule"
            )

    def _check_experts(self) -> None:
        p = self.parallel
        check_expert_sizes(self.model, tp=p.tp, ep=p.ep, etp=p.etp)

    @property
    def ranks_per_node(self) -> int:
        """The failure-domain size in effect (default: the cluster's GPUs per node, else one
        tensor-parallel group per node)."""
        if self.deadpool.ranks_per_node:
            return self.deadpool.ranks_per_node
        return self.cluster.gpus_per_node if self.cluster is not None else self.parallel.tp

    def to_dict(self) -> dict[str, Any]:
        """Plain data under the YAML keys (`flags.yaml_keys`), for YAML and JSON."""
        data = dataclasses.asdict(self)
        for name, cls in SECTIONS.items():
            if data.get(name) is not None:
                data[name] = to_mapping(cls, data[name])
        return data


def check_expert_sizes(model: ModelConfig, *, tp: int, ep: int, etp: int | None) -> None:
    """The expert-parallel sizes `model` admits, as Megatron-LM's `validate_args` and
    Megatron-Core's layers require: ep and etp only with experts, ep dividing the experts
    (`MoELayer`'s `num_local_experts`), etp (default tp) the expert MLP size (its column split).
    `JobConfig` calls it; `deadpool plan` too, before the world-size rule of `ParallelConfig`,
    so that a wrong ep is named for what it must divide first."""
    if model.num_experts is None:
        if ep != 1 or etp is not None:
            raise ConfigError(
                "parallel.ep / parallel.etp (--expert-model-parallel-size, "
                "--expert-tensor-parallel-size) apply to MoE models only: set "
                "model.num_experts (--num-experts) as well, or drop them"
            )
        return
    if model.num_experts % ep:
        fits = [e for e in range(1, model.num_experts + 1) if model.num_experts % e == 0]
        raise ConfigError(
            f"parallel.ep (--expert-model-parallel-size {ep}) must divide model.num_experts "
            f"({model.num_experts}): use one of {', '.join(map(str, fits))}"
        )
    expert_tp = tp if etp is None else etp
    if model.moe_ffn % expert_tp:
        raise ConfigError(
            f"parallel.etp (--expert-tensor-parallel-size {expert_tp}"
            f"{'' if etp is not None else ', = tp by default'}) must divide the expert MLP "
            f"hidden size model.moe_ffn_hidden_size ({model.moe_ffn}): choose an etp that "
            "divides it"
        )


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "deadpool": DeadpoolConfig,
    "cluster": ClusterConfig,
}
OPTIONAL_SECTIONS = frozenset({"cluster"})
"""Sections that stay `None` in `JobConfig` when the file leaves them out."""


def job_from_mapping(data: Any, *, where: str = "config") -> JobConfig:
    """Validate a parsed YAML document against the schema."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping with sections {', '.join(SECTIONS)}")
    for key in data:
        if key not in SECTIONS:
            raise ConfigError(
                f"{where}: unknown section {key!r}; known sections: {', '.join(SECTIONS)}"
            )
    parts: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        section = data.get(name)
        if section is not None and not isinstance(section, dict):
            raise ConfigError(f"{where}.{name}: expected a mapping")
        if name in OPTIONAL_SECTIONS and section is None:
            parts[name] = None
            continue
        if name == "deadpool":
            section = {"enabled": True, **(section or {})}
        parts[name] = from_mapping(cls, section, where=f"{where}.{name}")
    return JobConfig(**parts)


def load_job(path: str | Path) -> JobConfig:
    """Read and validate a YAML job config."""
    p = Path(path)
    return job_from_mapping(read_yaml(p, "config") or {}, where=p.name)
