"""`deadpool train`'s records and JSON log after a recovery that restores an earlier iteration
than the last one shown: the iterations trained again replace theirs, one line per iteration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_deadpool.embedded.iteration_log import IterationLog, generations_to_read


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_recomputed_iterations_replace_their_lines(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    with path.open("w") as file:
        log = IterationLog(1, file)
        for it in (1, 2):
            log.append({"iteration": it, "generation": 0})
        log.rewind(1)  # iteration 2 was not committed everywhere: trained again
        assert log.next_iteration == 2
        for it in (2, 3):
            log.append({"iteration": it, "generation": 1})
        log.rewind(3)  # nothing to drop
        log.write({"event": "summary"})
    want = [(1, 0), (2, 1), (3, 1)]
    assert [(r["iteration"], r["generation"]) for r in log.records] == want
    *records, summary = _lines(path)
    assert [(r["iteration"], r["generation"]) for r in records] == want
    assert summary == {"event": "summary"}


def test_a_run_resumed_from_a_checkpoint_rewinds_to_its_own_records(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    with path.open("w") as file:
        log = IterationLog(5, file)  # --load resumed after iteration 4
        for it in (5, 6, 7):
            log.append({"iteration": it})
        log.rewind(5)
        log.append({"iteration": 6, "again": True})
        log.rewind(4)  # back to the checkpoint's iteration: nothing of this run is kept
        assert log.records == [] and log.next_iteration == 5
        log.append({"iteration": 5})
    assert _lines(path) == [{"iteration": 5}]


def test_without_a_file_only_the_records_rewind() -> None:
    log = IterationLog(1)
    log.append({"iteration": 1})
    log.append({"iteration": 2})
    log.rewind(0)
    log.write({"event": "summary"})
    assert log.records == [] and log.next_iteration == 1


def test_a_file_that_cannot_be_written_is_dropped_and_the_others_go_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full disk under one of the files (/dev/full: every write fails with ENOSPC): one line
    on stderr, the run's records go on in memory and in the other file, rewinds included."""
    with open("/dev/full", "w") as full, open(tmp_path / "log.jsonl", "w+") as ok:
        log = IterationLog(1, full, ok)
        for i in (1, 2, 3):
            log.append({"iteration": i})
        log.rewind(1)
        log.append({"iteration": 2, "again": True})
        assert full.closed and not ok.closed
        ok.seek(0)
        assert [json.loads(x) for x in ok] == [{"iteration": 1}, {"iteration": 2, "again": True}]
    assert [r["iteration"] for r in log.records] == [1, 2]
    assert capsys.readouterr().err.count("cannot write /dev/full") == 1


class _Store:
    """Rank 0's published records ((generation, iteration) -> record), as the launcher reads
    them (`membership.metrics`)."""

    def __init__(self) -> None:
        self.records: dict[tuple[int, int], dict] = {}

    def publish(self, generation: int, *iterations: int) -> None:
        for it in iterations:
            self.records[generation, it] = {"iteration": it, "generation": generation}

    def read(self, generation: int, iteration: int) -> dict | None:
        return self.records.get((generation, iteration))


def _follow(log: IterationLog, store: _Store, generation: int, restore: int) -> list[tuple]:
    """What the launcher shows now (`LocalLauncher._monitor`): every record it can read for
    the roster of `generation`, as (iteration, generation)."""
    shown = []
    while (rec := log.next_record(generation, restore, store.read)) is not None:
        log.append(rec)
        shown.append((rec["iteration"], rec["generation"]))
    return shown


def test_records_before_the_restore_iteration_come_from_the_generation_that_trained_them() -> None:
    store, log = _Store(), IterationLog(1)
    store.publish(0, 1)
    assert _follow(log, store, 0, 0) == [(1, 0)]
    # generation 0 trains 2 and 3, then a rank dies; recoveries are agreed faster than the
    # launcher reads: generation 1 restores 2 and trains 3 and 4, a second death, generation 2
    # restores 4 and trains 5 - before the launcher reads anything more
    store.publish(0, 2, 3)
    store.publish(1, 3, 4)
    store.publish(2, 5)
    assert _follow(log, store, 2, 4) == [(2, 0), (3, 1), (4, 1), (5, 2)]
    # only the current generation's record counts after the restore iteration: 6 of
    # generation 1 (trained before it died, rolled back) is never shown
    store.publish(1, 6)
    assert _follow(log, store, 2, 4) == []
    store.publish(2, 6)
    assert _follow(log, store, 2, 4) == [(6, 2)]
    # a recovery that restores before what was shown: the records rewind, and 6 and 7 come from
    # the generation that trains them again
    store.publish(2, 7)
    assert _follow(log, store, 3, 5) == []  # generation 3 has published nothing yet
    assert [r["iteration"] for r in log.records] == [1, 2, 3, 4, 5]
    store.publish(3, 6, 7)
    assert _follow(log, store, 3, 5) == [(6, 3), (7, 3)]
    assert [(r["iteration"], r["generation"]) for r in log.records] == [
        (1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (6, 3), (7, 3),
    ]  # fmt: skip


def test_where_a_record_is_looked_for() -> None:
    assert list(generations_to_read(5, 2, 4, last_read=0)) == [2]  # after the restore iteration
    assert list(generations_to_read(4, 2, 4, last_read=1)) == [2, 1]
    assert list(generations_to_read(3, 0, 0, last_read=0)) == [0]  # no recovery yet
