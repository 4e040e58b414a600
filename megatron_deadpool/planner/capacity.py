"""Capacity planner: memory, replication traffic, recovery time and failure coverage of a job.

`plan(model, layout, ...)` is a pure function from a model, a Megatron layout and a cluster
description to a `PlanReport`, which `PlanReport.to_dict` turns into JSON. The text
rendering and the command line (`deadpool plan`) are in `plan_cli.py`.

Memory accounting per GPU (Megatron-LM, bf16 training, distributed optimizer), with P the
parameters one rank holds (its pipeline stage's share for its TP rank, `paramcount`), laid
out in Megatron's buffer with its alignment padding (P' = `buffer_numel`, < 0.01% more than P
for the paper's models):

- weights: bf16, 2 B x P';
- main gradients: fp32 grad buffer (Megatron-LM accumulates bf16 grads in fp32), 4 B x P';
- optimizer shard: fp32 main params + Adam exp_avg + exp_avg_sq = 12 B per parameter, split
  over the dp data-parallel ranks: 12 x P' / dp;
- activations: an estimate after Korthikanti et al. (sequence parallel when tp > 1), per layer
  and micro-batch 34 s b h / tp bytes with selective recompute, 2 s b h / tp with full
  recompute, s b h (34 + 5 a s / h) / tp with none; the first stage of a 1F1B pipeline keeps
  min(pp, microbatches) micro-batches of its num_layers / pp layers alive;
- DeadPool: a local snapshot = the optimizer shard (plus < 1 MiB of per-rank state: RNG,
  LR scheduler, data position, not counted), and replicas held = k x shard, allocated
  double-buffered (2 k x shard: the last committed copy stays intact while the next arrives).

Mixture of experts with expert parallelism (ep > 1): Megatron-Core keeps the experts in a
buffer of their own (`paramcount`) and builds two distributed optimizers, chained
(`megatron/core/optimizer/__init__.py`, `get_megatron_optimizer`: the dense one over the
data-parallel group - dp = world / (tp x pp), `parallel_state.initialize_model_parallel`'s
`data_parallel_size`, whatever ep is - and the expert one over `intra_expt_dp_group`, the
expert data-parallel group of size world / (etp x ep x pp), its `expert_data_parallel_size`).
So with P_d' and P_e' the two buffers: weights 2 (P_d' + P_e'), grads 4 (P_d' + P_e'), optimizer
shard 12 P_d' / dp + 12 P_e' / expert-dp; the snapshot and every replica hold both shards (one
placement among the ranks holding the same dense and expert weights, `Layout.peer_groups`),
so a rank sends k x (dense + expert shard) per iteration and a newcomer receives its bf16
weights (both parts) and both shards. The data-parallel traffic is the dense buffer's over dp
plus the expert buffer's over expert-dp. FLOPs count the parameters a token is computed with
(`ParamCount.active`: top-k of the experts); the activation estimate is the dense one (an MoE
layer's dispatched tokens, k copies per token, are not added).

Time model: an iteration computes 6 x params x tokens FLOPs (8 with full recompute) at
`mfu` of the GPUs' peak; the replication of k shards per GPU runs over the GPU's share of its
node's NICs; the data-parallel gradient reduce-scatter (fp32) and parameter all-gather (bf16)
are counted as inter-node traffic too (an upper bound). Recovery: the terms of
`recovery_terms.node_failure` at the job's own size, each with its source - the same function as
the table at 512, 1,024 and 16,384 GPUs (`at_scale`) - grouped into phases (`RecoveryPhases`):
detect, survivors stop, agree, reconstruct (the newcomer's build, the repair, its join), restore
(the transfer) and the failed iteration.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from ..config.cluster import GB, GIB, ClusterConfig
from ..config.deadpool import DeadpoolConfig
from ..config.job import JobConfig, ModelConfig, ParallelConfig, TrainConfig
from ..errors import ConfigError
from ..replication.placement import Layout, RankOrder, place_replicas
from .coverage import NodeCoverage, node_coverage
from .paramcount import ParamCount, count_params
from .recovery_terms import NETWORK_EFFICIENCY, Job, RecoveryTerms, node_failure

WEIGHT_BYTES = 2
GRAD_BYTES = 4
OPTIMIZER_BYTES = 12
Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The training schedule the time and activation figures assume."""

    global_batch_size: int
    """Sequences per iteration (all data-parallel ranks together)."""

    micro_batch_size: int = 1
    """Sequences per micro-batch."""

    mfu: float = 0.4
    """Model FLOPs utilisation: achieved share of the GPUs' peak."""

    recompute: Recompute = "selective"
    """Activation recomputation: none, selective (attention core) or full (every layer)."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name.replace('_', '-')}: must be a positive integer")
        if not 0 < self.mfu <= 1:
            raise ConfigError(f"mfu: must be in (0, 1], got {self.mfu}")
        if self.recompute not in ("none", "selective", "full"):
            raise ConfigError(f"recompute: {self.recompute!r} is not none, selective or full")


@dataclass(frozen=True, kw_only=True)
class PerGpu:
    """Memory of one GPU of the largest pipeline stage, in bytes."""

    params: int
    """Parameters this GPU holds (dense and expert)."""

    expert_params: int
    """Of which in the expert buffer (experts with ep > 1; 0 otherwise)."""

    buffer_elements: int
    """Elements of its param/grad buffers: the parameters with Megatron's alignment padding."""

    expert_buffer_elements: int
    """Of which in the expert buffer (sharded over the expert data-parallel group)."""

    stage: str
    """Which pipeline stage these figures are for (the one with the most parameters)."""

    weights_bytes: int
    """bf16 model weights."""

    grads_bytes: int
    """fp32 main-gradient buffer."""

    optimizer_shard_bytes: int
    """This rank's distributed-optimizer shard: fp32 main params, exp_avg, exp_avg_sq (dense
    and expert)."""

    dense_optimizer_shard_bytes: int
    """Its dense part: 12 B x the dense buffer / dp."""

    expert_optimizer_shard_bytes: int
    """Its expert part: 12 B x the expert buffer / expert dp (0 without ep > 1)."""

    activation_bytes: int
    """Activation memory estimate."""

    training_bytes: int
    """Weights + gradients + optimizer shard + activations: training without DeadPool."""

    snapshot_bytes: int
    """DeadPool's local snapshot of the shard."""

    replica_bytes: int
    """Replicas this GPU holds for its peers (k x shard)."""

    replica_buffer_bytes: int
    """Memory the replicas take, double-buffered (2 k x shard)."""

    deadpool_bytes: int
    """Snapshot + replica buffers: what DeadPool adds."""

    total_bytes: int
    """Training + DeadPool with snapshot and replicas in GPU memory."""

    usable_gpu_bytes: int
    """GPU memory after the cluster's reserve."""

    fits_gpu: bool
    """Training and DeadPool fit in GPU memory together."""

    host_deadpool_bytes_per_node: int
    """Snapshots and replicas of a whole node, when kept in host memory instead."""

    usable_host_bytes: int
    """Host memory of one node after the cluster's reserve."""

    fits_host: bool
    """Snapshots and replicas of a node fit in its host memory."""


