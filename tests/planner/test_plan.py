"""The capacity planner: parameter counts, memory, traffic, coverage and configs (its command,
`deadpool plan`, is tested in tests/cli/test_plan_cli.py)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_deadpool.config.cluster import GIB, ClusterConfig, load_cluster
from megatron_deadpool.config.job import ModelConfig, job_from_mapping, load_job
from megatron_deadpool.errors import ConfigError
from megatron_deadpool.planner.capacity import Workload, plan
from megatron_deadpool.planner.coverage import (
    fatal_node_pairs,
    fatal_node_pairs_brute_force,
    guaranteed_node_failures,
    node_coverage,
)
from megatron_deadpool.planner.paramcount import count_params
from megatron_deadpool.replication.placement import Layout, place_replicas

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
PERLMUTTER = CONFIGS / "clusters" / "perlmutter.yaml"
LLAMA_TINY: dict[str, object] = {
    "swiglu": True,
    "ffn_hidden_size": 96,
    "num_query_groups": 2,
    "tie_embeddings": False,
    "normalization": "RMSNorm",
    "add_bias_linear": False,
    "position_embedding_type": "rope",
}


# ---- parameter counts -------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_param_count_of_the_cpu_demo_by_hand() -> None:
    h, v, s, f = 64, 128, 64, 256
    norms = 2 * (h + h)  # two LayerNorms, weight + bias
    qkv = h * 3 * h + 3 * h
    proj = h * h + h
    fc1 = h * f + f
    fc2 = f * h + h
    layer = norms + qkv + proj + fc1 + fc2
    # embedding, positions, final LayerNorm, output layer (untied: the embedded job's default)
    total = 2 * layer + v * h + s * h + 2 * h + v * h
    assert total == 120_576
    assert count_params(ModelConfig()).total == total
    # TP 2: split matrices and column-parallel biases halve; norms, row biases and positions don't.
    split = h * 3 * h + 3 * h + h * h + h * f + f + f * h
    per_tp_layer = split // 2 + 2 * 2 * h + 2 * h
    demo = count_params(ModelConfig(), tp=2, pp=1)
    assert demo.per_stage == (2 * per_tp_layer + v // 2 * h + s * h + 2 * h + v // 2 * h,)
    # Tied embeddings: one matrix with pp 1; with pp 2 the last stage holds a copy.
    tied = ModelConfig(tie_embeddings=True)
    assert count_params(tied).total == total - v * h
    assert count_params(tied, pp=2).per_stage == (layer + v * h + s * h, layer + 2 * h + v * h)
    two = count_params(ModelConfig(), tp=1, pp=2)
    assert two.per_stage == (layer + v * h + s * h, layer + 2 * h + v * h)
    assert two.max_stage == 0 and two.per_gpu == two.per_stage[0]


@pytest.mark.timeout(10)
def test_param_count_llama_style_by_hand() -> None:
    m = ModelConfig(**LLAMA_TINY)
    h, v, f, heads, groups = 64, 128, 96, 4, 2
    d = h // heads
    layer = 2 * h + h * (heads + 2 * groups) * d + h * h + h * 2 * f + f * h
    assert count_params(m).total == 2 * layer + 2 * v * h + h


@pytest.mark.timeout(120)
def test_param_count_and_buffer_match_megatron() -> None:
    """Build real GPTModels + DDP buffers on CPU (in a subprocess: it initialises
    torch.distributed) and compare parameter counts and the distributed optimizer's buffer."""
    script = textwrap.dedent("""
        import json, sys, torch, torch.nn.functional as F
        from megatron_deadpool.devices import cpu
        cpu.activate()
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(1, 1)
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
        out = []
        for m in json.loads(sys.argv[1]):
            cfg = TransformerConfig(
                num_layers=m["num_layers"], hidden_size=m["hidden_size"],
                num_attention_heads=m["num_attention_heads"],
                ffn_hidden_size=m["ffn_hidden_size"], num_query_groups=m["num_query_groups"],
                gated_linear_unit=m["swiglu"], activation_func=F.silu if m["swiglu"] else F.gelu,
                normalization=m["normalization"], add_bias_linear=m["add_bias_linear"],
                use_cpu_initialization=True)
            model = GPTModel(
                config=cfg,
                transformer_layer_spec=get_gpt_layer_local_spec(normalization=m["normalization"]),
                vocab_size=m["vocab_size"], max_sequence_length=m["seq_length"],
                share_embeddings_and_output_weights=m["tie_embeddings"],
                position_embedding_type=m["position_embedding_type"])
            params = sum(p.numel() for p in model.parameters())
            ddp_cfg = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=True)
            ddp = DDP(config=cfg, ddp_config=ddp_cfg, module=model)
            out.append([params, sum(b.numel for b in ddp.buffers)])
        print(json.dumps(out))
        """)
    models = [
        ModelConfig(),
        ModelConfig(**LLAMA_TINY),  # type: ignore[arg-type]
        ModelConfig(num_layers=3, hidden_size=96, num_attention_heads=6, ffn_hidden_size=200),
        ModelConfig(num_layers=3, hidden_size=96, num_attention_heads=6, tie_embeddings=True),
    ]
    arg = json.dumps([dataclasses.asdict(m) for m in models])
    done = subprocess.run(
        [sys.executable, "-c", script, arg],
        check=False,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    expected = []
    for m in models:
        counts = count_params(m)
        expected.append([counts.total, counts.buffer_numel(0, 1)])
    assert built == expected
    assert any(params != buffer for params, buffer in built)  # padding was exercised


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("name", "billions"),
    [("1.3b", 1.28), ("7b", 6.74), ("13b", 13.02), ("30b", 32.53), ("65b", 65.29)],
)
def test_model_files_have_their_published_sizes(name: str, billions: float) -> None:
    total = count_params(load_job(CONFIGS / "models" / f"gpt-{name}.yaml").model).total
    assert total / 1e9 == pytest.approx(billions, abs=0.005)


