"""Megatron-LM's own resilience flags next to `--deadpool` (interplay.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlm import fake_megatron_tree

from megatron_deadpool.config.deadpool import DeadpoolConfig
from megatron_deadpool.errors import ConfigError
from megatron_deadpool.megatron_lm.interplay import check_megatron_flags

ON, OFF = DeadpoolConfig(enabled=True), DeadpoolConfig()


def test_in_process_restart_and_async_save_are_refused_with_deadpool_only() -> None:
    with pytest.raises(ConfigError, match=r"^--inprocess-restart: .*drop --inprocess-restart"):
        check_megatron_flags(["--num-layers", "2", "--inprocess-restart"], ON)
    check_megatron_flags(["--inprocess-restart"], OFF)  # Megatron's own, DeadPool is off
    really_async = ["--async-save", "--use-persistent-ckpt-worker"]
    with pytest.raises(
        ConfigError, match=r"^--async-save with --use-persistent-ckpt-worker: .*drop --async-save"
    ):
        check_megatron_flags([*really_async, "--ckpt-format", "torch_dist"], ON)
    check_megatron_flags(really_async, OFF)
    check_megatron_flags(["--async-save"], ON)  # Megatron turns it off: a synchronous save
    for combinable in (
        ["--verify-integrity"],
        ["--rerun-mode", "validate_results", "--error-injection-rate", "1"],
        ["--fault-injector-ranks", "1", "--fault-injector-fault-types", "hang"],
    ):
        check_megatron_flags(combinable, ON)


def test_the_runner_refuses_before_the_script_runs(tmp_path: Path) -> None:
    """Megatron creates in-process restart's store in the script itself, before `pretrain`:
    the refusal comes first, in one line."""
    fake_megatron_tree(tmp_path, (0, 19, 1))
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_deadpool.megatron_lm", str(tmp_path / "pretrain_gpt.py"),
         "--inprocess-restart", "--deadpool", "--deadpool-spares", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "the script ran" not in proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("deadpool: error: --inprocess-restart: ")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spares", ["0", "1"])
def test_the_launcher_refuses_before_any_process_starts(tmp_path: Path, spares: str) -> None:
    """`deadpool megatron-lm ... --deadpool --inprocess-restart`: a job error every rank would
    hit the same way. The launcher refuses it in one line, exit 2, before starting a rank or
    handing out a spare - with or without spares (it was "OUT OF REDUNDANCY" with none, and a
    spare spent on it with one)."""
    from conftest import run_deadpool

    fake_megatron_tree(tmp_path, (0, 19, 1))
    run_dir = tmp_path / "run"
    proc = run_deadpool(
        "megatron-lm", "--nproc-per-node", "2", "--run-dir", str(run_dir),
        str(tmp_path / "pretrain_gpt.py"), "--inprocess-restart",
        "--deadpool", "--deadpool-spares", spares, "--deadpool-ranks-per-node", "1",
        timeout=100,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("deadpool: error: --inprocess-restart: "), line
    assert "OUT OF REDUNDANCY" not in proc.stdout and "spare" not in proc.stdout, proc.stdout
    assert not list(run_dir.glob("*.log")), "a process was started"
