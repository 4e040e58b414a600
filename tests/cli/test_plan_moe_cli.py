"""`deadpool plan` on a mixture-of-experts model through the real command: Megatron-LM's MoE
flags and the model file's fields, the JSON's expert figures, the text's dense/expert split,
the Megatron-LM arguments, and bad expert layouts as one line and exit code 2. The arithmetic
is tested in tests/planner/test_moe.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from conftest import REPO_ROOT, call_deadpool

from megatron_deadpool.config.job_args import add_job_flags, job_from_args
from megatron_deadpool.errors import ConfigError

CONFIGS = REPO_ROOT / "configs"
PERLMUTTER = CONFIGS / "clusters" / "perlmutter.yaml"
MIXTRAL = CONFIGS / "models" / "moe-8x7b.yaml"
LAYOUT = ["--tp", "2", "--pp", "4", "--dp", "16", "--cluster", str(PERLMUTTER)]
EXPERTS = ["--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1"]


@pytest.mark.timeout(60)
def test_moe_plan_json_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    argv = ["--model", str(MIXTRAL), *LAYOUT, *EXPERTS, "--global-batch-size", "512"]
    assert call_deadpool("plan", *argv, "--json", str(out)) == 0
    text = capsys.readouterr().out
    assert "experts: etp 1 x ep 8 x expert dp 4" in text
    assert "MoE: 8 experts of ffn 14336, top-2, every layer; 12.88 B active per token" in text
    assert "46.70 B parameters" in text
    for line in ("dense: / dp 16", "experts: / expert dp 4", "of which the expert shard"):
        assert line in text
    data = json.loads(out.read_text())
    assert data["params"] == 46_702_792_704 and data["active_params"] == 12_879_925_248
    assert (data["layout"]["ep"], data["layout"]["etp"], data["layout"]["expert_dp"]) == (8, 1, 4)
    g = data["per_gpu"]
    assert g["optimizer_shard_bytes"] == (
        g["dense_optimizer_shard_bytes"] + g["expert_optimizer_shard_bytes"]
    )
    assert g["expert_params"] > 0 and g["expert_buffer_elements"] >= g["expert_params"]
    it = data["per_iteration"]
    assert it["replication_bytes"] == g["optimizer_shard_bytes"]  # k = 1: both shards
    assert it["expert_replication_bytes"] == g["expert_optimizer_shard_bytes"]
    crash = data["recovery"]["crash"]
    assert crash["restore_bytes"] == g["weights_bytes"] + g["optimizer_shard_bytes"]
    assert data["model"]["num_experts"] == 8 and data["model"]["moe_router_topk"] == 2


@pytest.mark.timeout(60)
def test_moe_flags_override_a_dense_file(capsys: pytest.CaptureFixture[str]) -> None:
    """--num-experts turns the 7B file into an MoE model; --ep 1 keeps one buffer."""
    argv = ["--model", str(CONFIGS / "models" / "gpt-7b.yaml"), "--tp", "2", "--dp", "32"]
    more = ["--num-experts", "4", "--moe-router-topk", "1", "--moe-ffn-hidden-size", "2752"]
    assert call_deadpool("plan", *argv, *more, "--moe-layer-freq", "2", "--json", "-") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["moe_layer_freq"] == 2 and data["layout"]["ep"] == 1
    assert data["per_gpu"]["expert_optimizer_shard_bytes"] == 0
    assert data["active_params"] < data["params"]


@pytest.mark.timeout(30)
def test_moe_fields_in_the_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "moe.yaml"
    job.write_text(
        "model: {num_experts: 4, moe_router_topk: 2, moe_ffn_hidden_size: 32}\n"
        "parallel: {tp: 2, dp: 4, ep: 2, etp: 1}\n"
        "deadpool: {ranks_per_node: 2}\n"
    )
    assert call_deadpool("plan", "--model", str(job), "--json", "-") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == 88_456 and data["per_gpu"]["expert_params"] == 16_768
    assert data["layout"]["expert_dp"] == 4


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--num-experts", "8", "--ep", "3"], "--expert-model-parallel-size 3) must divide"),
        (["--num-experts", "8", "--ep", "4", "--dp", "6"], "(--expert-model-parallel-size 4 x"),
        (["--num-experts", "6", "--ep", "4"], "must divide model.num_experts (6)"),
        (["--ep", "2"], "set model.num_experts (--num-experts)"),
        (["--moe-router-topk", "1"], "--moe-router-topk applies to MoE models only"),
        (["--num-experts", "8", "--moe-router-topk", "9"], "--moe-router-topk 9"),
        (["--num-experts", "8", "--ep", "8", "--dp", "4"], "must divide tp x dp = 2 x 4"),
        (["--num-experts", "8", "--ep", "4", "--pp", "2", "--use-tp-pp-dp-mapping"], "ep x etp"),
        (["--num-experts", "8", "--moe-ffn-hidden-size", "4095"], "--expert-tensor-parallel"),
        (["--num-experts", "8", "--ep", "8", "--dp", "8"], "expert data-parallel size 1"),
    ],
)
def test_bad_expert_layouts_are_one_line_and_exit_2(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--model", str(CONFIGS / "models" / "gpt-7b.yaml"), "--tp", "2", "--dp", "32"]
    assert call_deadpool("plan", *base, "--gpus-per-node", "4", *extra) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("deadpool: error:")
    assert message in err


@pytest.mark.timeout(30)
def test_moe_megatron_lm_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(MIXTRAL), *LAYOUT, *EXPERTS, "--global-batch-size", "512"]
    assert call_deadpool("plan", *argv, "--megatron-args") == 0
    args = capsys.readouterr().out.split()
    for expected in (
        "--num-experts=8",
        "--moe-router-topk=2",
        "--moe-ffn-hidden-size=14336",
        "--moe-layer-freq=1",
        "--expert-model-parallel-size=8",
        "--expert-tensor-parallel-size=1",
        "--sequence-parallel",
    ):
        assert expected in args
    assert "--moe-router-pre-softmax" not in args


@pytest.mark.timeout(10)
def test_the_embedded_job_takes_an_moe_model_at_tp_1_only() -> None:
    """The embedded job trains MoE models (tests/embedded/test_embedded_moe.py) with Megatron-Core's
    local MoE layers, which need sequence parallelism with tensor parallelism: a model file's
    experts are taken at tp 1, refused naming the way out at tp 2."""
    parser = argparse.ArgumentParser()
    add_job_flags(parser)
    job = job_from_args(parser.parse_args(["--config", str(MIXTRAL), "--tp", "1", "--dp", "8",
                                           "--ep", "8"]))  # fmt: skip
    assert (job.model.num_experts, job.parallel.ep) == (8, 8)
    with pytest.raises(ConfigError, match="train the MoE model at tp 1"):
        job_from_args(parser.parse_args(["--config", str(MIXTRAL), "--tp", "2"]))