# ---- memory and traffic -----------------------------------------------------------------


def _plan_65b(**changes: object) -> object:
    kwargs: dict[str, object] = {
        "replicas": 1,
        "spares": 4,
        "cluster": load_cluster(PERLMUTTER),
        "workload": Workload(global_batch_size=1024),
    }
    layout = changes.pop("layout", Layout(tp=4, pp=8, dp=16, ranks_per_node=4))
    kwargs.update(changes)
    return plan(load_job(CONFIGS / "models" / "gpt-65b.yaml").model, layout, **kwargs)


@pytest.mark.timeout(30)
def test_memory_accounting_by_hand() -> None:
    """bf16 weights 2 B, fp32 grads 4 B, Adam + fp32 main params 12 B over dp, k replicas."""
    for k in (1, 2):
        report = _plan_65b(replicas=k)
        g = report.per_gpu
        counts = count_params(report.model, tp=4, pp=8)
        p = counts.per_gpu
        assert g.params == p
        padded = g.buffer_elements  # Megatron's alignment padding: a few elements per tensor
        assert padded == counts.buffer_numel(counts.max_stage, 16)
        assert p <= padded < p * 1.0001 and padded % (16 * 128) == 0
        assert g.weights_bytes == 2 * padded
        assert g.grads_bytes == 4 * padded
        assert g.optimizer_shard_bytes == 12 * padded // 16
        assert g.snapshot_bytes == g.optimizer_shard_bytes
        assert g.replica_bytes == k * g.optimizer_shard_bytes
        assert g.replica_buffer_bytes == 2 * k * g.optimizer_shard_bytes
        assert g.total_bytes == g.training_bytes + g.snapshot_bytes + g.replica_buffer_bytes
        assert report.per_iteration.replication_bytes == k * g.optimizer_shard_bytes
        assert report.per_iteration.tokens == 1024 * 2048


@pytest.mark.timeout(30)
def test_65b_on_512_perlmutter_gpus_is_sane() -> None:
    r = _plan_65b()
    assert r.params == pytest.approx(65.3e9, rel=0.01)
    assert r.per_gpu.params == pytest.approx(65.3e9 / 32, rel=0.05)
    assert 1.3 * GIB < r.per_gpu.optimizer_shard_bytes < 1.6 * GIB
    assert r.per_gpu.fits_gpu and not r.warnings
    it = r.per_iteration
    assert 5 < it.compute_s < 30  # 6 x 65e9 x 2M tokens / (512 x 312 TF x 0.4) = 12.9 s
    assert it.replication_s < 0.2 and it.overlap_headroom > 50
    assert r.recovery.total_s < 40
    assert r.recovery.resume_s < r.recovery.total_s < r.recovery_hang.total_s
    assert r.coverage.method == "rule" and r.coverage.nodes == 128
    assert r.survives_any_node and not r.survives_any_two_nodes
    two = _plan_65b(replicas=2, spares=8)
    assert two.survives_any_two_nodes and two.coverage.guaranteed_node_failures >= 2


@pytest.mark.timeout(30)
def test_warnings_when_deadpool_does_not_fit_gpu_memory() -> None:
    base = _plan_65b()
    g = base.per_gpu
    between = (g.training_bytes + g.deadpool_bytes / 2) / GIB / 0.9
    small_gpu = dataclasses.replace(base.cluster, gpu_memory_gib=between)
    r = _plan_65b(cluster=small_gpu)
    assert not r.per_gpu.fits_gpu and r.per_gpu.fits_host
    assert any("--deadpool-replica-device cpu" in w for w in r.warnings)
    no_host = dataclasses.replace(small_gpu, host_memory_gib=1.0)
    r = _plan_65b(cluster=no_host)
    assert any("fit neither" in w for w in r.warnings)
    tiny = dataclasses.replace(base.cluster, gpu_memory_gib=8.0)
    assert any("training alone" in w for w in _plan_65b(cluster=tiny).warnings)
    assert any("spare" in w for w in _plan_65b(spares=1).warnings)


