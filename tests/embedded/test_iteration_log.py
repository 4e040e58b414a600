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


def _read_all(
    published: dict[tuple[int, int], str], log_from: int, upto: int, generation: int, restore: int
) -> list[str]:
    """What the launcher shows of `published` ((generation, iteration) -> record), reading as
    it does (`generations_to_read`) from iteration `log_from` to `upto`."""
    shown, last_read = [], 0
    for it in range(log_from, upto + 1):
        where = generations_to_read(it, generation, restore, last_read)
        g = next((g for g in where if (g, it) in published), None)
        if g is None:
            break
        shown.append(published[g, it])
        last_read = g
    return shown


def test_records_before_the_restore_iteration_are_read_from_the_generation_that_trained_them() -> (
    None
):
    # generation 0 trained 1..3 (3 not committed everywhere), generation 1 restored 2 and
    # trained 3..4 before a second recovery; generation 2 restored 4 and trained 5. The launcher
    # had shown nothing yet: each record comes from the newest generation that published it.
    published = {(0, 1): "1@g0", (0, 2): "2@g0", (0, 3): "3@g0", (1, 3): "3@g1",
                 (1, 4): "4@g1", (1, 5): "5@g1", (2, 5): "5@g2"}  # fmt: skip
    assert _read_all(published, 1, 5, generation=2, restore=4) == [
        "1@g0",
        "2@g0",
        "3@g1",
        "4@g1",
        "5@g2",
    ]
    # after the restore iteration only the current generation's records count
    assert list(generations_to_read(5, 2, 4, last_read=0)) == [2]
    assert list(generations_to_read(4, 2, 4, last_read=1)) == [2, 1]