@dataclass(frozen=True, kw_only=True)
class PerIteration:
    """Work and traffic of one training iteration."""

    tokens: int
    """Tokens per iteration (global batch x sequence length)."""

    compute_s: float
    """Compute time of an iteration at the given MFU."""

    replication_bytes: int
    """Bytes each GPU sends to its k holders (on other nodes): k x both shards."""

    expert_replication_bytes: int
    """Of which the expert shard's (k x expert shard)."""

    cluster_replication_bytes: int
    """Replication bytes of all GPUs together."""

    replication_s: float
    """Time to send them over the GPU's share of its node's NICs."""

    dp_comm_bytes: int
    """Data-parallel gradient reduce-scatter + parameter all-gather bytes per GPU (dense over
    dp, experts over expert dp)."""

    dp_comm_s: float
    """Their time at the same bandwidth (upper bound: all counted as inter-node)."""

    snapshot_copy_s: float
    """Device-to-host copy of the snapshot per iteration, when kept in host memory."""

    overlap_headroom: float
    """compute_s / replication_s: how many times over the iteration hides the replication."""


@dataclass(frozen=True, kw_only=True)
class RecoveryPhases:
    """Estimated seconds of each recovery phase."""

    detect_s: float
    """Until the failure is published."""

    stop_s: float
    """Until the last survivor has stopped training (a failed collective, or its groups aborted
    by the plan watch)."""

    agree_s: float
    """Survivors agree on the dead set and the restore iteration."""

    reconstruct_s: float
    """The newcomer's build, the groups' repair and its join (`recovery_terms.RECONSTRUCT`)."""

    restore_s: float
    """Newcomers receive weights and shards; survivors roll back."""

    restore_bytes: int
    """What one newcomer receives: its bf16 weights and its optimizer shard (both parts)."""

    first_iteration_s: float
    """The failed iteration computed again."""

    @classmethod
    def of(cls, failure: RecoveryTerms, *, node: bool = False) -> RecoveryPhases:
        """The phases of `failure`'s terms; `node`: a lost node or a hang instead of a crash."""
        return cls(
            detect_s=failure.detect_node_s if node else failure.term("detect").seconds,
            stop_s=failure.stop_node_s if node else failure.term("survivors stop").seconds,
            agree_s=failure.term("agree").seconds,
            reconstruct_s=failure.reconstruct_s,
            restore_s=failure.term("transfer shard").seconds,
            restore_bytes=failure.restore_bytes,
            first_iteration_s=failure.term("failed iteration").seconds,
        )

    @property
    def resume_s(self) -> float:
        """From the failure until training runs again (all phases but the first iteration)."""
        return self.detect_s + self.stop_s + self.agree_s + self.reconstruct_s + self.restore_s

    @property
    def total_s(self) -> float:
        """From the failure until the first iteration after it has completed."""
        return self.resume_s + self.first_iteration_s


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """Everything `deadpool plan` reports about one configuration."""

    model: ModelConfig
    """The model planned for."""

    layout: Layout
    """The rank layout and failure domains."""

    cluster: ClusterConfig
    """The cluster's figures used."""

    workload: Workload
    """The schedule assumed."""

    replicas: int
    """k: replicas per shard."""

    spares: int
    """Spare ranks."""

    deadpool: DeadpoolConfig
    """DeadPool's settings planned with (its heartbeat: detection)."""

    params: int
    """Distinct model parameters."""

    active_params: int
    """Parameters one token is computed with (= params for a dense model)."""

    per_gpu: PerGpu
    """Per-GPU memory."""

    per_iteration: PerIteration
    """Per-iteration work and traffic."""

    failure: RecoveryTerms
    """A crashed rank's replacement, term by term, each with its source."""

    coverage: NodeCoverage
    """Node failures the placement survives."""

    warnings: list[str] = field(default_factory=list)
    """Problems found: memory that does not fit, replication that cannot hide, too few spares."""

    @property
    def recovery(self) -> RecoveryPhases:
        """Recovery after a crash (processes or node die): `failure`'s terms as phases."""
        return RecoveryPhases.of(self.failure)

    @property
    def recovery_hang(self) -> RecoveryPhases:
        """Recovery after a hang or a lost node (found by the heartbeat timeout)."""
        return RecoveryPhases.of(self.failure, node=True)

    @property
    def nodes(self) -> int:
        """Active nodes."""
        return self.layout.world_size // self.layout.ranks_per_node

    @property
    def spare_nodes(self) -> float:
        """Spare ranks in nodes."""
        return self.spares / self.layout.ranks_per_node

    @property
    def survives_any_node(self) -> bool:
        """Any one node can die: the state survives and the spares can replace it."""
        return self.coverage.single_node and self.spares >= self.layout.ranks_per_node

    @property
    def survives_any_two_nodes(self) -> bool:
        """Any two nodes can die at once: the state survives and spares replace both."""
        return self.coverage.any_two_nodes and self.spares >= 2 * self.layout.ranks_per_node

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        lay = self.layout
        return {
            "params": self.params,
            "active_params": self.active_params,
            "model": dataclasses.asdict(self.model),
            "layout": {
                "tp": lay.tp,
                "pp": lay.pp,
                "dp": lay.dp,
                "ep": lay.ep,
                "etp": lay.expert_tp,
                "expert_dp": lay.expert_dp,
                "order": lay.order.short,
                "world_size": lay.world_size,
                "gpus_per_node": lay.ranks_per_node,
                "nodes": self.nodes,
                "replicas": self.replicas,
                "spares": self.spares,
                "spare_nodes": self.spare_nodes,
            },
            "cluster": dataclasses.asdict(self.cluster),
            "workload": dataclasses.asdict(self.workload),
            "per_gpu": dataclasses.asdict(self.per_gpu),
            "per_iteration": dataclasses.asdict(self.per_iteration),
            "recovery_estimate_s": self.recovery.total_s,
            "recovery": {
                "crash": _phases(self.recovery),
                "hang": _phases(self.recovery_hang),
                "terms": [dataclasses.asdict(t) for t in self.failure.terms],
                "rebuilt_total_s": self.failure.rebuild_total_s,
            },
            "failures": {
                **dataclasses.asdict(self.coverage),
                "any_two_nodes_state": self.coverage.any_two_nodes,
                "survives_any_node": self.survives_any_node,
                "survives_any_two_nodes": self.survives_any_two_nodes,
            },
            "warnings": list(self.warnings),
        }