# ---- failure coverage -------------------------------------------------------------------

SMALL_LAYOUTS = [
    (1, 1, 8, 1, 1),
    (1, 1, 8, 1, 3),
    (2, 1, 8, 4, 1),
    (2, 2, 8, 4, 2),
    (2, 1, 6, 4, 2),
    (1, 2, 12, 3, 2),
    (4, 2, 16, 4, 1),
    (1, 1, 9, 3, 2),
    (2, 1, 4, 2, 1),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("tp", "pp", "dp", "rpn", "k"), SMALL_LAYOUTS)
def test_pair_rule_matches_brute_force(tp: int, pp: int, dp: int, rpn: int, k: int) -> None:
    placement = place_replicas(Layout(tp=tp, pp=pp, dp=dp, ranks_per_node=rpn), k)
    assert fatal_node_pairs(placement) == fatal_node_pairs_brute_force(placement)
    assert node_coverage(placement).single_node


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("tp", "pp", "dp", "rpn", "k"), SMALL_LAYOUTS)
def test_guaranteed_failures_match_brute_force(tp: int, pp: int, dp: int, rpn: int, k: int) -> None:
    layout = Layout(tp=tp, pp=pp, dp=dp, ranks_per_node=rpn)
    placement = place_replicas(layout, k)
    nodes = layout.world_size // rpn

    def all_survive(f: int) -> bool:
        return all(
            placement.survivable([r for n in dead for r in layout.domain_ranks(n)])
            for dead in itertools.combinations(range(nodes), f)
        )

    f = guaranteed_node_failures(placement)
    assert f >= 1 and all(all_survive(i) for i in range(1, f + 1))
    assert f == nodes or not all_survive(f + 1)


@pytest.mark.timeout(30)
def test_rule_matches_brute_force_on_a_large_layout() -> None:
    placement = place_replicas(Layout(tp=4, pp=2, dp=32, ranks_per_node=4), 1)  # 64 nodes
    cov = node_coverage(placement, brute_force_max_nodes=0)
    assert cov.method == "rule"
    assert set(cov.fatal_pairs) == fatal_node_pairs_brute_force(placement)


# ---- configs ----------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONFIGS))
)
def test_every_config_loads(path: Path) -> None:
    job = load_job(path)
    if path.parent.name == "clusters":
        assert load_cluster(path) == job.cluster


@pytest.mark.timeout(10)
def test_cpu_demo_config() -> None:
    job = load_job(CONFIGS / "cpu-demo.yaml")
    assert job.model == ModelConfig()  # the schema's new fields keep the demo unchanged
    assert (job.parallel.tp, job.parallel.pp, job.parallel.dp) == (2, 1, 2)
    assert job.train.iters == 8
    d = job.deadpool
    assert (d.enabled, d.spares, d.replicas, d.ranks_per_node) == (True, 1, 1, 2)
    assert job.cluster is None


@pytest.mark.timeout(10)
def test_cluster_schema_rejects_bad_values(tmp_path: Path) -> None:
    assert load_cluster(PERLMUTTER).inter_node_gb_s_per_gpu == 25.0
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        ClusterConfig(env=["no equals sign"])
    with pytest.raises(ConfigError, match="unknown key"):
        job_from_mapping({"cluster": {"gpus": 4}})
    with pytest.raises(ConfigError, match="ranks_per_node"):
        job_from_mapping({"cluster": {"gpus_per_node": 4}, "deadpool": {"ranks_per_node": 2}})
    bad = tmp_path / "c.yaml"
    bad.write_text("model: {}\n")
    with pytest.raises(ConfigError, match="cluster"):
        load_cluster(bad)
    with pytest.raises(ConfigError, match="num_query_groups"):
        ModelConfig(num_query_groups=3)


@pytest.mark.timeout(30)
def test_agreement_time_is_the_measured_one_at_the_jobs_size() -> None:
    from megatron_deadpool.planner import measured

    a = measured.AGREE_S
    assert measured.agree_s(64) == a[1024]  # below the smallest size measured
    assert measured.agree_s(2048) == pytest.approx((a[1024] + a[4096]) / 2)  # log2 midpoint
    assert measured.agree_s(16384) == a[16384]
    assert measured.agree_s(32768) == pytest.approx(2 * a[16384])  # one report per rank
    assert "deadpool bench control-plane" in measured.COMMAND
    r = _plan_65b()  # 512 ranks + 4 spares
    assert r.recovery.agree_s == pytest.approx(measured.agree_s(516))
    assert r.recovery_hang.agree_s == r.recovery.agree_s
