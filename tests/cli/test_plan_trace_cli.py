"""`deadpool plan`'s recovery-at-scale table, `--trace` goodput and plot, and a Megatron-LM
argument line after `--` (megatron_deadpool/cli/plan.py, cli/plan_scale.py) through the real
`deadpool` command; bad input is one line and exit code 2."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from conftest import REPO_ROOT, call_deadpool

from megatron_deadpool.planner import measured

MODEL = str(REPO_ROOT / "configs" / "models" / "gpt-65b.yaml")
PERLMUTTER = str(REPO_ROOT / "configs" / "clusters" / "perlmutter.yaml")
BASE = ["--cluster", PERLMUTTER, "--tp", "4", "--pp", "8", "--dp", "16"]
TINY_LINE = [
    "--num-layers=2", "--hidden-size=64", "--num-attention-heads=4", "--seq-length=64",
    "--vocab-size=128",
]  # fmt: skip
"""A tiny model's Megatron-LM line (argparse keeps an option's last value)."""


@pytest.mark.timeout(60)
def test_recovery_table_prints_a_source_per_term(capsys: pytest.CaptureFixture[str]) -> None:
    assert call_deadpool("plan", "--model", MODEL, *BASE, "--global-batch-size", "1024") == 0
    text = capsys.readouterr().out
    table = text[text.index("recovery at scale") :].splitlines()
    assert "512 GPUs" in table[1] and "1,024 GPUs" in table[1] and "16,384 GPUs" in table[1]
    names = ("detect", "agree", "newcomer builds", "repair communicators", "newcomer joins")
    for name in (*names, "transfer shard"):
        row = next(line for line in table if line.strip().startswith(name))
        assert "[" in row and "]" in row, row  # [kind] source
    for cited in ("TrainMover", "2607.01646", "FT-HSDP", "nccl#1646", "#3186"):
        assert cited in text
    assert "target: misses the 10 s target at 1,024 GPUs" in text and "failed iteration" in text


@pytest.mark.timeout(60)
def test_recovery_table_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", MODEL, *BASE, "--global-batch-size", "128", "--json", "-"]
    assert call_deadpool(*argv, "--recovery-at", "1024", "1000") == 0
    data = json.loads(capsys.readouterr().out)["recovery_at_scale"]
    (size,) = data["sizes"]
    assert size["gpus"] == 1024
    assert size["total_s"] == pytest.approx(sum(t["seconds"] for t in size["terms"]))
    # 2 B parameters per GPU: the newcomer's start-up (assumed ~10 s) misses the target alone
    assert size["verdict"].startswith("misses") and "newcomer builds" in size["verdict"]
    assert all(t["kind"] and t["source"] for t in size["terms"])
    assert data["skipped"] == ["1,000 GPUs: not a multiple of tp x pp = 32"]


@pytest.mark.timeout(120)
def test_llama3_trace_three_ettrs_and_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    png, out = tmp_path / "goodput.png", tmp_path / "plan.json"
    argv = [*BASE, "--global-batch-size", "1024", "--spares", "64", "--trace", "llama3"]
    assert (
        call_deadpool("plan", "--model", MODEL, *argv, "--plot", str(png), "--json", str(out)) == 0
    )
    text = capsys.readouterr().out
    assert "goodput over llama3: 419 interruptions in 1296 h" in text
    assert "meets the 0.99 target" in text
    plan = json.loads(out.read_text())
    data = plan["goodput"]
    ways = data["ways"]
    # a recovery costs what the table's terms at the trace's size add up to, the build included
    at = next(s for s in plan["recovery_at_scale"]["sizes"] if s["gpus"] == 16384)
    terms = {t["name"]: t["seconds"] for t in at["terms"]}
    recover = ("survivors stop", "agree", "newcomer builds", "repair communicators")
    want = sum(terms[n] for n in (*recover, "newcomer joins", "transfer shard"))
    assert terms["newcomer builds"] > 0 and data["costs"]["recover_s"] == pytest.approx(want)
    # a lost node: the heartbeat timeout and the plan waiters' wake-up instead of a crash's
    # detection and stop
    wake = measured.plan_wake_s(16384 + 64)  # with the spares
    assert data["costs"]["detect_process_s"] == terms["detect"]
    assert data["costs"]["detect_node_s"] == pytest.approx(10 + wake - terms["survivors stop"])
    assert data["gpus"] == 16384 and data["trace"]["interruptions"] == 419
    assert ways["respawn"]["ettr"] >= 0.99
    assert ways["respawn"]["ettr"] >= ways["spares"]["ettr"] > ways["restart"]["ettr"]
    assert 0.8 < ways["restart"]["ettr"] < 0.95  # Meta: ~90% with checkpoint-restart
    assert ways["respawn"]["respawns"] == 63 and ways["respawn"]["nodes_lost"] == 356
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(60)
def test_one_spare_node_runs_out_and_restarts(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*BASE, "--global-batch-size", "1024", "--spares", "4", "--trace", "llama3"]
    assert call_deadpool("plan", "--model", MODEL, *argv, "--json", "-") == 0
    ways = json.loads(capsys.readouterr().out)["goodput"]["ways"]
    assert ways["respawn"]["restarts"] > 50 and ways["respawn"]["ettr"] < 0.99


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("trace", "message"),
    [
        ("nope.csv", "--trace nope.csv: cannot read it"),
        ("bad-header", "the header must be time_h,cause,scope,permanent"),
        ("bad-scope", "line 3: scope 'rack' is not one of process, node, hang"),
        ("no-duration", "'# duration_h:' is missing"),
        ("synthetic:per_day=x", "expected a finite number"),
    ],
)
def test_bad_traces_are_one_line_and_exit_2(
    trace: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad-header").write_text("# duration_h: 5\ntime,cause\n")
    (tmp_path / "bad-scope").write_text(
        "# duration_h: 5\ntime_h,cause,scope,permanent\n1,x,rack,no\n"
    )
    (tmp_path / "no-duration").write_text("time_h,cause,scope,permanent\n")
    assert call_deadpool("plan", "--model", MODEL, *BASE, "--trace", trace) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.timeout(60)
def test_plot_without_a_trace_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert call_deadpool("plan", "--model", MODEL, *BASE, "--plot", "x.png") == 2
    assert "give --trace" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--num-experts", "8", "--expert-model-parallel-size", "4"],
        ["--use-tp-pp-dp-mapping", "--recompute", "full"],
    ],
)
def test_the_printed_megatron_line_plans_the_same(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--model", MODEL, *BASE, "--global-batch-size", "1024", *extra]
    assert call_deadpool(*argv, "--megatron-args") == 0
    line = shlex.split(capsys.readouterr().out)
    assert call_deadpool(*argv, "--json", "-") == 0
    expected = json.loads(capsys.readouterr().out)
    # no model file: the line gives the model; dp and the cluster come from the flags
    again = ["plan", "--cluster", PERLMUTTER, "--dp", "16", "--json", "-", "--", *line]
    assert call_deadpool(*again) == 0
    assert json.loads(capsys.readouterr().out) == expected
    # and it prints the same line back
    assert (
        call_deadpool("plan", "--cluster", PERLMUTTER, "--dp", "16", "--megatron-args", "--", *line)
        == 0
    )
    assert shlex.split(capsys.readouterr().out) == line


@pytest.mark.timeout(60)
def test_megatron_spellings_of_tp_and_pp(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        "--model",
        MODEL,
        "--cluster",
        PERLMUTTER,
        "--tensor-model-parallel-size",
        "4",
        "--pipeline-model-parallel-size",
        "8",
        "--context-parallel-size",
        "1",
        "--dp",
        "16",
        "--json",
        "-",
    ]
    assert call_deadpool(*argv) == 0
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert (layout["tp"], layout["pp"], layout["dp"]) == (4, 8, 16)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dp", "2"], "--model: give a model or job file"),
        (["--model", MODEL, "--context-parallel-size", "2"], "--context-parallel-size 2"),
        (
            ["--dp", "2", "--tp", "2", "--", *TINY_LINE, "--tensor-model-parallel-size=4"],
            "--tp 2 contradicts the Megatron-LM line's --tensor-model-parallel-size 4",
        ),
        (["--dp", "2", "--", "--num-layers=2"], "--hidden-size, --num-attention-heads"),
        (
            ["--dp", "16", "--", *TINY_LINE, "--global-batch-size=100"],
            "global-batch-size (100) must be a multiple of micro-batch-size x dp = 16",
        ),
        (["--dp", "2", "--", *TINY_LINE, "--vocab-size=x"], "--vocab-size"),
    ],
)
def test_bad_megatron_lines_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert call_deadpool("plan", *argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
