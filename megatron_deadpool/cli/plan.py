"""`deadpool plan`: the capacity planner's command line and text report (planning: `plan.py`).

    deadpool plan --model configs/models/gpt-65b.yaml --tp 4 --pp 8 --dp 16 \\
        --cluster configs/clusters/perlmutter.yaml --spares 4 --global-batch-size 1024 \\
        [--replicas k] [--use-tp-pp-dp-mapping] [--json plan.json]

Mixture of experts: --num-experts E [--moe-router-topk K] [--moe-ffn-hidden-size F]
[--moe-layer-freq N] with --expert-model-parallel-size EP [--expert-tensor-parallel-size ETP]
(Megatron-LM's flags; the file's model.num_experts, ... and parallel.ep / parallel.etp).

Defaults come from the model/job file: its `parallel` section for --tp/--pp/--dp, its
`deadpool` section for --replicas/--spares (no spares there: one spare node's worth), its
`train` section for the batch, its `cluster` section for --cluster (else generic figures).
With --megatron-args it prints the matching Megatron-LM arguments instead of the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path

from ..config.cluster import GB, GIB, ClusterConfig, load_cluster
from ..config.job import (
    JobConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    check_expert_sizes,
    load_job,
)
from ..config.numbers import number_arg
from ..errors import ConfigError
from ..planner.at_scale import SIZES, recovery_at_scale
from ..planner.capacity import (
    PlanReport,
    Recompute,
    Workload,
    format_seconds,
    plan,
)
from ..planner.megatron_line import MegatronLine, parse_megatron_line
from ..planner.recovery_terms import RECONSTRUCT
from ..planner.trace import load_trace
from ..replication.placement import Layout, RankOrder
from .plan_scale import (
    RESTART_S,
    STORAGE_GB_S,
    format_scale,
    plot_goodput,
    scale_dict,
    trace_goodput,
)

COUNT = number_arg(integer=True, minimum=1)
"""A count flag's type: an integer >= 1."""


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `deadpool plan`'s flags."""
    parser.add_argument(
        "--model",
        "--config",
        dest="model",
        metavar="YAML",
        help="model or job config (configs/models/*.yaml, configs/cpu-demo.yaml); optional "
        "with a Megatron-LM argument line after --, which then gives the model",
    )
    parser.add_argument(
        "megatron_line",
        nargs="*",
        metavar="-- MEGATRON_ARGS",
        help="a Megatron-LM pretrain_gpt.py argument line (after --): the model, tp, pp, ep, "
        "etp, batch and recompute as Megatron-LM reads them; the world size is not in it: "
        "give --dp (or the file's)",
    )
    parser.add_argument(
        "--tp",
        "--tensor-model-parallel-size",
        dest="tp",
        type=COUNT,
        help="tensor-parallel size (default: the file's)",
    )
    parser.add_argument(
        "--pp",
        "--pipeline-model-parallel-size",
        dest="pp",
        type=COUNT,
        help="pipeline-parallel size (default: the file's)",
    )
    parser.add_argument(
        "--context-parallel-size",
        "--cp",
        dest="cp",
        type=COUNT,
        help="context-parallel size: only 1 is modelled",
    )
    parser.add_argument("--dp", type=COUNT, help="data-parallel size (default: the file's)")
    moe = parser.add_argument_group(
        "mixture of experts (Megatron-LM's flags; default: the file's model/parallel sections)"
    )
    moe.add_argument("--num-experts", type=COUNT, metavar="E", help="experts per MoE layer")
    moe.add_argument(
        "--moe-router-topk", type=COUNT, metavar="K", help="experts per token (default 2)"
    )
    moe.add_argument(
        "--moe-ffn-hidden-size",
        type=COUNT,
        metavar="F",
        help="each expert's MLP hidden size (default: the MLP hidden size)",
    )
    moe.add_argument(
        "--moe-layer-freq",
        type=COUNT,
        metavar="N",
        help="one MoE layer every N layers, from the first (default 1: every layer)",
    )
    moe.add_argument(
        "--expert-model-parallel-size",
        "--ep",
        dest="ep",
        type=COUNT,
        metavar="EP",
        help="expert-parallel size: ranks an MoE layer's experts are split over (default 1)",
    )
    moe.add_argument(
        "--expert-tensor-parallel-size",
        "--etp",
        dest="etp",
        type=COUNT,
        metavar="ETP",
        help="tensor-parallel size of each expert (default: tp)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=COUNT,
        metavar="N",
        help="GPUs (ranks) per node = failure domain (default: the cluster's, else the file's "
        "deadpool.ranks_per_node, else tp)",
    )
    parser.add_argument("--replicas", type=COUNT, metavar="K", help="replicas k per shard")
    parser.add_argument(
        "--use-tp-pp-dp-mapping",
        action="store_true",
        help="Megatron-LM's rank order tp-pp-dp (data-parallel peers tp*pp ranks apart) "
        "instead of its default tp-dp-pp",
    )
    parser.add_argument(
        "--spares",
        type=number_arg(integer=True, minimum=0),
        metavar="S",
        help="spare ranks (default: the file's deadpool.spares, or one node's worth if 0)",
    )
    parser.add_argument(
        "--cluster", metavar="YAML", help="cluster description (configs/clusters/*.yaml)"
    )
    parser.add_argument(
        "--global-batch-size",
        type=COUNT,
        metavar="SEQS",
        help="sequences per iteration (default: the file's micro_batch_size x "
        "num_microbatches x dp)",
    )
    parser.add_argument(
        "--micro-batch-size", type=COUNT, metavar="SEQS", help="default: the file's"
    )
    parser.add_argument(
        "--mfu",
        type=number_arg(above=0, maximum=1),
        default=0.4,
        help="model FLOPs utilisation (0.4)",
    )
    parser.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        help="activation recomputation assumed (default: selective, or the Megatron line's)",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="also write the report as JSON ('-': stdout)"
    )
    parser.add_argument(
        "--megatron-args",
        action="store_true",
        help="print only the Megatron-LM arguments of this model, layout and batch (for "
        "MEGATRON_ARGS of scripts/slurm/*.sbatch)",
    )
    scale = parser.add_argument_group("recovery at scale and goodput over a failure trace")
    scale.add_argument(
        "--recovery-at",
        type=COUNT,
        nargs="+",
        metavar="GPUS",
        default=list(SIZES),
        help="GPU counts of the recovery table, dp scaled (default 512 1024 16384)",
    )
    scale.add_argument(
        "--trace",
        metavar="FILE",
        help="goodput over a failure trace: a trace file (CSV, see megatron_deadpool/planner/"
        "trace.py), a bundled one (llama3: Llama 3 405B's 419 interruptions in 54 days on "
        "16,384 GPUs) or synthetic:per_day=R[,days=D][,seed=S][,gpus=N]",
    )
    scale.add_argument(
        "--restart-s",
        metavar="S",
        type=number_arg(minimum=0, unit="seconds"),
        default=RESTART_S,
        help="a whole-job restart's cost in s (default 600: Meta FT-HSDP's 10-minute stall)",
    )
    scale.add_argument(
        "--checkpoint-interval-min",
        metavar="MIN",
        type=number_arg(above=0, unit="minutes"),
        help="checkpoint-restart's save interval in minutes (default: Young's optimum "
        "sqrt(2 x save cost x MTBF) for the trace)",
    )
    scale.add_argument(
        "--checkpoint-save-s",
        metavar="S",
        type=number_arg(minimum=0, unit="seconds"),
        help="training stalled by one persistent save in s (default: weights + optimizer "
        "state of every GPU at --storage-gb-s)",
    )
    scale.add_argument(
        "--storage-gb-s",
        metavar="GB_S",
        type=number_arg(above=0, unit="GB/s"),
        default=STORAGE_GB_S,
        help="checkpoint storage bandwidth in GB/s (default 2000: Llama 3's Tectonic, 2 TB/s "
        "sustained)",
    )
    scale.add_argument(
        "--plot", metavar="FILE", help="with --trace: draw the spare pool and ETTR here (PNG, SVG)"
    )


