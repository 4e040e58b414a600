"""`deadpool bench overhead`'s aggregation and JSON, with the training runs stubbed out: runs
interleaved off/on, warm-up iterations left out, time per iteration amortised (the mean gap between
iteration ends), and no ratio printed without a 95% interval."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import call_deadpool


def _fake_runner(calls: list[str]) -> Callable[..., SimpleNamespace]:
    """Stands in for LocalLauncher runs: 'on' iterations take 10% longer."""

    def runner(job: Any, run_dir: Path, *_: Any) -> SimpleNamespace:
        mode = "on" if job.deadpool.enabled else "off"
        calls.append(mode)
        base = 0.1 if mode == "off" else 0.11
        iters = job.train.iters
        records, end = [], 1000.0
        for i in range(1, iters + 1):
            step = 5.0 if i <= 2 else base + 0.001 * (i % 3)
            end += step  # iterations follow each other: the gap to the previous end is the step
            records.append(
                {
                    "iteration": i,
                    "time": end,
                    "loss": 3.0 - 0.1 * i,
                    "iter_time_s": step,
                    "replication_s": 0.0 if mode == "off" else 0.01,
                    "replica_bytes_sent": 0 if mode == "off" else 1000,
                    "committed_iteration": None,
                }
            )
        summary = {"final_param_digest": "abc", "wall_s": 1.0}
        return SimpleNamespace(returncode=0, records=records, summary=summary)

    return runner


@pytest.mark.timeout(60)
def test_bench_overhead_interleaves_and_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from megatron_deadpool.bench import overhead

    calls: list[str] = []
    monkeypatch.setattr(overhead, "_launch", _fake_runner(calls))
    out = tmp_path / "overhead.json"
    rc = call_deadpool("bench", "overhead", "--repeats", "2", "--iters", "6", "--json", str(out))
    assert rc == 0, capsys.readouterr().err
    assert calls == ["off", "on", "off", "on"]
    data = json.loads(out.read_text())
    assert {"off_iter_s", "on_iter_s", "ratio_median", "runs"} <= set(data)
    assert len(data["runs"]) == 4
    assert all(len(r["gaps_s"]) == 4 for r in data["runs"])  # 2 warm-up left out
    assert [(r["config"], r["repeat"]) for r in data["runs"]] == [
        ("off", 1), ("on", 1), ("off", 2), ("on", 2)
    ]  # fmt: skip
    # Timed iterations 3..6 take base + 0, 1, 2, 0 ms: amortised (their mean) base + 0.75 ms,
    # typical (their median) base + 0.5 ms.
    assert all(r["median_s"] == pytest.approx(r["amortised_s"] - 0.00025) for r in data["runs"])
    assert data["off_iter_s"] == pytest.approx(0.10075)
    assert data["on_iter_s"] == pytest.approx(0.11075)
    assert data["ratio_median"] == pytest.approx(0.11075 / 0.10075)
    assert data["losses_identical"] and data["digests_identical"]
    assert data["ratio_ci95"] is None  # two pairs are too few for a 95% interval
    out = capsys.readouterr().out
    assert "2 repeat(s) give no 95% interval (6 needed)" in out
    assert "1.1" not in out.splitlines()[-2]  # no ratio printed as a figure
