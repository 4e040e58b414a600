"""The planner on mixture-of-experts models with expert parallelism: parameter counts against
hand arithmetic and against Megatron-Core's own `GPTModel` and DDP buffers (two CPU ranks on
gloo), the memory and traffic of the dense and the expert optimizer shard, and the layouts
Megatron refuses, refused with one message naming the flag."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_deadpool.config.cluster import ClusterConfig
from megatron_deadpool.config.job import JobConfig, ModelConfig, ParallelConfig, job_from_mapping
from megatron_deadpool.errors import ConfigError
from megatron_deadpool.planner.capacity import Workload, plan
from megatron_deadpool.planner.paramcount import count_params
from megatron_deadpool.replication.placement import Layout, RankOrder

TINY_MOE = ModelConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
"""The CPU demo's 2 layers (hidden 64, 4 heads, GeLU, LayerNorm, biases, learned positions,
untied) with 4 experts of ffn 32 in every layer."""


def _plan(model: ModelConfig, layout: Layout, **changes: object) -> object:
    kwargs: dict[str, object] = {
        "replicas": 1,
        "spares": layout.ranks_per_node,
        "cluster": ClusterConfig(site="generic", gpus_per_node=layout.ranks_per_node),
        "workload": Workload(global_batch_size=8 * layout.dp),
    }
    kwargs.update(changes)
    return plan(model, layout, **kwargs)  # type: ignore[arg-type]


# ---- parameter counts -------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_moe_param_count_by_hand() -> None:
    h, v, s, e, f = 64, 128, 64, 4, 32
    attention = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h)  # two LayerNorms, QKV, proj
    router = e * h + e  # TopKRouter: weight E x h, bias E (add_bias_linear)
    expert = (h * f + f) + (f * h + h)  # fc1 + fc2 with biases
    outside = 2 * v * h + s * h + 2 * h  # embedding, output layer, positions, final norm
    counts = count_params(TINY_MOE)
    assert counts.total == 2 * (attention + router + e * expert) + outside == 88_456
    assert counts.active == 2 * (attention + router + 2 * expert) + outside == 71_688
    # tp 2, ep 2, etp 1: attention split over TP (norms, row bias replicated), router not
    # split; each rank holds 2 of the 4 experts, whole, in its expert buffer.
    split = count_params(TINY_MOE, tp=2, ep=2, etp=1)
    dense_layer = 2 * 2 * h + (h * 3 * h + 3 * h) // 2 + h * h // 2 + h + router
    assert split.per_stage_expert == (2 * 2 * expert,) == (16_768,)
    assert split.per_stage == (2 * dense_layer + v // 2 * h * 2 + s * h + 2 * h + 16_768,)
    assert split.per_gpu == 46_920
    # expert buffer: each tensor 64-aligned (fc1 bias 32 -> 64), padded to lcm(edp, 128)
    assert split.expert_buffer_numel(0, 4) == 2 * 2 * (h * f + 64 + f * h + h) == 16_896
    # ep 1 (etp = tp = 2): the experts are ordinary parameters of the dense buffer (allreduce
    # stays true), each split over TP like an MLP: fc1 and its bias halve, fc2's bias doesn't
    flat = count_params(TINY_MOE, tp=2, ep=1)
    assert flat.per_stage_expert == (0,) and flat.expert_buffer_numel(0, 4) == 0
    expert_tp2 = (expert - h) // 2 + h
    assert flat.per_stage == (2 * dense_layer + 2 * 4 * expert_tp2 + 12_416,) == (47_176,)


@pytest.mark.timeout(10)
def test_moe_layer_freq_puts_experts_in_every_nth_layer() -> None:
    m = dataclasses.replace(TINY_MOE, num_layers=4, moe_layer_freq=2)
    assert m.moe_layers == (True, False, True, False)
    dense = ModelConfig(num_layers=4)
    per_layer_dense = count_params(dense).total - count_params(ModelConfig(num_layers=2)).total
    assert count_params(m).total == count_params(TINY_MOE).total + per_layer_dense
    # pp 2: each stage has one MoE layer, so the expert buffers are equal
    two = count_params(m, pp=2, ep=2, etp=1)
    assert two.per_stage_expert[0] == two.per_stage_expert[1] > 0


_BUILD = textwrap.dedent("""
    import json, sys, torch, torch.nn.functional as F
    from megatron_deadpool.devices import cpu
    cpu.activate()
    rank, store_path, models = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.FileStore(store_path, 2), rank=rank, world_size=2)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    out = []
    for m, (tp, ep, etp) in models:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        cfg = TransformerConfig(
            num_layers=m["num_layers"], hidden_size=m["hidden_size"],
            num_attention_heads=m["num_attention_heads"], ffn_hidden_size=m["ffn_hidden_size"],
            num_query_groups=m["num_query_groups"], gated_linear_unit=m["swiglu"],
            activation_func=F.silu if m["swiglu"] else F.gelu, normalization=m["normalization"],
            add_bias_linear=m["add_bias_linear"], num_moe_experts=m["num_experts"],
            moe_router_topk=m["moe_router_topk"], moe_ffn_hidden_size=m["moe_ffn_hidden_size"],
            moe_layer_freq=m["moe_layer_freq"], moe_router_pre_softmax=m["moe_router_topk"] == 1,
            tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp, use_cpu_initialization=True)
        spec = get_gpt_decoder_block_spec(
            cfg, use_transformer_engine=False, normalization=m["normalization"])
        model = GPTModel(
            config=cfg, transformer_layer_spec=spec, vocab_size=m["vocab_size"],
            max_sequence_length=m["seq_length"],
            share_embeddings_and_output_weights=m["tie_embeddings"],
            position_embedding_type=m["position_embedding_type"])
        ddp = DDP(config=cfg, module=model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True))
        out.append([
            sum(p.numel() for p in model.parameters()),
            sum(b.numel for b in ddp.buffers),
            sum(b.numel for b in ddp.expert_parallel_buffers),
        ])
    print(json.dumps(out))
    """)


@pytest.mark.timeout(120)
def test_moe_counts_and_buffers_match_megatron(tmp_path: Path) -> None:
    """Two CPU ranks build Megatron-Core MoE GPTModels (local spec: `SequentialMLP` experts)
    wrapped in DDP with the distributed optimizer; rank 0's parameters and its dense and expert
    buffers must be what `count_params` says for (tp, ep, etp) on a world of 2."""
    llama_moe = ModelConfig(
        num_layers=4,
        ffn_hidden_size=96,
        num_query_groups=2,
        swiglu=True,
        normalization="RMSNorm",
        add_bias_linear=False,
        position_embedding_type="rope",
        num_experts=6,
        moe_router_topk=1,
        moe_ffn_hidden_size=32,
        moe_layer_freq=2,
    )
    cases = [  # (model, (tp, ep, etp)) on 2 ranks
        (TINY_MOE, (1, 1, 1)),  # ep 1: experts in the dense buffer, dp 2
        (TINY_MOE, (1, 2, 1)),  # ep 2: expert buffer, expert dp 1, dense dp 2
        (llama_moe, (2, 2, 1)),  # tp 2 x dp 1, experts whole on 2 ranks, every 2nd layer
        (llama_moe, (2, 1, 2)),  # tp 2, ep 1: experts split over etp 2, dense buffer
        (TINY_MOE, (2, 1, 1)),  # ep 1, etp 1 < tp 2: experts whole, still the dense buffer
    ]
    arg = json.dumps([(dataclasses.asdict(m), sizes) for m, sizes in cases])
    store = str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD, str(rank), store, arg],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=110) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-2000:]
    built = json.loads(outputs[0][0].strip().splitlines()[-1])
    expected = []
    for m, (tp, ep, etp) in cases:
        counts = count_params(m, tp=tp, ep=ep, etp=etp)
        dp, expert_dp = 2 // tp, 2 // (etp * ep)
        expected.append(
            [counts.per_gpu, counts.buffer_numel(0, dp), counts.expert_buffer_numel(0, expert_dp)]
        )
    assert built == expected


# ---- memory, traffic, restore -----------------------------------------------------------


@pytest.mark.timeout(30)
def test_moe_memory_and_traffic_by_hand() -> None:
    """tp 2 x dp 4 = 8 GPUs, ep 2, etp 1: dense shard over dp 4, expert shard over expert dp
    8 / (1 x 2) = 4; snapshot, replicas, replication and restore carry both."""
    layout = Layout(tp=2, pp=1, dp=4, ranks_per_node=2, ep=2, etp=1)
    assert layout.expert_dp == 4
    for k in (1, 2):
        r = _plan(TINY_MOE, layout, replicas=k)
        g, it = r.per_gpu, r.per_iteration
        counts = count_params(TINY_MOE, tp=2, ep=2, etp=1)
        dense, expert = counts.buffer_numel(0, 4), counts.expert_buffer_numel(0, 4)
        assert expert == 16_896 and g.expert_buffer_elements == expert
        assert g.params == 46_920 and g.expert_params == 16_768
        assert g.buffer_elements == dense + expert
        assert g.weights_bytes == 2 * (dense + expert) and g.grads_bytes == 4 * (dense + expert)
        assert g.dense_optimizer_shard_bytes == 12 * dense // 4
        assert g.expert_optimizer_shard_bytes == 12 * 16_896 // 4 == 50_688
        shard = g.dense_optimizer_shard_bytes + g.expert_optimizer_shard_bytes
        assert g.optimizer_shard_bytes == shard == g.snapshot_bytes
        assert g.replica_buffer_bytes == 2 * k * shard
        assert it.replication_bytes == k * shard and it.expert_replication_bytes == k * 50_688
        assert it.cluster_replication_bytes == 8 * k * shard
        assert r.recovery.restore_bytes == g.weights_bytes + shard
        dense_p = g.params - g.expert_params
        assert it.dp_comm_bytes == 6 * (dense_p * 3 // 4 + g.expert_params * 3 // 4)
        # FLOPs: the parameters a token is computed with (top-2 of 4 experts)
        assert r.active_params == 71_688 < r.params == 88_456
        flops = 6 * r.active_params * it.tokens
        assert it.compute_s == pytest.approx(flops / (8 * r.cluster.gpu_tflops * 1e12 * 0.4))


@pytest.mark.timeout(30)
def test_expert_shard_over_a_smaller_group_is_larger() -> None:
    """ep 8 on tp 1 x dp 16: the dense shard splits 16 ways, the expert one 16 / 8 = 2."""
    layout = Layout(tp=1, pp=1, dp=16, ranks_per_node=4, ep=8)
    model = dataclasses.replace(TINY_MOE, num_experts=8)
    g = _plan(model, layout).per_gpu
    counts = count_params(model, ep=8)
    assert layout.expert_dp == 2
    assert g.expert_optimizer_shard_bytes == 12 * counts.expert_buffer_numel(0, 2) // 2
    assert g.dense_optimizer_shard_bytes == 12 * counts.buffer_numel(0, 16) // 16


@pytest.mark.timeout(30)
def test_ep1_with_experts_keeps_one_buffer() -> None:
    layout = Layout(tp=2, pp=1, dp=4, ranks_per_node=2)
    r = _plan(TINY_MOE, layout)
    g = r.per_gpu
    assert g.expert_params == 0 and g.expert_buffer_elements == 0
    assert g.expert_optimizer_shard_bytes == 0 and r.per_iteration.expert_replication_bytes == 0
    counts = count_params(TINY_MOE, tp=2)
    assert g.params == counts.per_gpu and g.optimizer_shard_bytes == 12 * g.buffer_elements // 4
    assert r.active_params < r.params  # still routed: top-2 of 4 experts
    data = r.to_dict()
    assert data["layout"]["ep"] == 1 and data["layout"]["etp"] == 2
    assert data["model"]["num_experts"] == 4


@pytest.mark.timeout(30)
def test_dense_plan_is_unchanged_by_the_expert_fields() -> None:
    layout = Layout(tp=2, pp=1, dp=4, ranks_per_node=2)
    r = _plan(ModelConfig(), layout)
    assert r.active_params == r.params == 120_576
    assert r.per_gpu.expert_buffer_elements == 0
    assert r.to_dict()["layout"]["expert_dp"] == 4


# ---- refusals -----------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("model", "parallel", "message"),
    [
        ({"num_experts": 8}, {"tp": 2, "dp": 4, "ep": 3}, "must divide tp x dp"),
        ({"num_experts": 6}, {"tp": 1, "dp": 4, "ep": 4}, "parallel.ep (--expert-model-parallel"),
        ({"num_experts": 8}, {"tp": 2, "dp": 2, "ep": 8}, "lower ep or etp"),
        ({}, {"tp": 2, "dp": 2, "ep": 2}, "apply to MoE models only"),
        ({}, {"tp": 2, "dp": 2, "etp": 1}, "set model.num_experts (--num-experts)"),
        ({"num_experts": 4, "moe_router_topk": 5}, {}, "--moe-router-topk 5) exceeds"),
        ({"num_experts": 4, "moe_ffn_hidden_size": 33}, {"tp": 2}, "--expert-tensor-parallel"),
        ({"num_experts": 4, "moe_layer_freq": 3}, {}, "exceeds model.num_layers"),
        ({"moe_ffn_hidden_size": 32}, {}, "apply to MoE models only"),
        ({"num_experts": 0}, {}, "model.num_experts"),
    ],
)
def test_bad_expert_settings_are_refused(
    model: dict[str, object], parallel: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        job_from_mapping({"model": model, "parallel": parallel})
    assert isinstance(info.value, ValueError) and message in str(info.value)
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.timeout(10)
def test_megatrons_expert_order_rule_under_tp_pp_dp() -> None:
    """Megatron asserts expert dp == dp when the order does not end in pp and pp > 1."""
    order = RankOrder.TP_PP_DP
    bad = Layout(tp=2, pp=2, dp=4, ranks_per_node=4, order=order, ep=4)
    with pytest.raises(ConfigError, match="--use-tp-pp-dp-mapping with pp 2"):
        _plan(TINY_MOE, bad)
    good = Layout(tp=2, pp=2, dp=4, ranks_per_node=4, order=order, ep=2, etp=1)
    assert _plan(TINY_MOE, good).layout.expert_dp == 4


@pytest.mark.timeout(10)
def test_parallel_config_expert_sizes() -> None:
    p = ParallelConfig(tp=2, pp=2, dp=8, ep=4)
    assert p.expert_tp == 2 and p.expert_dp == 2
    assert ParallelConfig(tp=4, dp=2, ep=8, etp=1).expert_dp == 1
    job = JobConfig(model=TINY_MOE, parallel=ParallelConfig(tp=2, dp=4, ep=2, etp=1))
    assert job.parallel.expert_dp == 4


@pytest.mark.timeout(10)
def test_the_stage_with_the_experts_is_planned() -> None:
    """One MoE layer (freq 4 of 4 layers) of 4 experts of ffn 512 on pp 2, ep 2: stage 0 holds
    2 experts (2 x 66,112 parameters), more than stage 1's extra dense MLP layer (33,088), and
    its expert shard splits over expert dp 2 instead of dp 4: its GPUs are the ones planned."""
    model = dataclasses.replace(TINY_MOE, num_layers=4, moe_layer_freq=4, moe_ffn_hidden_size=512)
    assert model.moe_layers == (True, False, False, False)
    counts = count_params(model, pp=2, ep=2)
    assert counts.per_stage_expert == (2 * (64 * 512 + 512 + 512 * 64 + 64), 0) == (132_224, 0)
    r = _plan(model, Layout(tp=1, pp=2, dp=4, ranks_per_node=2, ep=2))
    assert r.per_gpu.stage.startswith("first of 2") and r.per_gpu.expert_params == 132_224
    assert r.per_gpu.params == counts.per_stage[0] > counts.per_stage[1]