def run(args: argparse.Namespace) -> int:
    """Plan and print; bad input raises `ConfigError` (one line, exit 2 via the CLI)."""
    line = parse_megatron_line(args.megatron_line) if args.megatron_line else None
    if args.model is None and line is None:
        raise ConfigError(
            "--model: give a model or job file (configs/models/*.yaml), or a Megatron-LM "
            "argument line after -- (deadpool plan --dp 16 -- --num-layers 80 ...)"
        )
    job = load_job(args.model) if args.model else JobConfig()
    if line is not None:
        _agree(args, line)
        line_dp = _given(args.dp, job.parallel.dp)
        per_step = line.micro_batch_size * line_dp
        line_gbs = line.global_batch_size if line.global_batch_size is not None else per_step
        gbs = _given(args.global_batch_size, line_gbs)
        if gbs % per_step:
            raise ConfigError(
                f"global-batch-size ({gbs}) must be a multiple of micro-batch-size x dp = "
                f"{per_step}"
            )
        job = dataclasses.replace(
            job,
            model=line.model,
            parallel=dataclasses.replace(
                job.parallel, tp=line.tp, pp=line.pp, dp=line_dp, ep=line.ep, etp=line.etp
            ),
            train=dataclasses.replace(
                job.train,
                micro_batch_size=line.micro_batch_size,
                num_microbatches=gbs // per_step,
                **line.train,
            ),
        )
    if args.cp is not None and args.cp != 1:
        raise ConfigError(
            f"--context-parallel-size {args.cp}: the planner models context parallelism 1 "
            "only; plan with --context-parallel-size 1"
        )
    model = _model(job.model, args)
    cluster = load_cluster(args.cluster) if args.cluster else job.cluster
    tp = _given(args.tp, job.parallel.tp)
    pp = _given(args.pp, job.parallel.pp)
    dp = _given(args.dp, job.parallel.dp)
    ep = _given(args.ep, job.parallel.ep)
    etp = job.parallel.etp if args.etp is None else args.etp
    check_expert_sizes(model, tp=tp, ep=ep, etp=etp)
    parallel = ParallelConfig(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)  # Megatron's world rule
    gpus_per_node = _given(
        args.gpus_per_node,
        cluster.gpus_per_node if cluster is not None else _given(job.deadpool.ranks_per_node, tp),
    )
    if cluster is None:
        cluster = ClusterConfig(site="generic", gpus_per_node=gpus_per_node)
    elif args.gpus_per_node is not None and args.gpus_per_node != cluster.gpus_per_node:
        raise ConfigError(
            f"--gpus-per-node {args.gpus_per_node} contradicts cluster {cluster.site} "
            f"({cluster.gpus_per_node} GPUs per node)"
        )
    tp_pp_dp = args.use_tp_pp_dp_mapping or (line is not None and line.tp_pp_dp)
    order = RankOrder.TP_PP_DP if tp_pp_dp else RankOrder.TP_DP_PP
    layout = Layout(
        tp=tp,
        pp=pp,
        dp=dp,
        ranks_per_node=gpus_per_node,
        order=order,
        ep=parallel.ep,
        etp=parallel.etp,
    )
    replicas = _given(args.replicas, job.deadpool.replicas)
    spares = args.spares if args.spares is not None else (job.deadpool.spares or gpus_per_node)
    mbs = _given(args.micro_batch_size, job.train.micro_batch_size)
    # with a Megatron line, the file's train section holds the line's batch (above)
    gbs = _given(
        args.global_batch_size, job.train.micro_batch_size * job.train.num_microbatches * dp
    )
    recompute: Recompute = args.recompute or (line.recompute if line is not None else "selective")
    workload = Workload(
        global_batch_size=gbs, micro_batch_size=mbs, mfu=args.mfu, recompute=recompute
    )
    report = plan(
        model,
        layout,
        replicas=replicas,
        spares=spares,
        cluster=cluster,
        workload=workload,
        deadpool=job.deadpool,
    )
    if args.megatron_args:
        print(shlex.join(megatron_args(model, layout, workload, job.train)))
        return 0
    scaled, skipped = recovery_at_scale(report, tuple(args.recovery_at))
    result = report.to_dict()
    result["recovery_at_scale"] = scale_dict(scaled, skipped)
    text = [format_report(report, title=Path(args.model or "megatron-lm args").name)]
    text += format_scale(scaled, skipped)
    if args.trace:
        trace = load_trace(args.trace)
        goodput, lines = trace_goodput(report, trace, args)
        result["goodput"] = goodput
        text += lines
        if args.plot:
            result["goodput"]["plot"] = str(plot_goodput(goodput, args.plot))
            text.append(f"plot: {args.plot}")
    elif args.plot:
        raise ConfigError("--plot: draws the goodput over a trace: give --trace as well")
    data = json.dumps(result, indent=2, sort_keys=True)
    if args.json == "-":
        print(data)
        return 0
    print("\n".join(text))
    if args.json:
        try:
            Path(args.json).write_text(data + "\n")
        except OSError as exc:
            raise ConfigError(f"--json: cannot write {args.json}: {exc.strerror}") from None
    return 0


