"""In-place respawn end to end (`deadpool train`, real processes, real signals, gloo).

With deadpool-respawn-limit > 0 the launcher is each simulated node's agent: a crashed or hung
process is replaced by a new process on its own node, and no spare is spent - so a run with
fewer spares than failures still completes, bit for bit the failure-free run. A node fault
(`node:N@ITER`) takes the node's agent too: its ranks then take spares, as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import TrainRun, train_case

ITERS = "6"


@pytest.fixture(scope="module")
def reference(failure_free: Callable[[int], TrainRun]) -> dict[str, Any]:
    """The failure-free TP2 x DP2 run's summary (shared with the other modules)."""
    return failure_free(int(ITERS))[2]


def _recovered(out: Path, args: list[str], reference: dict[str, Any]) -> dict[str, Any]:
    proc, records, summary = train_case(out, ["--tp", "2", "--dp", "2", *args], ITERS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["losses"] == reference["losses"]
    assert [r["loss"] for r in records] == summary["losses"]
    assert summary["final_param_digest"] == reference["final_param_digest"]
    assert summary["dp_replicas_identical"]
    for rec in summary["recoveries"]:
        assert rec["recomputed_iterations"] <= 1 and rec["stale_group_refs"] == 0, rec
    return summary


@pytest.mark.timeout(600)
def test_a_crash_without_a_spare_is_respawned_by_default(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """No respawn flag and no spare: in-place respawn is on by default (2 per node per 10
    minutes), so a crash costs no spare and the run ends as the failure-free one did (before
    it was on by default, this run ended out of redundancy, exit 3)."""
    proc, _, summary = train_case(
        tmp_path, ["--tp", "2", "--dp", "2", "--spares", "0", "--fail", "2@4"], ITERS,
        spare_path=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["final_param_digest"] == reference["final_param_digest"]
    assert summary["losses"] == reference["losses"]
    assert [rec["respawned"] for rec in summary["recoveries"]] == [{"2": 1}], summary


@pytest.mark.timeout(600)
def test_more_crashes_than_spares_are_all_respawned_in_place(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """Four failures on both nodes (three crashes and a hang), no spare at all: each process is
    replaced on its own node and training completes exactly as the failure-free run."""
    # From iteration 3 on: iteration 1's round is committed by then (at 2 it may be in flight).
    faults = ["--fail", "0@3", "--fail", "2@4", "--fail", "1@5:hang", "--fail", "3@6"]
    args = ["--spares", "0", "--deadpool-respawn-limit", "2", *faults]
    summary = _recovered(tmp_path, args, reference)
    recoveries = summary["recoveries"]
    events = [json.loads(x) for x in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
    dead = [(e["member"], e["why"]) for e in events if e["event"] == "process_dead"]
    assert [m for m, _ in dead] == ["a0", "a2", "a1", "a3"], dead
    assert dead[2][1].endswith("(hung); killed"), dead  # the hung process is killed, replaced
    # Rank 3 dies as it starts step 6, right after the first step of rank 1's recovery: when
    # rank 0's stamp of that step has not reached the coordinator yet, the death continues that
    # recovery ([1, 3] in one record, under load) - each rank still has its own respawn.
    assert [r for rec in recoveries for r in rec["dead_ranks"]] == [0, 2, 1, 3], recoveries
    respawned = {r: n for rec in recoveries for r, n in rec["respawned"].items()}
    assert respawned == {"0": 0, "2": 1, "1": 0, "3": 1}, recoveries
    newcomers = {r: m for rec in recoveries for r, m in rec["replaced_by"].items()}
    assert newcomers == {"0": "s0", "2": "s1", "1": "s2", "3": "s3"}, recoveries
    assert summary["spares_left"] == []


@pytest.mark.timeout(600)
def test_a_crash_is_respawned_and_a_lost_node_takes_the_spares(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """A crash on node 0 costs no spare; node 1 lost whole (its agent with it) takes both
    spares, which run on spare node 2; rank 3 crashing there next is respawned on node 2."""
    faults = ["--fail", "1@3", "--fail", "node:1@5", "--fail", "3@6"]
    args = ["--spares", "2", "--deadpool-respawn-limit", "2", *faults]
    summary = _recovered(tmp_path, args, reference)
    crash, node, *moved = summary["recoveries"]
    assert crash["dead_ranks"] == [1] and crash["respawned"] == {"1": 0}
    assert crash["replaced_by"] == {"1": "s2"}  # a new process, not spare s0
    assert node["dead_ranks"] == [2, 3] and summary["spares_left"] == []
    # Which spare takes which rank follows the order the two deaths were seen in.
    spares = {
        "2": node["replaced_by"]["2"],
        "3": {"s0": "s1", "s1": "s0"}[node["replaced_by"]["2"]],
    }
    if moved:  # rank 3's crash after the node's recovery completed: a recovery of its own
        assert node["respawned"] == {} and node["replaced_by"] == spares
        assert moved[0]["dead_ranks"] == [3] and moved[0]["respawned"] == {"3": 2}
        assert moved[0]["replaced_by"] == {"3": "s3"}
    else:  # ... or before rank 0's first step after it reached the coordinator: its continuation
        assert node["respawned"] == {"3": 2} and node["replaced_by"] == {**spares, "3": "s3"}


@pytest.mark.timeout(600)
def test_a_rank_and_the_holder_of_its_replica_crashing_together_lose_nothing(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """Ranks 1 and 3 - on two nodes, each holding the other's replica (TP2 x DP2, two ranks
    per node) - are SIGKILLed at the same iteration. Their snapshots and replicas were in their
    nodes' segment files, which outlive them: each respawned process reports what its
    predecessor's hold and restores from its own, no shard travels, no spare is spent. (With
    the replicas in the processes' own memory this was out of redundancy.)"""
    args = ["--spares", "0", "--deadpool-respawn-limit", "1", "--fail", "1@4", "--fail", "3@4"]
    summary = _recovered(tmp_path, args, reference)
    assert [sorted(map(int, r["respawned"])) for r in summary["recoveries"]] in (
        [[1, 3]],
        [[1], [3]],
    )
    events = [json.loads(x) for x in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
    agreed = [e for e in events if e["event"] == "agreed"]
    assert agreed and all(e["sources"] == {} for e in agreed), agreed
    assert "out_of_redundancy" not in {e["event"] for e in events}
