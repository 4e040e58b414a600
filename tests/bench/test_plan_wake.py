"""`deadpool bench plan-wake` for real at a small size: the coordinator's `publish_plan` wakes
every blocked waiter of every process, plan after plan, and the figures are the publish's and the
last wake-up's (`megatron_deadpool/bench/scale/plan_wake.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import call_deadpool

from megatron_deadpool.bench.scale.plan_wake import measure


@pytest.mark.timeout(120)
def test_every_waiter_of_every_process_wakes_for_every_plan() -> None:
    result = measure(ranks=96, repeats=2, procs=3)
    assert result["ranks"] == 96 and len(result["wake_each_s"]) == 2
    for publish, wake in zip(result["publish_each_s"], result["wake_each_s"], strict=True):
        assert 0 < publish < 5 and 0 < wake < 5
    assert result["wake_s"] > 0 and result["publish_s"] > 0


@pytest.mark.timeout(120)
def test_the_cli_prints_and_writes_each_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "wake.json"
    argv = ["--ranks", "8", "16", "--repeats", "1", "--procs", "2", "--json", str(out)]
    assert call_deadpool("bench", "plan-wake", *argv) == 0
    assert "plan -> last survivor woken" in capsys.readouterr().out
    assert [s["ranks"] for s in json.loads(out.read_text())["sizes"]] == [8, 16]