def _agree(args: argparse.Namespace, line: MegatronLine) -> None:
    """Flags given both on the command line and in the Megatron line must say the same."""
    pairs = (
        ("--tp", args.tp, "--tensor-model-parallel-size", line.tp),
        ("--pp", args.pp, "--pipeline-model-parallel-size", line.pp),
        ("--expert-model-parallel-size", args.ep, "--expert-model-parallel-size", line.ep),
        ("--expert-tensor-parallel-size", args.etp, "--expert-tensor-parallel-size", line.etp),
        ("--micro-batch-size", args.micro_batch_size, "--micro-batch-size", line.micro_batch_size),
        (
            "--global-batch-size",
            args.global_batch_size,
            "--global-batch-size",
            line.global_batch_size,
        ),
    )
    for flag, given, in_line, value in pairs:
        if given is not None and value is not None and given != value:
            raise ConfigError(
                f"{flag} {given} contradicts the Megatron-LM line's {in_line} {value}: give "
                "it in one place"
            )


def _model(model: ModelConfig, args: argparse.Namespace) -> ModelConfig:
    """The file's model with the MoE flags given on the command line (validated again)."""
    names = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq")
    given = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    model = dataclasses.replace(model, **given) if given else model
    if args.moe_router_topk is not None and model.num_experts is None:
        raise ConfigError(
            "--moe-router-topk applies to MoE models only: give --num-experts (or the model "
            "file's model.num_experts) as well, or drop it"
        )
    return model