def _phases(phases: RecoveryPhases) -> dict[str, float]:
    return {**dataclasses.asdict(phases), "resume_s": phases.resume_s, "total_s": phases.total_s}


def activation_bytes(
    model: ModelConfig, layout: Layout, workload: Workload, microbatches: int
) -> int:
    """Activation memory of the first pipeline stage (see the module docstring)."""
    s, b, h = model.seq_length, workload.micro_batch_size, model.hidden_size
    if workload.recompute == "full":
        per_layer = 2 * s * b * h
    elif workload.recompute == "selective":
        per_layer = 34 * s * b * h
    else:
        per_layer = s * b * h * 34 + 5 * model.num_attention_heads * s * s * b
    in_flight = min(layout.pp, microbatches)
    return per_layer * (model.num_layers // layout.pp) * in_flight // layout.tp


def plan(
    model: ModelConfig,
    layout: Layout,
    *,
    replicas: int,
    spares: int,
    cluster: ClusterConfig,
    workload: Workload,
    deadpool: DeadpoolConfig | None = None,
) -> PlanReport:
    """Plan `model` on `layout` with k = `replicas` and `spares` spare ranks on `cluster`.

    Raises `ConfigError` (or its `PlacementError`) for layouts the model or DeadPool cannot
    use: sizes that do not divide, a batch too small for the pipeline, replicas that cannot
    leave their owner's node.
    """
    deadpool = deadpool or DeadpoolConfig(enabled=True)
    if cluster.gpus_per_node != layout.ranks_per_node:
        raise ConfigError(
            f"gpus-per-node ({layout.ranks_per_node}) differs from cluster "
            f"{cluster.site}'s gpus_per_node ({cluster.gpus_per_node})"
        )
    if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
        raise ConfigError(f"spares: must be an integer >= 0, got {spares!r}")
    per_step = workload.micro_batch_size * layout.dp
    if workload.global_batch_size % per_step:
        raise ConfigError(
            f"global-batch-size ({workload.global_batch_size}) must be a multiple of "
            f"micro-batch-size x dp = {per_step}"
        )
    microbatches = workload.global_batch_size // per_step
    JobConfig(  # the job schema's own checks: divisibility by tp/pp, microbatches >= pp
        model=model,
        parallel=ParallelConfig(
            tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep, etp=layout.etp
        ),
        train=TrainConfig(
            micro_batch_size=workload.micro_batch_size, num_microbatches=microbatches
        ),
        deadpool=deadpool,
    )
    _check_expert_order(layout)
    placement = place_replicas(layout, replicas)
    counts = count_params(model, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp)
    k = replicas
    stage = max(
        range(layout.pp), key=lambda s: (_state_bytes(counts, s, layout), counts.per_stage[s], -s)
    )
    dense_numel = counts.buffer_numel(stage, layout.dp)
    expert_numel = counts.expert_buffer_numel(stage, layout.expert_dp)
    numel = dense_numel + expert_numel
    dense_shard = OPTIMIZER_BYTES * dense_numel // layout.dp
    expert_shard = OPTIMIZER_BYTES * expert_numel // layout.expert_dp
    shard = dense_shard + expert_shard

    weights, grads = WEIGHT_BYTES * numel, GRAD_BYTES * numel
    acts = activation_bytes(model, layout, workload, microbatches)
    training = weights + grads + shard + acts
    extra = shard + 2 * k * shard
    host_node = layout.ranks_per_node * extra
    per_gpu = PerGpu(
        params=counts.per_stage[stage],
        expert_params=counts.per_stage_expert[stage],
        buffer_elements=numel,
        expert_buffer_elements=expert_numel,
        stage=_stage_name(stage, layout.pp),
        weights_bytes=weights,
        grads_bytes=grads,
        optimizer_shard_bytes=shard,
        dense_optimizer_shard_bytes=dense_shard,
        expert_optimizer_shard_bytes=expert_shard,
        activation_bytes=acts,
        training_bytes=training,
        snapshot_bytes=shard,
        replica_bytes=k * shard,
        replica_buffer_bytes=2 * k * shard,
        deadpool_bytes=extra,
        total_bytes=training + extra,
        usable_gpu_bytes=cluster.usable_gpu_bytes,
        fits_gpu=training + extra <= cluster.usable_gpu_bytes,
        host_deadpool_bytes_per_node=host_node,
        usable_host_bytes=cluster.usable_host_bytes,
        fits_host=host_node <= cluster.usable_host_bytes,
    )

    net = cluster.inter_node_gb_s_per_gpu * GB * NETWORK_EFFICIENCY
    tokens = workload.global_batch_size * model.seq_length
    per_param_token = 8 if workload.recompute == "full" else 6
    flops = per_param_token * counts.active * tokens
    compute_s = flops / (layout.world_size * cluster.gpu_tflops * 1e12 * workload.mfu)
    dense_p = per_gpu.params - per_gpu.expert_params
    dp_bytes = (GRAD_BYTES + WEIGHT_BYTES) * (
        dense_p * (layout.dp - 1) // layout.dp
        + per_gpu.expert_params * (layout.expert_dp - 1) // layout.expert_dp
    )
    replication_s = k * shard / net
    per_iteration = PerIteration(
        tokens=tokens,
        compute_s=compute_s,
        replication_bytes=k * shard,
        expert_replication_bytes=k * expert_shard,
        cluster_replication_bytes=k * shard * layout.world_size,
        replication_s=replication_s,
        dp_comm_bytes=dp_bytes,
        dp_comm_s=dp_bytes / net,
        snapshot_copy_s=shard / (cluster.host_device_gb_s * GB),
        overlap_headroom=compute_s / replication_s if replication_s else math.inf,
    )

    failure = node_failure(
        Job(
            gpus=layout.world_size,
            spares=spares,
            layout=f"tp {layout.tp} x pp {layout.pp} x dp {layout.dp}",
            params_per_gpu=per_gpu.params,
            restore_bytes=weights + shard,  # a newcomer's bf16 weights and both shards
            host_copy_s=None if per_gpu.fits_gpu else per_iteration.snapshot_copy_s,
            iteration_s=compute_s,
            active_params=counts.active,
            flops_per_param_token=per_param_token,
            tokens=tokens,
            mfu=workload.mfu,
        ),
        cluster,
        heartbeat_interval=deadpool.heartbeat_interval,
        heartbeat_timeout=deadpool.heartbeat_timeout,
    )
    report = PlanReport(
        model=model,
        layout=layout,
        cluster=cluster,
        workload=workload,
        replicas=k,
        spares=spares,
        deadpool=deadpool,
        params=counts.total,
        active_params=counts.active,
        per_gpu=per_gpu,
        per_iteration=per_iteration,
        failure=failure,
        coverage=node_coverage(placement),
    )
    report.warnings.extend(_warnings(report))
    return report


def _state_bytes(counts: ParamCount, stage: int, layout: Layout) -> int:
    """Weights, grads and optimizer shard of one rank of `stage`: what picks the stage planned
    for (the dense and the expert buffer shard over groups of different sizes)."""
    dense = counts.buffer_numel(stage, layout.dp)
    expert = counts.expert_buffer_numel(stage, layout.expert_dp)
    state = (WEIGHT_BYTES + GRAD_BYTES) * (dense + expert)
    return state + OPTIMIZER_BYTES * (dense // layout.dp + expert // layout.expert_dp)


def _check_expert_order(layout: Layout) -> None:
    """Megatron-Core's `initialize_model_parallel` asserts that, unless the rank order ends in
    pp (the default tp-dp-pp) or pp is 1, the expert data-parallel size equals the dense one;
    under tp-pp-dp that means etp x ep = tp."""
    if layout.order is RankOrder.TP_DP_PP or layout.pp == 1 or layout.expert_dp == layout.dp:
        return
    raise ConfigError(
        f"--use-tp-pp-dp-mapping with pp {layout.pp} > 1 needs the expert layers' data-parallel "
        f"size to equal dp ({layout.dp}), i.e. --expert-model-parallel-size x "
        f"--expert-tensor-parallel-size = tp ({layout.ep} x {layout.expert_tp} != {layout.tp}) "
        "(Megatron's initialize_model_parallel): drop --use-tp-pp-dp-mapping or choose ep x etp "
        f"= {layout.tp}"
    )


def _stage_name(stage: int, pp: int) -> str:
    if pp == 1:
        return "no pipeline parallelism"
    if stage == 0:
        return f"first of {pp} pipeline stages, with the embedding"
    if stage == pp - 1:
        return f"last of {pp} pipeline stages, with the output layer"
    return f"pipeline stage {stage} of {pp}"


def _warnings(report: PlanReport) -> list[str]:
    g, it, lay = report.per_gpu, report.per_iteration, report.layout
    out: list[str] = []
    usable = _gib(g.usable_gpu_bytes)
    more = " (or --expert-model-parallel-size)" if report.model.num_experts else ""
    if g.training_bytes > g.usable_gpu_bytes:
        out.append(
            f"training alone needs {_gib(g.training_bytes)} per GPU, more than the "
            f"{usable} usable: raise tp or pp{more}, or use --recompute full"
        )
    elif not g.fits_gpu and g.fits_host:
        out.append(
            f"snapshot + replicas ({_gib(g.deadpool_bytes)}) do not fit in GPU memory next to "
            f"training ({_gib(g.training_bytes)} of {usable}); run with "
            f"--deadpool-replica-device cpu: a node's {_gib(g.host_deadpool_bytes_per_node)} "
            f"fit in its {_gib(g.usable_host_bytes)} of usable host memory"
        )
    elif not g.fits_gpu:
        out.append(
            f"snapshot + replicas fit neither in GPU memory ({_gib(g.deadpool_bytes)} next to "
            f"{_gib(g.training_bytes)} of {usable}) nor in host memory "
            f"({_gib(g.host_deadpool_bytes_per_node)} per node of "
            f"{_gib(g.usable_host_bytes)}): lower --replicas or raise dp"
        )
    if it.dp_comm_s > it.compute_s:
        out.append(
            f"data-parallel traffic alone ({format_seconds(it.dp_comm_s)}, upper bound) exceeds "
            f"the iteration's compute ({format_seconds(it.compute_s)}): the job is "
            "communication-bound with or without DeadPool, whose replication adds "
            f"{format_seconds(it.replication_s)}; raise the batch per GPU"
        )
    elif it.replication_s + it.dp_comm_s > it.compute_s:
        out.append(
            f"replication ({format_seconds(it.replication_s)}) plus data-parallel traffic "
            f"({format_seconds(it.dp_comm_s)}) exceed the iteration's compute "
            f"({format_seconds(it.compute_s)}): replication cannot hide behind compute; raise "
            "the batch or lower --replicas"
        )
    if not g.fits_gpu and it.snapshot_copy_s > it.compute_s:
        out.append(
            "copying the snapshot to host memory takes "
            f"{format_seconds(it.snapshot_copy_s)}, longer than an iteration "
            f"({format_seconds(it.compute_s)})"
        )
    if report.spares < lay.ranks_per_node:
        out.append(
            f"{report.spares} spare rank(s) cannot replace a whole node of "
            f"{lay.ranks_per_node}: use --spares {lay.ranks_per_node} (one spare node) or more"
        )
    elif report.spares % lay.ranks_per_node:
        out.append(
            f"spares ({report.spares}) is not a whole number of nodes of {lay.ranks_per_node}"
        )
    if lay.tp > lay.ranks_per_node:
        out.append(
            f"tp ({lay.tp}) exceeds GPUs per node ({lay.ranks_per_node}): tensor-parallel "
            "traffic crosses nodes"
        )
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def format_seconds(t: float) -> str:
    """Seconds, or milli-/microseconds for short times."""
    if t >= 0.01:
        return f"{t:.2f} s"
    return f"{t * 1e3:.2f} ms" if t >= 1e-5 else f"{t * 1e6:.2f} us"
