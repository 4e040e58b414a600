"""`deadpool chaos`: the failure planner (pure) and one short soak end to end.

The planner must be deterministic for a seed, produce failures with the asked mean gap, emit
only specs the job accepts, and never plan an event the spare pool cannot absorb. The soak
must inject failures, recover every one of them and end bitwise equal to the failure-free run.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
from pathlib import Path

import pytest
from conftest import hung_silence_s, run_deadpool, run_logs

from megatron_deadpool.chaos.schedule import (
    FIRST_ITERATION,
    episode_seed,
    failure_iterations,
    fired_from_logs,
    match_failures,
    parse_kinds,
    plan_chaos,
    spare_ages,
    spares_needed,
    time_stats,
)
from megatron_deadpool.config.faults import check_faults, parse_fault
from megatron_deadpool.errors import ConfigError
from megatron_deadpool.replication.placement import Layout, place_replicas

DEMO = {"world_size": 4, "ranks_per_node": 2, "spares": 2}  # configs/cpu-demo.yaml, chaos pool


@pytest.mark.timeout(30)
def test_plan_is_deterministic_for_a_seed() -> None:
    a = plan_chaos(7, 60, 5, **DEMO)
    assert a == plan_chaos(7, 60, 5, **DEMO)
    assert a != plan_chaos(8, 60, 5, **DEMO)
    assert plan_chaos(episode_seed(1, 2), 40, 8, **DEMO) == plan_chaos(
        episode_seed(1, 2), 40, 8, **DEMO
    )
    assert plan_chaos(episode_seed(1, 1), 40, 8, **DEMO) != plan_chaos(
        episode_seed(1, 2), 40, 8, **DEMO
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mtbf", [1.0, 2.5, 8.0, 20.0])
def test_mean_gap_between_failures_is_the_mtbf(mtbf: float) -> None:
    its = failure_iterations(random.Random(3), 400_000, mtbf, first=1)
    gaps = [b - a for a, b in itertools.pairwise(its)]
    assert statistics.fmean(gaps) == pytest.approx(mtbf, rel=0.03)
    assert min(gaps) >= 1  # at most one failure per iteration
    # Over many short episodes too: failures per episode ~ iterations / MTBF.
    n = [len(plan_chaos(s, 40, mtbf, **DEMO)) for s in range(2000)]
    assert statistics.fmean(n) == pytest.approx((40 - FIRST_ITERATION + 1) / mtbf, rel=0.05)


@pytest.mark.timeout(60)
def test_every_spec_is_valid_and_every_event_survivable() -> None:
    layouts = [
        (2, 1, 2, 2, ("kill", "hang", "node")),
        (1, 1, 4, 2, ("kill", "node")),
        (2, 2, 2, 2, ("kill", "hang", "node")),
        (1, 2, 3, 1, ("hang",)),
    ]
    kinds_seen: set[str] = set()
    for tp, pp, dp, rpn, kinds in layouts:
        layout = Layout(tp, pp, dp, rpn)
        placement = place_replicas(layout, 1)
        spares = spares_needed(kinds, rpn)
        for seed in range(300):
            specs = plan_chaos(seed, 30, 3, layout.world_size, rpn, spares, kinds)
            faults = [parse_fault(s) for s in specs]
            check_faults(faults, layout.world_size, rpn, 30, spares)  # raises if invalid
            its = [f.iteration for f in faults]
            assert its == sorted(set(its)) and all(FIRST_ITERATION <= i <= 30 for i in its)
            for f in faults:
                ranks = f.ranks(rpn)
                assert 1 <= len(ranks) <= spares  # the pool covers any one event
                assert placement.survivable(ranks)  # no owner dies with all its holders
                assert f.kind in ("kill", "hang") and not f.during_recovery
                kinds_seen.add(f"node-{f.kind}" if f.node is not None else f.kind)
    assert kinds_seen == {"kill", "hang", "node-kill", "node-hang"}


@pytest.mark.timeout(30)
def test_pool_too_small_or_bad_kinds_are_refused() -> None:
    with pytest.raises(ConfigError, match="--spares 2"):
        plan_chaos(1, 20, 4, 4, 2, 1, ("kill", "node"))
    assert plan_chaos(1, 20, 4, 4, 2, 1, ("kill", "hang"))  # one spare suffices for ranks
    with pytest.raises(ConfigError, match="choose from"):
        parse_kinds("kill,meteor")
    with pytest.raises(ConfigError, match="mtbf"):
        plan_chaos(1, 20, 0.5, **DEMO)
    with pytest.raises(ConfigError, match="one node"):
        plan_chaos(1, 20, 4, 2, 2, 2, ("node",))


@pytest.mark.timeout(30)
def test_failures_are_matched_with_recoveries() -> None:
    specs = ["1@4:kill", "node:1@7:hang", "0@9:hang"]
    logs = [
        "01:00:00 [deadpool r1 g0] WARNING fault injection: kill at iteration 4\n",
        (
            "01:00:01 [deadpool r2 g1] WARNING fault injection: hang at iteration 7\n"
            "01:00:01 [deadpool r3 g1] WARNING fault injection: hang at iteration 7\n"
        ),
    ]
    recs = [
        {
            "generation": 1,
            "dead_ranks": [1],
            "recomputed_iterations": 1,
            "total_s": 2.0,
            "phases_s": {"detect": 0.1},
        },
        {"generation": 2, "dead_ranks": [2], "recomputed_iterations": 0, "total_s": 5.0},
        {"generation": 3, "dead_ranks": [3], "recomputed_iterations": 1, "total_s": 1.0},
    ]
    failures, extra = match_failures(specs, 2, fired_from_logs(logs), recs, run_ok=True)
    assert [f.injected for f in failures] == [True, True, False]
    assert [f.recovered for f in failures] == [True, True, False]
    assert failures[1].recovery["dead_ranks"] == [2, 3]  # a node found dead in two steps
    assert failures[1].recovery["total_s"] == 6.0 and extra == []
    failures, _ = match_failures(specs, 2, fired_from_logs(logs), recs, run_ok=False)
    assert not any(f.recovered for f in failures)  # wrong digest: nothing counts
    _, extra = match_failures(["1@4"], 2, {(1, 4)}, recs, run_ok=True)
    assert [r["generation"] for r in extra] == [2, 3]  # recoveries no failure explains
    assert time_stats([3.0, 1.0, 2.0])["median"] == 2.0 and time_stats([])["count"] == 0


@pytest.mark.timeout(30)
def test_replacement_spare_age_comes_from_the_event_log() -> None:
    events = [
        {"t": 100.0, "event": "roster", "generation": 0},
        {"t": 140.0, "event": "plan", "generation": 1, "needy": [2], "slots": {"2": "s0"}},
        {"t": 140.1, "event": "spare_added", "member": "s2"},
        {
            "t": 141.0,
            "event": "plan",
            "generation": 2,
            "needy": [0, 1],
            "slots": {"0": "s1", "1": "s2"},
        },
    ]
    assert spare_ages(events) == {1: {"s0": 40.0}, 2: {"s1": 41.0, "s2": 0.9}}


@pytest.mark.timeout(600)
def test_short_soak_recovers_every_failure_bitwise(tmp_path: Path) -> None:
    # Seed 1 plans 3@3:kill, 2@5:hang, 1@6:hang for a 12-iteration episode.
    assert plan_chaos(episode_seed(1, 1), 12, 4, **DEMO) == ["3@3:kill", "2@5:hang", "1@6:hang"]
    out = tmp_path / "chaos.json"
    proc = run_deadpool(
        "chaos",
        "--minutes",
        "6",
        "--mtbf-iters",
        "4",
        "--iters",
        "12",
        "--seed",
        "1",
        "--episodes",
        "1",
        "--run-dir",
        str(tmp_path / "runs"),
        "--json",
        str(out),
        timeout=540,
    )
    assert proc.returncode == 0, (
        proc.stdout[-3000:] + proc.stderr[-3000:] + run_logs(tmp_path / "runs" / "ep001")
    )
    report = json.loads(out.read_text())
    assert report["episodes"] == 1 and report["runs"] == 2
    assert report["digest_equal"] is True
    assert report["failures_injected"] == 3
    assert report["failures_recovered"] == report["failures_injected"]
    # At most one iteration recomputed per failure; 0 when the in-flight round was salvaged.
    recomputed = [f["recovery"]["recomputed_iterations"] for f in report["failures"]]
    assert all(0 <= n <= 1 for n in recomputed)
    assert report["iterations_recomputed"] == sum(recomputed)
    assert report["recovery_time_s"]["count"] == 3
    # Each hang found by the heartbeat timeout (3 s): declared after that long a silence. (Its
    # recovery time runs from the fault's stamp, up to a heartbeat interval after the last beat.)
    events = (tmp_path / "runs").rglob("events.jsonl")
    hung = [
        json.loads(line)["why"]
        for path in events
        for line in path.read_text().splitlines()
        if '"process_dead"' in line and "(hung)" in line
    ]
    silences = [hung_silence_s(why) for why in hung]
    assert len(hung) == report["failures_by_kind"]["hang"] == 2, hung
    assert all(s is not None and s >= 3.0 for s in silences), hung
    assert "recovered in" in proc.stdout and "digest equal" in proc.stdout
