"""`deadpool train` end to end through the real CLI.

Two full runs (TP2 x DP2, 6 iterations; DeadPool on, then off) must give bit-identical losses
and final parameters; the DeadPool run must show each iteration's replication committed one
iteration behind. The DeadPool run is the session's shared failure-free run (conftest's
`failure_free`, which the hot-swap tests compare against). (Its answers to bad input:
tests/cli/test_train_cli.py.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import FAILURE_FREE_ARGS, TrainRun, run_deadpool

ITERS = 6


def _read_log(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert lines and lines[-1].get("event") == "summary", "the last JSON line is the summary"
    return lines[:-1], lines[-1]


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, failure_free: Callable[[int], TrainRun]
) -> dict[str, Any]:
    """The two full training runs of this file (each ~20 s on 2 cores): DeadPool on (the shared
    failure-free run, checked there to exit 0 without a traceback), then off."""
    _, records, summary = failure_free(ITERS)
    out: dict[str, Any] = {"on": {"records": records, "summary": summary}}
    d = tmp_path_factory.mktemp("train-off")
    log = d / "log.jsonl"
    proc = run_deadpool(
        "train", *FAILURE_FREE_ARGS, "--iters", str(ITERS), "--no-deadpool", "--json-log",
        str(log), "--run-dir", str(d / "run"), timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, f"DeadPool off: exit {proc.returncode}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    records, summary = _read_log(log)
    out["off"] = {"records": records, "summary": summary}
    return out


@pytest.mark.timeout(420)
def test_deadpool_on_and_off_train_bit_identically(runs: dict[str, Any]) -> None:
    on, off = runs["on"]["summary"], runs["off"]["summary"]
    assert on["returncode"] == off["returncode"] == 0
    assert on["iterations"] == off["iterations"] == ITERS
    assert len(on["losses"]) == ITERS
    assert on["losses"] == off["losses"]  # exact float equality, not approx
    assert on["final_param_digest"] is not None
    assert on["final_param_digest"] == off["final_param_digest"]
    assert on["dp_replicas_identical"] and off["dp_replicas_identical"]
    assert on["deadpool"] is True and off["deadpool"] is False


@pytest.mark.timeout(420)
def test_replication_commits_one_iteration_behind(runs: dict[str, Any]) -> None:
    records = runs["on"]["records"]
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert records[0]["committed_iteration"] is None  # round 1 still in flight
    for rec in records[1:]:
        assert rec["committed_iteration"] == rec["iteration"] - 1, rec
        assert rec["replica_bytes_sent"] > 0
    assert runs["on"]["summary"]["committed_iteration"] == ITERS  # the final round, drained
    for rec in runs["off"]["records"]:
        assert rec["committed_iteration"] is None and rec["replica_bytes_sent"] == 0


@pytest.mark.timeout(420)
def test_losses_fall(runs: dict[str, Any]) -> None:
    for mode in ("on", "off"):
        losses = runs[mode]["summary"]["losses"]
        assert losses[-1] < losses[0], (mode, losses)
        assert [r["loss"] for r in runs[mode]["records"]] == losses
