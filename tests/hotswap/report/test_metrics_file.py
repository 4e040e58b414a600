"""The metrics file (`hotswap/report/metrics_file.py`) and the event log's schema (`hotswap/coordinator/events.py`):
the Prometheus text format with HELP/TYPE lines, written atomically; every event kind the code
writes is in the schema, and every entry carries the schema version and the job's id."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_deadpool.hotswap.coordinator.events import EVENTS, SCHEMA_VERSION, EventLog, job_id
from megatron_deadpool.hotswap.protocol.messages import Progress
from megatron_deadpool.hotswap.report.metrics_file import (
    JobGauges,
    MetricsFile,
    follow_progress,
    render,
    watch_events,
)
from megatron_deadpool.hotswap.report.replica_deficit import ReplicaDeficit, replicated_again

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


def _recovery(events: EventLog, generation: int, lost: list[int], short: list[int]) -> None:
    """The coordinator's two events of a recovery that restores iteration 4."""
    events("plan", generation=generation, dead=[2], needy=[2], slots={}, replicas_lost=lost)
    events("agreed", generation=generation, restore_iteration=4, sources={}, last_completed=5,
           under_replicated=short)  # fmt: skip


def test_short_shards_follow_the_recoveries_until_a_round_after_the_restore_commits() -> None:
    deficit = ReplicaDeficit()
    deficit.on_event({"event": "plan", "generation": 1, "replicas_lost": [0]})
    assert deficit.count == 1
    assert not deficit.on_committed(0, 9)  # the old world's rounds: not a re-replication
    deficit.on_event({"event": "plan", "generation": 2, "replicas_lost": [1]})  # superseded
    assert deficit.count == 2  # both copies are gone
    deficit.on_event({"event": "agreed", "generation": 2, "restore_iteration": 4,
                      "under_replicated": [0, 1]})  # fmt: skip
    assert not deficit.on_committed(2, 4) and not deficit.on_committed(2, None)
    assert deficit.on_committed(2, 5) and deficit.count == 0
    assert replicated_again(3, 5, 2, 4) and not replicated_again(1, 5, 2, 4)
    assert not replicated_again(2, 5, 2, None)


def test_the_metrics_file_counts_short_shards_from_events_and_progress(tmp_path: Path) -> None:
    """The gauge rises with a recovery's events and falls when rank 0's progress (any job's:
    what a Megatron-LM job reports) shows a round after the restore iteration committed."""
    events = EventLog(None)
    path = tmp_path / "deadpool.prom"
    metrics = watch_events(events, path, lambda: 0)
    assert "deadpool_under_replicated_shards 0" in path.read_text().splitlines()
    metrics.on_progress(Progress(iteration=3, generation=0, committed_iteration=2, replica_bytes=8))
    _recovery(events, 1, lost=[0], short=[0])
    lines = path.read_text().splitlines()
    assert "deadpool_under_replicated_shards 1" in lines
    assert "deadpool_committed_iteration 2" in lines and "deadpool_iteration 3" in lines
    assert "deadpool_replica_bytes_per_iteration 8" in lines
    metrics.on_progress(Progress(iteration=5, generation=1, committed_iteration=4, replica_bytes=8))
    assert "deadpool_under_replicated_shards 1" in path.read_text().splitlines()
    metrics.on_progress(Progress(iteration=6, generation=1, committed_iteration=5, replica_bytes=8))
    lines = path.read_text().splitlines()
    assert "deadpool_under_replicated_shards 0" in lines and "deadpool_generation 1" in lines
    assert "deadpool_committed_iteration 5" in lines and "deadpool_iteration 6" in lines
    # The embedded job's iteration records say the same.
    _recovery(events, 2, lost=[3], short=[3])
    metrics.on_record({"iteration": 5, "generation": 2, "committed_iteration": 5,
                       "replica_bytes_sent": 8})  # fmt: skip
    assert "deadpool_under_replicated_shards 0" in path.read_text().splitlines()


def test_follow_progress_reads_at_most_every_interval(tmp_path: Path) -> None:
    metrics = MetricsFile(tmp_path / "deadpool.prom", spares=0)
    reads: list[int] = []

    def read() -> Progress:
        reads.append(1)
        return Progress(iteration=len(reads), committed_iteration=len(reads) - 1)

    tick = follow_progress(metrics, read, every_s=3600.0)
    tick()
    tick()
    assert len(reads) == 1 and metrics.gauges.iteration == 1
    assert metrics.gauges.committed_iteration == 0
    follow_progress(None, read)()  # no metrics file: nothing read
    assert len(reads) == 1
