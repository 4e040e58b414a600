"""Watching a run: `--deadpool-metrics-file` and `deadpool report` on a real `deadpool train` run
with a spare taking a killed rank's slot (in-place respawn off)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import call_deadpool, train_case


@pytest.mark.timeout(600)
def test_metrics_file_and_report_of_a_run_with_a_recovery(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "deadpool.prom"
    args = ["--tp", "2", "--dp", "2", "--spares", "1", "--fail", "2@5",
            "--deadpool-respawn-limit", "0", "--deadpool-metrics-file", str(metrics)]  # fmt: skip
    proc, records, _ = train_case(tmp_path, args, "6")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = metrics.read_text().splitlines()
    assert "deadpool_recoveries_total 1" in lines and "deadpool_spares_available 0" in lines
    assert "deadpool_respawns_total 0" in lines
    assert f"deadpool_committed_iteration {records[-1]['committed_iteration']}" in lines
    assert any(x.startswith("deadpool_last_recovery_seconds ") for x in lines)
    assert "# TYPE deadpool_recoveries_total counter" in lines
    events = [json.loads(x) for x in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
    assert {e["v"] for e in events} == {1} and len({e["job"] for e in events}) == 1
    # The spare in rank 2's slot held no copy yet: one shard short after the kill, 0 once a
    # round after the restore iteration committed.
    (agreed,) = [e for e in events if e["event"] == "agreed"]
    assert agreed["under_replicated"] == [0], agreed  # rank 2 held rank 0's copy
    assert "deadpool_under_replicated_shards 0" in lines
    png = tmp_path / "run.png"
    capsys.readouterr()
    rc = call_deadpool("report", str(tmp_path / "logs"), "--json-log", str(tmp_path / "run.jsonl"),
                       "--plot", str(png))  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "process_dead" in out and "recovered" in out and "(1 spare(s), 0 respawn(s))" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert call_deadpool("report", str(tmp_path)) == 2  # no events.jsonl there
    # Without --json-log: the run folder's own iteration records (written by deadpool train).
    capsys.readouterr()
    assert call_deadpool("report", str(tmp_path / "logs")) == 0
    assert f"committed iteration at the end: {records[-1]['committed_iteration']}" in (
        capsys.readouterr().out
    )
