"""`deadpool plan` (megatron_deadpool/cli/plan.py) through the real `deadpool` command: its JSON,
its Megatron-LM arguments, and bad input as one line and exit code 2. The planner itself is
tested in tests/planner/test_plan.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO_ROOT, call_deadpool, run_deadpool

ROOT = REPO_ROOT
CONFIGS = ROOT / "configs"
PERLMUTTER = CONFIGS / "clusters" / "perlmutter.yaml"


@pytest.mark.timeout(60)
def test_cli_writes_json_with_the_documented_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    argv = [
        "--model",
        str(CONFIGS / "models" / "gpt-65b.yaml"),
        "--tp",
        "8",
        "--pp",
        "4",
        "--dp",
        "16",
        "--gpus-per-node",
        "4",
        "--replicas",
        "1",
        "--spares",
        "4",
        "--cluster",
        str(PERLMUTTER),
        "--global-batch-size",
        "1024",
        "--json",
        str(out),
    ]
    assert call_deadpool("plan", *argv) == 0
    text = capsys.readouterr().out
    assert "any single node: yes" in text and "tp 8 x pp 4 x dp 16 = 512 GPUs" in text
    data = json.loads(out.read_text())
    for key in ("params", "recovery_estimate_s", "warnings"):
        assert key in data
    for key in (
        "optimizer_shard_bytes",
        "replica_bytes",
        "weights_bytes",
        "grads_bytes",
        "snapshot_bytes",
    ):
        assert key in data["per_gpu"]
    for key in ("replication_bytes", "replication_s", "compute_s", "overlap_headroom"):
        assert key in data["per_iteration"]
    assert set(data["recovery"]["crash"]) >= {
        "detect_s",
        "agree_s",
        "reconstruct_s",
        "restore_s",
        "first_iteration_s",
    }
    terms = {t["name"]: t for t in data["recovery"]["terms"]}  # the crash line's, with sources
    assert sum(t["seconds"] for t in terms.values()) == pytest.approx(
        data["recovery"]["crash"]["total_s"]
    )
    assert all(t["source"] for t in terms.values()) and "newcomer builds" in terms
    assert data["recovery"]["rebuilt_total_s"] > data["recovery"]["crash"]["total_s"]
    assert data["failures"]["survives_any_node"] is True
    assert any("crosses nodes" in w for w in data["warnings"])  # tp 8 > 4 GPUs per node


@pytest.mark.timeout(60)
def test_installed_command_plans_the_cpu_demo_from_its_file() -> None:
    proc = run_deadpool("plan", "--model", str(CONFIGS / "cpu-demo.yaml"), "--json", "-")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["params"] == 120_576
    assert data["layout"] == {
        "tp": 2,
        "pp": 1,
        "dp": 2,
        "ep": 1,
        "etp": 2,
        "expert_dp": 2,
        "order": "tp-dp-pp",
        "world_size": 4,
        "gpus_per_node": 2,
        "nodes": 2,
        "replicas": 1,
        "spares": 1,
        "spare_nodes": 0.5,
    }
    assert data["failures"]["fatal_pairs"] == [[0, 1]]  # k = 1, two nodes: both copies gone


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "configs/models/nope.yaml"], "does not exist"),
        (["--tp", "3"], "must divide model.num_attention_heads"),
        (["--tp", "1", "--pp", "1", "--dp", "6", "--gpus-per-node", "4"], "must divide"),
        (["--tp", "4", "--pp", "8", "--dp", "1"], "data-parallel size is 1"),
        (
            [
                "--tp",
                "4",
                "--pp",
                "8",
                "--dp",
                "16",
                "--gpus-per-node",
                "8",
                "--cluster",
                str(PERLMUTTER),
            ],
            "contradicts",
        ),
        (["--tp", "4", "--pp", "8", "--dp", "16", "--global-batch-size", "100"], "multiple"),
        (["--tp", "4", "--pp", "8", "--dp", "16", "--global-batch-size", "64"], "num_microbatches"),
        (["--tp", "4", "--pp", "8", "--dp", "16", "--gpus-per-node", "64"], "lies entirely"),
        (["--tp", "4", "--pp", "8", "--dp", "16", "--replicas", "0"], "--replicas"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(
    extra: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(ROOT)
    assert call_deadpool("plan", "--model", "configs/models/gpt-65b.yaml", *extra) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(("deadpool: error:", "deadpool plan:"))
    assert message in err


@pytest.mark.timeout(30)
def test_cli_prints_megatron_lm_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--cluster", str(PERLMUTTER), "--global-batch-size", "1024"]
    llama = ["--model", str(CONFIGS / "models" / "gpt-65b.yaml"), "--tp", "4", "--pp", "8"]
    assert call_deadpool(*base, *llama, "--dp", "16", "--megatron-args") == 0
    args = capsys.readouterr().out.split()
    for expected in (
        "--num-layers=80",
        "--swiglu",
        "--normalization=RMSNorm",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--tensor-model-parallel-size=4",
        "--pipeline-model-parallel-size=8",
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--global-batch-size=1024",
        "--position-embedding-type=rope",
    ):
        assert expected in args
    gpt = ["--model", str(CONFIGS / "models" / "gpt-1.3b.yaml"), "--tp", "1", "--pp", "1"]
    assert call_deadpool(*base, *gpt, "--dp", "512", "--megatron-args") == 0
    args = capsys.readouterr().out.split()
    assert "--swiglu" not in args and "--untie-embeddings-and-output-weights" not in args
    assert "--sequence-parallel" not in args and "--normalization=LayerNorm" in args
    assert "--use-tp-pp-dp-mapping" not in args


@pytest.mark.timeout(60)
def test_cli_plans_megatrons_tp_pp_dp_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--use-tp-pp-dp-mapping`: the plan places replicas among the data-parallel peers of that
    order. 64 GPUs per node hold a whole tp 4 x dp 16 data-parallel group under Megatron's
    default order (refused), while under tp-pp-dp a group spans all 512 ranks: 8 nodes."""
    model = ["--model", str(CONFIGS / "models" / "gpt-65b.yaml")]
    layout = ["--tp", "4", "--pp", "8", "--dp", "16", "--gpus-per-node", "64", "--spares", "64"]
    assert call_deadpool("plan", *model, *layout) == 2
    assert "lies entirely" in capsys.readouterr().err
    out = tmp_path / "plan.json"
    mapped = [*model, *layout, "--use-tp-pp-dp-mapping"]
    assert call_deadpool("plan", *mapped, "--json", str(out)) == 0
    assert "rank order tp-pp-dp" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["layout"]["order"] == "tp-pp-dp" and data["layout"]["nodes"] == 8
    assert data["failures"]["survives_any_node"] is True
    assert call_deadpool("plan", *mapped, "--megatron-args") == 0
    assert "--use-tp-pp-dp-mapping" in capsys.readouterr().out.split()
