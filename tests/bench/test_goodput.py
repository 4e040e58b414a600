"""`deadpool bench goodput`: the failure trace and the accounting (pure), and one small run of
all three ways end to end (real processes, gloo), each ending with the failure-free run's
parameters."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import run_deadpool

from megatron_deadpool.bench.failure_trace import (
    FIRST,
    LLAMA3_MIX,
    MIN_GAP,
    failure_trace,
    kind_of,
    parse_mix,
)
from megatron_deadpool.bench.goodput import account
from megatron_deadpool.bench.timed_launch import Launch
from megatron_deadpool.config.faults import parse_fault
from megatron_deadpool.errors import ConfigError


def _iterations(trace: list[str]) -> list[int]:
    return [parse_fault(s).iteration for s in trace]


@pytest.mark.parametrize("seed", range(20))
def test_a_trace_is_spread_over_the_run_and_seeded(seed: int) -> None:
    kw: dict[str, Any] = {"iters": 60, "failures": 12, "mix": LLAMA3_MIX, "world_size": 8,
                          "ranks_per_node": 2, "seed": seed}  # fmt: skip
    trace = failure_trace(**kw)
    assert trace == failure_trace(**kw) and len(trace) == 12
    its = _iterations(trace)
    assert its[0] >= FIRST and its[-1] <= 59
    assert all(b - a >= MIN_GAP for a, b in itertools.pairwise(its))
    for spec in trace:
        fault = parse_fault(spec)  # a spec `--fail` accepts
        assert (fault.node if fault.node is not None else fault.rank) in range(8)
        assert fault.node is None or fault.node < 4


def test_the_mix_decides_the_kinds() -> None:
    def kinds(mix: str, seed: int = 1) -> set[str]:
        trace = failure_trace(iters=200, failures=40, mix=parse_mix(mix), world_size=4,
                              ranks_per_node=2, seed=seed)  # fmt: skip
        return {kind_of(s) for s in trace}

    assert kinds("crash=1") == {"crash"}
    assert kinds("node=1") == {"node"}
    assert kinds("hang=2,crash=0") == {"hang"}
    assert kinds("crash=1,node=1,hang=1") == {"crash", "node", "hang"}
    assert abs(sum(LLAMA3_MIX.values()) - 1) < 1e-12  # 324 + 88 + 7 = 419


@pytest.mark.parametrize("mix", ["crash", "crash=x", "disk=1", "crash=-1", "crash=inf", "crash=0"])
def test_a_bad_mix_is_refused_naming_the_flag(mix: str) -> None:
    with pytest.raises(ConfigError, match="--mix"):
        parse_mix(mix)


def test_too_many_failures_for_the_run_are_refused() -> None:
    with pytest.raises(ConfigError, match="--failures: 5 failure"):
        failure_trace(iters=15, failures=5, mix={"crash": 1}, world_size=4, ranks_per_node=2,
                      seed=0)  # fmt: skip


def _launch(
    records: list[int], recoveries: list[dict[str, Any]], digest: str | None, spares_left: int
) -> Launch:
    return Launch(
        returncode=0 if digest else 3,
        records=[{"iteration": i} for i in records],
        summary={
            "recoveries": recoveries,
            "final_param_digest": digest,
            "spares_left": [f"s{i}" for i in range(spares_left)],
        },
        run_dir=Path("/nonexistent"),
        spawned_at=0.0,
    )


def test_the_accounting_of_a_run_that_started_again() -> None:
    """Two launches: one spare spent, a respawn, then out of redundancy after iteration 9;
    the second resumed from iteration 8 (one iteration computed again) and completed."""
    first = _launch(
        list(range(1, 10)),
        [
            {"replaced_by": {"1": "s0"}, "restore_iteration": 3, "recomputed_iterations": 1},
            {
                "replaced_by": {"2": "s2"},
                "respawned": {"2": 1},
                "restore_iteration": 6,
                "recomputed_iterations": 0,
            },
        ],
        None,
        0,
    )
    second = _launch(list(range(9, 21)), [], "abc", 1)
    out = account([first, second], 40.0, iters=20, iter_s=1.0, spares=1, reference_digest="abc")
    assert out["ettr"] == 0.5 and out["restarts"] == 1 and out["survived_without_restart"] == 2
    assert out["respawned"] == 1 and out["spares_used"] == 1
    assert out["recomputed_iterations"] == 1 + 0 + 1
    assert out["spare_pool"] == [(1, 1), (4, 0), (7, 0), (9, 1)]
    assert out["matches_failure_free"]
    assert not account([second], 1.0, iters=1, iter_s=1.0, spares=0, reference_digest="x")[
        "matches_failure_free"
    ]


@pytest.mark.timeout(900)
def test_goodput_runs_the_three_ways_through_one_trace(tmp_path: Path) -> None:
    """Two crashes, one spare: respawning survives both in place; spares only survives the
    first and starts again after the second (out of redundancy); restarting from checkpoints
    starts again twice. Every way ends with the failure-free run's parameters."""
    out, png = tmp_path / "goodput.json", tmp_path / "goodput.png"
    proc = run_deadpool(
        "bench", "goodput", "--iters", "16", "--failures", "2", "--mix", "crash=1",
        "--spares", "1", "--save-interval", "4", "--json", str(out), "--plot", str(png),
        "--keep", timeout=840,
    )  # fmt: skip
    runs = Path(proc.stdout.split("runs in ", 1)[1].split()[0])
    try:
        respawned = "".join(p.read_text() for p in (runs / "respawn").glob("launch-*/agent*.out"))
        spared = "".join(p.read_text() for p in (runs / "spares").glob("launch-*/agent*.out"))
        restarted = list((runs / "restart").glob("launch-*/agent*.out"))
    finally:
        shutil.rmtree(runs, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # (a) and (b) ran as on a cluster: (a)'s nodes' agents respawned the crashed processes,
    # (b)'s respawned none; (c), DeadPool off, has no agents.
    assert respawned.count("in place of") == 2, respawned
    assert "started a0" in spared and "in place of" not in spared and restarted == [], spared
    result = json.loads(out.read_text())
    assert result["trace_kinds"] == ["crash", "crash"]
    modes = result["modes"]
    assert all(m["matches_failure_free"] for m in modes.values())
    respawn, spares, restart = modes["respawn"], modes["spares"], modes["restart"]
    assert (respawn["survived_without_restart"], respawn["respawned"], respawn["restarts"]) == (
        2,
        2,
        0,
    )
    assert respawn["spares_used"] == 0
    assert (spares["survived_without_restart"], spares["spares_used"], spares["restarts"]) == (
        1,
        1,
        1,
    )
    assert (restart["survived_without_restart"], restart["restarts"]) == (0, 2)
    assert all(0 < m["ettr"] < 1 for m in modes.values())
    # the planner's goodput model, fed this run's costs, expects what happened
    for m in modes.values():
        assert m["model"]["restarts"] == m["restarts"], m
        assert m["model"]["survived_without_restart"] == m["survived_without_restart"], m
        assert m["model"]["wall_s"] > 0 and abs(m["model_error"]) < 1
    assert restart["model"]["lost_iterations"] == restart["recomputed_iterations"]
    assert png.stat().st_size > 0
    assert "DeadPool, in-place respawn" in proc.stdout and "ETTR" in proc.stdout
