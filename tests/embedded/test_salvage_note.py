"""The launcher's own output after an end out of redundancy (exit 3): what the survivors saved
and the command that resumes from it - which does resume, to the failure-free run's parameters;
and a `--load` that finds nothing resumable says so (`hotswap/report/salvage_note.py`)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import TrainRun, run_deadpool, train_case

ITERS = "6"


@pytest.mark.timeout(900)
def test_an_exit_3_says_what_was_saved_and_its_resume_command_resumes(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    reference = failure_free(int(ITERS))[2]
    args = ["--tp", "2", "--dp", "2", "--spares", "0", "--fail", "2@4", "--save", "{ckpt}"]
    proc, _, _ = train_case(tmp_path / "failed", args, ITERS)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    save = tmp_path / "failed" / "ckpt"
    assert "out of redundancy: no spare left to replace rank(s) [2]" in lines, proc.stdout
    assert any(x.startswith(f"resumable in {save}: the snapshot set of iteration ") for x in lines)
    command = next(x for x in lines if x.startswith("resume with: "))
    argv = shlex.split(command.removeprefix("resume with: "))
    assert argv[:2] == ["deadpool", "train"], command
    log = tmp_path / "resumed.jsonl"
    resumed = run_deadpool(*argv[1:], "--json-log", str(log), "--run-dir",
                           str(tmp_path / "resumed"), timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads(log.read_text().splitlines()[-1])
    assert summary["final_param_digest"] == reference["final_param_digest"]


@pytest.mark.timeout(600)
def test_a_load_with_nothing_to_resume_says_so(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    args = ["--tp", "2", "--dp", "2", "--spares", "0", "--load", str(empty), "--save", str(empty)]
    proc, records, _ = train_case(tmp_path, args, "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"--load {empty}: nothing to resume there" in proc.stdout
    assert records[0]["iteration"] == 1