def _given(value: int | None, default: int) -> int:
    """A flag's value when it was given (0 included: a flag's bounds refuse it), else the
    default: never `value or default`, which would turn a given 0 into the default."""
    return default if value is None else value


def megatron_args(
    model: ModelConfig, layout: Layout, workload: Workload, train: TrainConfig
) -> list[str]:
    """Megatron-LM `pretrain_gpt.py` arguments for `model` on `layout` (mock data, bf16,
    distributed optimizer, the recompute the plan assumed); DeadPool's flags are not included."""
    out = [
        f"--num-layers={model.num_layers}",
        f"--hidden-size={model.hidden_size}",
        f"--num-attention-heads={model.num_attention_heads}",
        f"--ffn-hidden-size={model.ffn}",
        f"--seq-length={model.seq_length}",
        f"--max-position-embeddings={model.seq_length}",
        f"--position-embedding-type={model.position_embedding_type}",
        f"--normalization={model.normalization}",
    ]
    if model.num_query_groups:
        out += ["--group-query-attention", f"--num-query-groups={model.num_query_groups}"]
    if model.swiglu:
        out.append("--swiglu")
    if not model.add_bias_linear:
        out.append("--disable-bias-linear")
    if not model.tie_embeddings:
        out.append("--untie-embeddings-and-output-weights")
    if model.num_experts is not None:
        out += [
            f"--num-experts={model.num_experts}",
            f"--moe-router-topk={model.moe_router_topk}",
            f"--moe-ffn-hidden-size={model.moe_ffn}",
            f"--moe-layer-freq={model.moe_layer_freq}",
            f"--expert-model-parallel-size={layout.ep}",
            f"--expert-tensor-parallel-size={layout.expert_tp}",
        ]
        if model.moe_router_topk == 1:  # TransformerConfig refuses top-1 without it
            out.append("--moe-router-pre-softmax")
    out += [
        f"--tensor-model-parallel-size={layout.tp}",
        f"--pipeline-model-parallel-size={layout.pp}",
        *(["--use-tp-pp-dp-mapping"] if layout.order is RankOrder.TP_PP_DP else []),
        *(["--sequence-parallel"] if layout.tp > 1 else []),
        "--use-distributed-optimizer",
        "--bf16",
        f"--micro-batch-size={workload.micro_batch_size}",
        f"--global-batch-size={workload.global_batch_size}",
    ]
    if workload.recompute == "selective":
        out.append("--recompute-activations")
    elif workload.recompute == "full":
        out += ["--recompute-granularity=full", "--recompute-method=uniform"]
        out.append("--recompute-num-layers=1")
    out += [
        "--mock-data",
        "--tokenizer-type=NullTokenizer",
        f"--vocab-size={model.vocab_size}",
        f"--train-iters={train.iters}",
        f"--lr={train.lr}",
        f"--lr-warmup-iters={train.lr_warmup_iters}",
        f"--seed={train.seed}",
    ]
    return out


