"""Goodput over a failure trace: the effective training time ratio (ETTR) of three ways to
survive it (pure: no torch, no communication).

The ways, as `deadpool bench goodput` runs them for real on a small job:

(a) ``respawn``: DeadPool with in-place respawn and spares. A transient process failure or hang
    (`Interruption.permanent` false, scope process/hang) is respawned on its node: no spare
    spent. A process whose GPU cannot host it again takes a spare rank; a lost node takes a
    node's worth of spare ranks (`ranks_per_node`).
(b) ``spares``: DeadPool with spares only: every interruption takes spare ranks (one for a
    process or a hang, a node's worth for a node).
(c) ``restart``: checkpoint-restart: every interruption stops the whole job, which starts again
    from its last persistent checkpoint (saved every `Costs.checkpoint_interval_s`, each save
    stalling training `Costs.checkpoint_save_s`).

In (a) and (b) an interruption that needs a spare when none is left ends the run out of
redundancy: it saves its committed state (`Costs.checkpoint_save_s`), is started again
(`Costs.restart_s`) with its spares back, as a requeued job is, and loses nothing but the
failed iteration. A DeadPool recovery costs detection (by scope) + `Costs.recover_s` (agree,
repair the communicators, transfer the shard) + the failed iteration (recomputed).

`simulate(trace, way, costs, spares, ranks_per_node)` walks the trace in time order. An interruption's
cost is lost training time; restart's lost work is the productive time since its last
checkpoint at the moment of the failure. ETTR = productive time / the trace's span. The same
walk predicts the wall time of a fixed amount of work (`predict_wall`), which is how the model
is checked against `deadpool bench goodput`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import ConfigError
from .trace import Interruption, Trace

WAYS = ("respawn", "spares", "restart")
LABELS = {
    "respawn": "DeadPool, respawn + spares",
    "spares": "DeadPool, spares only",
    "restart": "checkpoint-restart",
}
NCCL_WATCHDOG_S = 600.0
"""A hang under checkpoint-restart is found by the collective timeout: torch's default
process-group timeout and Megatron-LM's --distributed-timeout-minutes are both 10 minutes."""


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Seconds each event costs (where each comes from: `deadpool plan --trace`'s table)."""

    detect_process_s: float
    """A process's exit found (DeadPool: one heartbeat interval)."""

    detect_node_s: float
    """A lost node found by its silence (the heartbeat timeout)."""

    detect_hang_s: float
    """A hung process found (DeadPool: the heartbeat timeout)."""

    recover_s: float
    """DeadPool's recovery after detection: agree, repair communicators, transfer the shard."""

    respawn_s: float
    """The same for a process respawned in place on its node."""

    iteration_s: float
    """The failed iteration, computed again."""

    restart_s: float
    """A whole-job restart: relaunch, initialization, checkpoint load (requeue included)."""

    restart_detect_hang_s: float = NCCL_WATCHDOG_S
    """A hang under checkpoint-restart: found by the collective timeout."""

    checkpoint_interval_s: float
    """Productive seconds between persistent checkpoints (way restart)."""

    checkpoint_save_s: float
    """Training stalled by one persistent save (also DeadPool's save when out of spares)."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name}: must be a finite number of seconds >= 0, got {value}")
        if self.checkpoint_interval_s <= 0:
            raise ConfigError("checkpoint_interval_s: must be > 0 seconds")


@dataclass
class WayResult:
    """What a way came to over a trace."""

    way: str
    ettr: float
    """Productive time over the trace's span."""
    lost_s: dict[str, float] = field(default_factory=dict)
    """Lost seconds by reason: detect, recover, restart, failed iteration, lost work,
    checkpoints."""
    recoveries: int = 0
    """Interruptions survived without a restart (respawns included)."""
    respawns: int = 0
    """Of which respawned in place (no spare spent)."""
    restarts: int = 0
    """Whole-job restarts (every one in way restart; spares run out in the others)."""
    spares_used: int = 0
    """Spare ranks taken."""
    nodes_lost: int = 0
    """Interruptions that took their node out for the rest of the run."""
    pool: list[tuple[float, int]] = field(default_factory=list)
    """(hours, spare ranks left) after each event, from (0, spares)."""

    @property
    def lost_total_s(self) -> float:
        """All lost seconds."""
        return sum(self.lost_s.values())


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum checkpoint interval sqrt(2 C M) (J. W. Young, "A first
    order approximation to the optimum checkpoint interval", CACM 17(9), 1974)."""
    return math.sqrt(2 * save_s * mtbf_s) if save_s > 0 and mtbf_s > 0 else math.inf


def _detect(costs: Costs, scope: str) -> float:
    return {
        "process": costs.detect_process_s,
        "node": costs.detect_node_s,
        "hang": costs.detect_hang_s,
    }[scope]


def walk(
    events: list[tuple[float, Interruption]],
    way: str,
    costs: Costs,
    spares: int,
    ranks_per_node: int,
    *,
    positions_are_wall: bool,
) -> WayResult:
    """The costs of `events` ((seconds, interruption), in order) for `way`; ETTR left at 0 for
    the caller. Positions are wall-clock seconds (a trace) or productive seconds (a fixed
    amount of work, `predict_wall`)."""
    if way not in WAYS:
        raise ConfigError(f"way: {way!r} is not one of {', '.join(WAYS)}")
    if spares < 0 or ranks_per_node < 1:
        raise ConfigError(
            f"spares: must be >= 0 ranks with >= 1 rank per node, got {spares}, {ranks_per_node}"
        )
    res = WayResult(way=way, ettr=0.0, pool=[(0.0, spares)])
    lost = dict.fromkeys(
        ("detect", "recover", "restart", "failed iteration", "lost work", "checkpoints"), 0.0
    )
    pool = spares
    cycle = costs.checkpoint_interval_s + costs.checkpoint_save_s
    for t, ev in events:
        res.nodes_lost += ev.permanent
        if way == "restart":
            spent = sum(lost.values())
            if positions_are_wall:  # productive seconds so far, checkpoint stalls taken out
                done = max(0.0, t - spent) * costs.checkpoint_interval_s / cycle
            else:
                done = t
            lost["detect"] += (
                costs.restart_detect_hang_s if ev.scope == "hang" else _detect(costs, ev.scope)
            )
            lost["restart"] += costs.restart_s
            since = math.fmod(done, costs.checkpoint_interval_s)
            if costs.checkpoint_interval_s - since < 1e-9 * costs.checkpoint_interval_s:
                since = 0.0  # on a checkpoint, up to rounding (8 x 0.1 s fmod 4 x 0.1 s)
            lost["lost work"] += since
            res.restarts += 1
            continue
        lost["detect"] += _detect(costs, ev.scope)
        lost["failed iteration"] += costs.iteration_s
        in_place = way == "respawn" and not ev.permanent and ev.scope != "node"
        need = ranks_per_node if ev.scope == "node" else 1
        if in_place:
            lost["recover"] += costs.respawn_s
            res.recoveries += 1
            res.respawns += 1
        elif pool >= need:
            pool -= need
            res.spares_used += need
            lost["recover"] += costs.recover_s
            res.recoveries += 1
        else:  # out of redundancy: save what survives, start again with the spares back
            lost["checkpoints"] += costs.checkpoint_save_s
            lost["restart"] += costs.restart_s
            res.restarts += 1
            pool = spares
        res.pool.append((t / 3600, pool))
    res.lost_s = lost
    return res


def simulate(trace: Trace, way: str, costs: Costs, spares: int, ranks_per_node: int) -> WayResult:
    """`way` through `trace` with `spares` spare ranks (module docstring): its ETTR and what it
    lost, and why."""
    span = trace.duration_h * 3600
    events = [(i.time_h * 3600, i) for i in trace.interruptions]
    res = walk(events, way, costs, spares, ranks_per_node, positions_are_wall=True)
    failures = res.lost_total_s
    if way == "restart":
        cycle = costs.checkpoint_interval_s + costs.checkpoint_save_s
        saves = math.floor(max(0.0, span - failures) / cycle)
        res.lost_s["checkpoints"] += saves * costs.checkpoint_save_s
    res.ettr = max(0.0, span - res.lost_total_s) / span
    return res


def predict_wall(
    work_s: float,
    events: list[tuple[float, Interruption]],
    way: str,
    costs: Costs,
    spares: int,
    ranks_per_node: int,
    *,
    start_s: float,
) -> tuple[float, WayResult]:
    """Wall seconds to compute `work_s` productive seconds through `events` (at productive
    positions): the first launch's `start_s`, the work, every event's cost and (restart) the
    checkpoint stalls; with the walk's result (its ETTR = work / wall)."""
    res = walk(events, way, costs, spares, ranks_per_node, positions_are_wall=False)
    if way == "restart":
        res.lost_s["checkpoints"] += math.floor(work_s / costs.checkpoint_interval_s) * (
            costs.checkpoint_save_s
        )
    wall = start_s + work_s + res.lost_total_s
    res.ettr = work_s / wall
    return wall, res
