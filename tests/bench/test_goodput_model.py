"""`deadpool bench goodput`'s check of the planner's goodput model
(megatron_deadpool/bench/goodput_model.py): costs measured from a way's launches, and the wall
time, restarts and lost work the model predicts from them, worked by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatron_deadpool.bench.goodput_model import measured_costs, predict
from megatron_deadpool.bench.timed_launch import Launch


def _launch(iterations: int, recoveries: list[dict[str, Any]], iter_s: float = 0.1) -> Launch:
    records = [{"iteration": i + 1, "iter_time_s": iter_s} for i in range(iterations)]
    return Launch(0, records, {"recoveries": recoveries}, Path("."), 0.0)


def test_costs_are_medians_over_the_ways_launches() -> None:
    crash = {"dead_ranks": [1], "total_s": 2.0}
    node = {"dead_ranks": [0, 1], "total_s": 5.0}
    runs = [_launch(50, [crash, node, {**crash, "total_s": 4.0}]), _launch(70, [crash])]
    costs = measured_costs(runs, [5 + 5 + 11.0, 5 + 7 + 2.0])
    assert costs["iter_s"] == pytest.approx(0.1)
    assert costs["crash_s"] == 2.0 and costs["node_s"] == 5.0
    assert costs["launch_s"] == pytest.approx(5.0)  # median of 5 and 5
    assert measured_costs([_launch(3, [])], [1.0])["node_s"] == 0.0


def test_the_prediction_worked_by_hand() -> None:
    costs = {"iter_s": 0.1, "crash_s": 2.0, "node_s": 5.0, "launch_s": 4.0}
    trace = ["node:0@8", "2@23", "0@33"]
    kw: dict[str, Any] = {"iters": 100, "save_interval": 10, "spares": 2, "ranks_per_node": 2}
    # respawn: the node takes both spares (5 s), the crashes are respawned (2 s each)
    out = predict("respawn", trace, costs, **kw)
    assert out["wall_s"] == pytest.approx(4 + 10 + 5 + 2 + 2)
    assert (out["restarts"], out["survived_without_restart"]) == (0, 3)
    # spares only: the first crash finds none left: a restart (one more launch), pool refilled
    out = predict("spares", trace, costs, **kw)
    assert out["wall_s"] == pytest.approx(4 + 10 + 5 + 4 + 2)
    assert (out["restarts"], out["survived_without_restart"]) == (1, 2)
    # restart: three launches more (the exit seen at once), and the work since each
    # checkpoint (7, 2 and 2 iterations)
    out = predict("restart", trace, costs, **kw)
    assert out["wall_s"] == pytest.approx(4 + 10 + 3 * 4 + 3 * 0 + 0.1 * (7 + 2 + 2))
    assert out["restarts"] == 3 and out["lost_iterations"] == 11


@pytest.mark.parametrize("iter_s", [0.1, 0.0876521155000205, 1.0])
def test_restart_loses_the_iterations_since_its_last_checkpoint(iter_s: float) -> None:
    costs = {"iter_s": iter_s, "crash_s": 1.0, "node_s": 1.0, "launch_s": 1.0}
    for i in range(2, 120):  # killed at iteration i: iterations 1 .. i - 1 done
        out = predict(
            "restart", [f"1@{i}"], costs, iters=120, save_interval=4, spares=0, ranks_per_node=2
        )
        assert out["lost_iterations"] == (i - 1) % 4, i
