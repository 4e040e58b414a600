"""`deadpool bench goodput`'s check of the planner's goodput model (`planner/goodput.py`): the
wall time the model predicts for each way, from costs measured in the same run (pure).

The costs are medians over the way's own launches, so that the check tests the model's
accounting - which failures are recovered, respawned or end in a restart as the spares run
out, how much work a checkpoint-restart loses, how many launches it takes - not the costs:

- iteration: the median `iter_time_s` of the way's iteration records;
- a crash's and a lost node's recovery: the median `total_s` the coordinator recorded (failure
  to the first iteration after it) for recoveries of one rank and of several;
- a launch (start, initialization, load, finish): the median over launches of the launch's wall
  time less its iterations and recoveries; a restart costs one more launch.

The events are the trace's `--fail` specs at their iterations; `deadpool plan --trace` uses the
same walk (`planner.goodput.walk`) with the costs at scale.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ..config.faults import parse_fault
from ..planner.goodput import Costs, predict_wall
from ..planner.trace import Interruption
from .timed_launch import Launch


def measured_costs(launches: Sequence[Launch], walls: Sequence[float]) -> dict[str, float]:
    """The way's costs (module docstring) from its launches and each launch's wall time."""
    records = [r for run in launches for r in run.records]
    iter_s = statistics.median(float(r["iter_time_s"]) for r in records) if records else 0.0
    recoveries = [rec for run in launches for rec in run.summary.get("recoveries") or []]
    one = [float(r["total_s"]) for r in recoveries if len(r.get("dead_ranks") or []) <= 1]
    many = [float(r["total_s"]) for r in recoveries if len(r.get("dead_ranks") or []) > 1]
    crash = statistics.median(one) if one else 0.0
    node = statistics.median(many) if many else crash
    overheads = []
    for run, wall in zip(launches, walls):
        recovered = sum(float(r["total_s"]) for r in run.summary.get("recoveries") or [])
        overheads.append(max(0.0, wall - len(run.records) * iter_s - recovered))
    launch = statistics.median(overheads) if overheads else 0.0
    return {"iter_s": iter_s, "crash_s": crash, "node_s": node, "launch_s": launch}


def predict(
    mode: str,
    trace: Sequence[str],
    costs: dict[str, float],
    *,
    iters: int,
    save_interval: int,
    spares: int,
    ranks_per_node: int,
) -> dict[str, Any]:
    """The model's wall time for `mode` through `trace`, and what it expects to happen."""
    iter_s = costs["iter_s"]
    events = []
    for spec in trace:
        fault = parse_fault(spec)
        scope = "node" if fault.node is not None else "hang" if fault.kind == "hang" else "process"
        events.append(((fault.iteration - 1) * iter_s, Interruption(0.0, spec, scope, False)))
    model = Costs(
        detect_process_s=0.0,
        # a lost node's silence costs DeadPool more than a crash; a restart sees its exit
        detect_node_s=0.0 if mode == "restart" else max(0.0, costs["node_s"] - costs["crash_s"]),
        detect_hang_s=0.0,
        recover_s=costs["crash_s"],
        respawn_s=costs["crash_s"],
        iteration_s=0.0,  # in the coordinator's total_s
        restart_s=costs["launch_s"],
        restart_detect_hang_s=0.0,
        checkpoint_interval_s=max(save_interval * iter_s, 1e-9),
        checkpoint_save_s=0.0,  # in the iteration records
    )
    wall, res = predict_wall(
        iters * iter_s,
        events,
        mode,
        model,
        spares if mode != "restart" else 0,
        ranks_per_node,
        start_s=costs["launch_s"],
    )
    return {
        "wall_s": round(wall, 3),
        "restarts": res.restarts,
        "survived_without_restart": res.recoveries,
        "lost_iterations": round(res.lost_s["lost work"] / iter_s) if iter_s else 0,
        "costs": {k: round(v, 4) for k, v in costs.items()},
    }
