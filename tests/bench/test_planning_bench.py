"""`deadpool bench planning`: it times the steps it names at the size it is given, reports each
against its target, and refuses sizes it cannot lay out. (Whether the steps are right at 16,384
ranks is tested in tests/replication/test_placement.py and tests/hotswap/coordinator/test_rebuild.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import call_deadpool


@pytest.mark.timeout(120)
def test_bench_planning_reports_every_step_against_its_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "planning.json"
    assert call_deadpool("bench", "planning", "--ranks", "1024", "--repeats", "2", "--json",
                         str(out)) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert (data["ranks"], data["replicas"], data["repeats"]) == (1024, 2, 2)
    assert set(data["steps"]) == {"placement", "placement_dp", "rebuild"}
    for step in data["steps"].values():
        assert len(step["runs_s"]) == 2 and step["best_s"] == min(step["runs_s"])
        assert step["target_s"] > 0 and step["met"] == (step["best_s"] < step["target_s"])
    printed = capsys.readouterr().out
    assert "tp 8 x pp 4 x dp 32, 4 ranks per node" in printed
    assert "1016 re-registrations, one node lost" in printed


@pytest.mark.timeout(60)
def test_bench_planning_refuses_a_size_it_cannot_lay_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert call_deadpool("bench", "planning", "--ranks", "100") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--ranks" in line