def _bytes(n: float) -> str:
    """Binary units for memory."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _traffic(n: float) -> str:
    """Decimal units for network traffic (bandwidths are in GB/s)."""
    for unit, size in (("TB", 10**12), ("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def format_report(report: PlanReport, *, title: str = "") -> str:
    """The report as readable text."""
    r, lay, g, it, c = report, report.layout, report.per_gpu, report.per_iteration, report.cluster
    m, cov, w = r.model, r.coverage, r.workload
    kinds = [
        "SwiGLU" if m.swiglu else "GeLU",
        m.normalization,
        "rotary" if m.position_embedding_type == "rope" else "learned positions",
        "tied" if m.tie_embeddings else "untied",
    ]
    if m.num_query_groups:
        kinds.append(f"{m.num_query_groups} KV groups")
    if m.num_experts is not None:
        every = "every layer" if m.moe_layer_freq == 1 else f"every {m.moe_layer_freq} layers"
        kinds.append(
            f"MoE: {m.num_experts} experts of ffn {m.moe_ffn}, top-{m.moe_router_topk}, "
            f"{every}; {_count(r.active_params)} active per token"
        )
    experts = (
        f"; experts: etp {lay.expert_tp} x ep {lay.ep} x expert dp {lay.expert_dp}"
        if m.num_experts is not None
        else ""
    )
    site = f"{c.site} ({c.gpus_per_node}x {c.gpu_model} per node)"
    if c.site == "generic":
        site += " - no cluster given: generic figures, pass --cluster"
    lines: list[str] = []

    def head(label: str, text: str) -> None:
        lines.append(f"{label:<15}{text}")

    def row(label: str, value: str, note: str = "") -> None:
        lines.append(f"  {label:<44}{value:>12}{'  ' + note if note else ''}")

    lines.append(f"DeadPool plan{f' for {title}' if title else ''} on {site}")
    head(
        "layout",
        f"tp {lay.tp} x pp {lay.pp} x dp {lay.dp} = {lay.world_size} GPUs on {r.nodes} nodes "
        f"+ {r.spares} spare ranks ({r.spare_nodes:g} node(s)); "
        f"k = {r.replicas} replica(s) per shard; rank order {lay.order}{experts}",
    )
    head(
        "model",
        f"{_count(r.params)} parameters: {m.num_layers} layers, hidden {m.hidden_size}, "
        f"{m.num_attention_heads} heads, ffn {m.ffn}, vocab {m.vocab_size}, seq {m.seq_length}; "
        + ", ".join(kinds),
    )
    held = f", {_count(g.expert_params)} of them experts" if g.expert_params else ""
    head("per GPU", f"{_count(g.params)} parameters{held} ({g.stage})")
    row("weights (bf16, 2 B/param)", _bytes(g.weights_bytes))
    row("main grads (fp32, 4 B/param)", _bytes(g.grads_bytes))
    if g.expert_buffer_elements:
        row("optimizer shard (12 B/param, dense + expert)", _bytes(g.optimizer_shard_bytes))
        row(f"  dense: / dp {lay.dp}", _bytes(g.dense_optimizer_shard_bytes))
        row(f"  experts: / expert dp {lay.expert_dp}", _bytes(g.expert_optimizer_shard_bytes))
    else:
        row(f"optimizer shard (12 B/param / dp {lay.dp})", _bytes(g.optimizer_shard_bytes))
    row(f"activations ({w.recompute} recompute, estimate)", _bytes(g.activation_bytes))
    row("= training", _bytes(g.training_bytes))
    row(
        "+ local snapshot (= shard" + (", both parts)" if g.expert_buffer_elements else ")"),
        _bytes(g.snapshot_bytes),
    )
    row(f"+ replicas held ({r.replicas} x shard, double-buffered)", _bytes(g.replica_buffer_bytes))
    fits = "fits" if g.fits_gpu else "DOES NOT FIT"
    row(
        "= total with DeadPool",
        _bytes(g.total_bytes),
        f"of {_bytes(g.usable_gpu_bytes)} usable ({c.gpu_memory_gib:g} GiB - "
        f"{c.memory_reserve_fraction:.0%}): {fits}",
    )
    row(
        "or snapshots + replicas in host memory",
        _bytes(g.host_deadpool_bytes_per_node),
        f"per node, of {_bytes(g.usable_host_bytes)} usable: "
        + ("fits" if g.fits_host else "does not fit"),
    )
    head(
        "per iteration",
        f"{w.global_batch_size} sequences = {it.tokens:,} tokens (micro-batch "
        f"{w.micro_batch_size}); compute {format_seconds(it.compute_s)} at {w.mfu:.0%} MFU of "
        f"{c.gpu_tflops:g} TFLOP/s",
    )
    row(
        "replication per GPU",
        _traffic(it.replication_bytes),
        f"in {format_seconds(it.replication_s)} at {c.inter_node_gb_s_per_gpu:g} GB/s per GPU; "
        f"{_traffic(it.cluster_replication_bytes)} in all",
    )
    if it.expert_replication_bytes:
        row("  of which the expert shard", _traffic(it.expert_replication_bytes))
    row("overlap headroom (compute / replication)", f"{it.overlap_headroom:.1f}x")
    row(
        "data-parallel traffic per GPU",
        _traffic(it.dp_comm_bytes),
        f"in {format_seconds(it.dp_comm_s)} (upper bound)",
    )
    f = r.failure
    parts = " + ".join(f"{t.seconds:.1f} {t.name}" for t in f.terms if t.name in RECONSTRUCT)
    for name, rec in (("crash", r.recovery), ("hang", r.recovery_hang)):
        head(
            "recovery" if name == "crash" else "",
            f"{name}: {rec.total_s:.1f} s = detect {rec.detect_s:.2f} + survivors stop "
            f"{rec.stop_s:.2f} + agree {rec.agree_s:.2f} + reconstruct {rec.reconstruct_s:.1f} + "
            f"restore {rec.restore_s:.2f} (training resumes after {rec.resume_s:.1f} s) + failed "
            f"iteration {rec.first_iteration_s:.1f}",
        )
    head("", f"reconstruct: {parts}, the groups repaired in place (gloo's are today)")
    head(
        "",
        f"NCCL groups rebuilt, as today: reconstruct {f.rebuilt_reconstruct_s:.1f} s, crash "
        f"{f.rebuild_total_s:.1f} s; each term's source: the table below",
    )
    head(
        "",
        f"restore: a newcomer receives {_traffic(r.recovery.restore_bytes)} (bf16 weights + "
        "optimizer shard" + (", dense and expert parts)" if g.expert_buffer_elements else ")"),
    )
    fatal = len(cov.fatal_pairs)
    detail = (
        "state kept for every pair"
        if not fatal
        else f"{fatal} of {cov.node_pairs} node pairs lose a shard, e.g. nodes "
        + ", ".join(f"{a}+{b}" for a, b in cov.fatal_pairs[:3])
    )
    state = "kept" if cov.single_node else "LOST"
    spare_nodes = r.spares // lay.ranks_per_node
    head(
        "failures",
        f"any single node: {_yes(r.survives_any_node)} (state {state}; spares for "
        f"{spare_nodes} node(s))",
    )
    head(
        "",
        f"any two nodes: {_yes(r.survives_any_two_nodes)} ({detail}; checked by {cov.method})",
    )
    head(
        "",
        f"any {cov.guaranteed_node_failures} simultaneous node failure(s) keep all optimizer "
        "state",
    )
    lines.extend(f"WARNING: {text}" for text in r.warnings)
    return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
