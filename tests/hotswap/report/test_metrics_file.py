"""The metrics file (`hotswap/report/metrics_file.py`) and the event log's schema (`hotswap/coordinator/events.py`):
the Prometheus text format with HELP/TYPE lines, written atomically; every event kind the code
writes is in the schema, and every entry carries the schema version and the job's id."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_deadpool.hotswap.coordinator.events import EVENTS, SCHEMA_VERSION, EventLog, job_id
from megatron_deadpool.hotswap.report.metrics_file import JobGauges, render, watch_events

PACKAGE = Path(__file__).resolve().parents[3] / "megatron_deadpool"


def test_render_writes_help_type_and_value_lines() -> None:
    text = render(JobGauges(spares_available=1, recoveries_total=2, respawns_total=1,
                            committed_iteration=7, replica_bytes_per_iteration=405264,
                            last_recovery_seconds=0.93, last_recovery_phases={"detect": 0.1}))  # fmt: skip
    lines = text.splitlines()
    for name, value in [("deadpool_spares_available", "1"), ("deadpool_recoveries_total", "2"),
                        ("deadpool_respawns_total", "1"), ("deadpool_committed_iteration", "7"),
                        ("deadpool_replica_bytes_per_iteration", "405264"),
                        ("deadpool_last_recovery_seconds", "0.93")]:  # fmt: skip
        assert f"{name} {value}" in lines, text
        assert lines.index(f"# TYPE {name} " + ("counter" if name.endswith("_total") else "gauge"))
        assert any(line.startswith(f"# HELP {name} ") for line in lines)
    assert 'deadpool_last_recovery_phase_seconds{phase="detect"} 0.1' in lines
    # No value yet: no sample (a scraper would otherwise read a made-up 0).
    assert "deadpool_committed_iteration" not in render(JobGauges())
    assert all(re.fullmatch(r"(# (HELP|TYPE) \w+ .+|\w+(\{\w+=\"\w+\"\})? [0-9.e+-]+)", line)
               for line in lines), text  # fmt: skip


def test_the_file_follows_each_event_and_is_replaced_whole(tmp_path: Path) -> None:
    events = EventLog(tmp_path / "events.jsonl", job=job_id("secret"))
    spares = [1]
    path = tmp_path / "deadpool.prom"
    watch_events(events, path, lambda: spares[0])
    assert "deadpool_spares_available 1" in path.read_text()
    spares[0] = 0
    events("recovered", generation=1, dead_ranks=[2], replaced_by={"2": "s0"}, respawned={},
           phases_s={"detect": 0.1, "agree": 0.2}, total_s=0.3)  # fmt: skip
    text = path.read_text()
    assert "deadpool_recoveries_total 1" in text and "deadpool_spares_available 0" in text
    assert "deadpool_last_recovery_seconds 0.3" in text
    assert [p.name for p in tmp_path.iterdir()] != [] and not list(tmp_path.glob(".deadpool*"))
    entry = events.events[-1]
    assert entry["v"] == SCHEMA_VERSION and entry["job"] == job_id("secret") != job_id("other")


def test_every_event_kind_the_code_writes_is_in_the_schema() -> None:
    """A new kind of event without its schema entry fails here."""
    written: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        written |= set(re.findall(r'\bevents\(\s*"([a-z_]+)"', path.read_text()))
    assert len(written) >= 25, written
    assert written <= set(EVENTS), sorted(written - set(EVENTS))
