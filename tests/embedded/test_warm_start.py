"""`deadpool train` forks its processes from a warm interpreter (`hotswap/launch/warm_start.py`) and
trains exactly as with fresh interpreters: a failure run whose spare was forked ends with the
losses and final digest of a failure-free run of cold-started processes (DEADPOOL_WARM_START=0),
and says nothing about warm start unless it had to start a process cold."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import train_case

ARGS = ["--tp", "2", "--dp", "2"]


@pytest.mark.timeout(600)
def test_forked_workers_train_bitwise_as_fresh_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEADPOOL_WARM_START", "0")
    cold, cold_records, cold_summary = train_case(tmp_path / "cold", ARGS, "4")
    assert cold.returncode == 0, cold.stdout[-3000:] + cold.stderr[-3000:]
    assert not (tmp_path / "cold" / "logs" / "forkserver.log").exists()
    monkeypatch.delenv("DEADPOOL_WARM_START")
    warm, records, summary = train_case(
        tmp_path / "warm", [*ARGS, "--spares", "1", "--fail", "2@3"], "4"
    )
    assert warm.returncode == 0, warm.stdout[-3000:] + warm.stderr[-3000:]
    assert (tmp_path / "warm" / "logs" / "forkserver.log").exists()
    assert "warm start" not in warm.stdout + warm.stderr  # nothing started cold
    assert summary["recoveries"] and summary["recoveries"][0]["replaced_by"] == {"2": "s0"}
    assert [r["loss"] for r in records] == [r["loss"] for r in cold_records]
    assert summary["final_param_digest"] == cold_summary["final_param_digest"] is not None
