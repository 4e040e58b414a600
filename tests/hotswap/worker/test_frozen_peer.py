"""A frozen peer where nothing can kill it: the survivors must not wait for the collective timeout.

A cluster coordinator (`deadpool coordinator`) sees heartbeats only; a rank stopped by SIGSTOP
(a frozen node) keeps its sockets open, so its peers' collective never fails on its own. The
coordinator names it dead after the heartbeat timeout and plans the next generation; each
survivor's plan watch aborts its groups, the blocked collective raises, and the survivors report
well inside the agreement timeout. Without the watch they stay blocked until the process
group's timeout, the coordinator presumes them dead too, and the run ends out of redundancy.

Real processes on loopback: the coordinator and five embedded workers (the CPU demo, 4 ranks
and a spare), as a Slurm job would start them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import TrainRun
from coordinated_job import coordinated_job

ITERS = "6"
TIMING = [
    "--deadpool-heartbeat-interval", "0.5", "--deadpool-heartbeat-timeout", "4",
    "--deadpool-agree-timeout", "60", "--deadpool-pg-timeout", "150",
]  # fmt: skip


@pytest.mark.timeout(400)
def test_frozen_rank_is_replaced_without_waiting_for_the_collective_timeout(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    logs = tmp_path / "logs"
    with coordinated_job(logs, "frozen-test", ITERS, "1@4:hang", TIMING, "300") as procs:
        assert procs[0].wait(timeout=330) == 0, (logs / "coordinator.out").read_text()[-3000:]
        events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert "agree_timeout" not in kinds and "out_of_redundancy" not in kinds, kinds
    dead = [e for e in events if e["event"] == "process_dead"]
    assert [e["member"] for e in dead] == ["a1"] and "hung" in dead[0]["why"], dead
    (recovered,) = [e for e in events if e["event"] == "recovered"]
    assert recovered["dead_ranks"] == [1] and recovered["replaced_by"] == {"1": "s0"}
    assert recovered["recomputed_iterations"] <= 1
    survivors = [(logs / f"task{t}.out").read_text() for t in (0, 2, 3)]
    # The first survivor to see the plan aborts its groups; the others' collectives then fail
    # as its connections close (or their own watch fires first).
    assert any("aborting this rank's process groups" in text for text in survivors), survivors[0]
    assert all("entering recovery" in text for text in survivors)
    (finished,) = [e for e in events if e["event"] == "finished"]
    _, _, reference = failure_free(int(ITERS))  # the CPU demo without the failure (conftest)
    assert finished["final_param_digest"] == reference["final_param_digest"]
