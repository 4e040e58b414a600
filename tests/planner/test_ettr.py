"""The goodput model (megatron_deadpool/planner/goodput.py): ETTR moves the sensible way with
each cost and with the spares, spares run out into restarts, permanent failures take spares
that respawns do not, the failed iteration is counted, and a fixed amount of work's wall time
is predicted as the events add up by hand."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_deadpool.errors import ConfigError
from megatron_deadpool.planner.goodput import (
    WAYS,
    Costs,
    predict_wall,
    simulate,
    young_interval_s,
)
from megatron_deadpool.planner.trace import Interruption, Trace, load_trace

COSTS = Costs(
    detect_process_s=1.0,
    detect_node_s=10.0,
    detect_hang_s=10.0,
    recover_s=6.0,
    respawn_s=6.0,
    iteration_s=12.0,
    restart_s=600.0,
    checkpoint_interval_s=1800.0,
    checkpoint_save_s=45.0,
)
LLAMA3 = load_trace("llama3")


def ettr(way: str, trace: Trace = LLAMA3, costs: Costs = COSTS, spares: int = 64) -> float:
    return simulate(trace, way, costs, spares, 8).ettr


def test_more_spares_never_lower_deadpools_ettr_and_enough_avoid_every_restart() -> None:
    for way in ("respawn", "spares"):
        values = [ettr(way, spares=s) for s in (0, 8, 64, 512, 4096)]
        assert values == sorted(values) and values[0] < values[-1]
        assert simulate(LLAMA3, way, COSTS, 4096, 8).restarts == 0
    assert simulate(LLAMA3, "spares", COSTS, 0, 8).restarts == 419  # every failure


def test_respawn_beats_spares_only_beats_checkpoint_restart_on_llama3() -> None:
    a, b, c = (ettr(w) for w in WAYS)
    assert a >= b > c
    assert a >= 0.99 and c < 0.95


@pytest.mark.parametrize(
    ("field", "low", "high", "ways"),
    [
        ("restart_s", 60.0, 1200.0, ("restart", "respawn", "spares")),
        ("recover_s", 1.0, 60.0, ("spares",)),
        ("iteration_s", 1.0, 60.0, ("respawn", "spares")),
        ("checkpoint_save_s", 5.0, 120.0, ("restart",)),
        ("detect_node_s", 1.0, 60.0, ("respawn", "spares", "restart")),
    ],
)
def test_a_higher_cost_lowers_ettr(field: str, low: float, high: float, ways: tuple[str]) -> None:
    for way in ways:
        cheap = ettr(way, costs=dataclasses.replace(COSTS, **{field: low}), spares=8)
        dear = ettr(way, costs=dataclasses.replace(COSTS, **{field: high}), spares=8)
        assert cheap > dear, (way, field)


def test_more_failures_lower_every_ettr() -> None:
    rare = load_trace("synthetic:per_day=2,days=30")
    often = load_trace("synthetic:per_day=20,days=30")
    for way in WAYS:
        assert ettr(way, rare) > ettr(way, often)


def test_transient_failures_are_respawned_without_spares_permanent_ones_take_them() -> None:
    rows = (
        Interruption(1.0, "bug", "process", False),
        Interruption(2.0, "timeout", "hang", False),
        Interruption(3.0, "gpu", "process", True),
        Interruption(4.0, "switch", "node", True),
    )
    trace = Trace("t", 10.0, rows)
    a = simulate(trace, "respawn", COSTS, 9, 8)
    assert (a.respawns, a.spares_used, a.restarts, a.nodes_lost) == (2, 1 + 8, 0, 2)
    b = simulate(trace, "spares", COSTS, 9, 8)
    assert (b.respawns, b.spares_used, b.restarts) == (0, 3, 1)  # the node finds 6 < 8 left
    assert [p[1] for p in b.pool] == [9, 8, 7, 6, 9]  # refilled by the restart
    assert b.lost_s["restart"] == COSTS.restart_s
    assert b.lost_s["checkpoints"] == COSTS.checkpoint_save_s  # the out-of-redundancy save
    # every DeadPool event recomputes the failed iteration; checkpoint-restart loses its work
    assert a.lost_s["failed iteration"] == 4 * COSTS.iteration_s
    c = simulate(trace, "restart", COSTS, 0, 8)
    assert (
        c.restarts == 4
        and c.lost_s["lost work"] > 0
        and c.lost_s["detect"] == (1 + COSTS.restart_detect_hang_s + 1 + 10)
    )


def test_predict_wall_adds_up_by_hand() -> None:
    costs = dataclasses.replace(
        COSTS, checkpoint_interval_s=10.0, checkpoint_save_s=0.5, iteration_s=0.1
    )
    crash, node = Interruption(0, "c", "process", False), Interruption(0, "n", "node", True)
    events = [(5.0, node), (23.0, crash), (47.0, crash)]
    wall, res = predict_wall(100.0, events, "restart", costs, 0, 2, start_s=4.0)
    # start + work + 3 x (detect + restart) + lost work 5 + 3 + 7 + 10 saves x 0.5
    assert wall == pytest.approx(4 + 100 + (10 + 600) + 2 * (1 + 600) + 15 + 5)
    wall, res = predict_wall(100.0, events, "spares", costs, 2, 2, start_s=4.0)
    # the node takes both spares; the first crash finds none: save + restart, pool refilled
    assert res.restarts == 1 and res.spares_used == 3
    assert wall == pytest.approx(4 + 100 + (10 + 6 + 0.1) + (1 + 0.5 + 600 + 0.1) + (1 + 6 + 0.1))
    assert res.ettr == pytest.approx(100 / wall)


def test_young_interval() -> None:
    assert young_interval_s(50, 3600) == pytest.approx(600)
    assert young_interval_s(0, 3600) == float("inf")


def test_bad_costs_and_spares_are_refused() -> None:
    with pytest.raises(ConfigError, match="restart_s"):
        dataclasses.replace(COSTS, restart_s=float("nan"))
    with pytest.raises(ConfigError, match="checkpoint_interval_s"):
        dataclasses.replace(COSTS, checkpoint_interval_s=0)
    with pytest.raises(ConfigError, match="spares"):
        simulate(LLAMA3, "respawn", COSTS, -1, 8)
    with pytest.raises(ConfigError, match="way"):
        simulate(LLAMA3, "pray", COSTS, 1, 8)
