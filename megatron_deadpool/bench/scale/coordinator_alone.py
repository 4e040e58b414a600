"""The coordinator's own cost at a job size, the ranks' side written in bulk (`deadpool bench
control-plane`'s first part).

One client writes what the ranks would (beats, then every survivor's report) with
batched `multi_set`s, so that what is timed is the coordinator and its store requests alone: a
heartbeat sweep, the tick that notices a crash and publishes the plan, and the tick that reads
every report, decides and publishes the roster. Not the ranks' traffic (the simulated ranks,
`control_plane.py`, measure that).

The real coordinator runs unchanged; the bench moves its monotonic clock by hand
(`hotswap.coordinator.clock.ManualClock`), one sweep interval before each sweep it wants and not at all
while it times failure handling, so that no sweep falls into those ticks, and reads the costs
through its observer (`control_plane_job.CostLog`).
"""

from __future__ import annotations

import argparse
import datetime
import math
import signal
import statistics
import time
from typing import Any

import torch.distributed as dist

from ...hotswap.coordinator.clock import ManualClock
from ...hotswap.coordinator.coordinator import Coordinator
from ...hotswap.coordinator.events import EventLog
from ...hotswap.protocol.membership import Membership, host_store
from ...hotswap.protocol.messages import HoldingsReport, Keys
from ...hotswap.protocol.seal import JobSeal, new_secret
from ...hotswap.protocol.sealed_store import BATCH_KEYS
from ...replication.placement import place_replicas
from .control_plane_job import CostLog, SimLiveness, layout_for, rss_mib, settings_for


def _multi_set(store: Any, keys: list[str], values: list[str]) -> None:
    """`store.multi_set` in batches (`store`: a torch store; its type stubs lack the method)."""
    for i in range(0, len(keys), BATCH_KEYS):
        store.multi_set(keys[i : i + BATCH_KEYS], values[i : i + BATCH_KEYS])


def coordinator_alone(ranks: int, args: argparse.Namespace, sweeps: int = 9) -> dict[str, Any]:
    """The coordinator's own work at `ranks`: `sweeps` heartbeat sweeps (every counter moved
    since the last), one crash noticed -> plan, every report in -> roster."""
    placement = place_replicas(layout_for(ranks), 1)
    store = host_store("127.0.0.1", 0, timeout_s=args.timeout)
    rss0 = rss_mib()
    liveness, costs, clock = SimLiveness(), CostLog(), ManualClock()
    seal = JobSeal(new_secret())
    coord = Coordinator.from_settings(
        settings_for(ranks, args.heartbeat_timeout, args.timeout),
        Membership(store, "coordinator", seal),
        placement=placement,
        liveness=liveness,
        events=EventLog(None),
        clock=clock,
        observer=costs,
    )
    writer = dist.TCPStore(
        "127.0.0.1",
        store.port,
        is_master=False,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    try:
        t0 = time.perf_counter()
        coord.start()
        start_s = time.perf_counter() - t0
        members = [*coord.roster.slots.values(), *coord.spares]
        keys = [Keys.HEARTBEAT.format(member=m) for m in members]
        for beat in range(1, sweeps + 2):  # every counter moves between sweeps
            _multi_set(writer, keys, [seal.seal(k, str(beat)) for k in keys])
            writer.check(keys[-1:])  # the sets are one-way: a round trip orders them first
            clock.advance(coord.detector.sweep_interval)  # a sweep is due
            coord.tick()
        sweep = costs.sweeps[1:]  # the first saw every counter for the first time
        # From here the clock stands still: the ticks below time failure handling alone.
        dead = ranks // 2 + 1
        liveness.codes[coord.roster.slots[dead]] = -signal.SIGKILL
        t0, cpu0 = time.perf_counter(), time.thread_time()
        coord.tick()  # notices the exit, plans
        plan_s, plan_cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        g = Membership(writer, "bench", seal).latest_plan()
        its = (99, 100)
        survivors = [r for r in range(ranks) if r != dead]
        keys = [Keys.HOLDINGS.format(g=g, rank=r) for r in survivors]
        reports = [
            seal.seal(
                key,
                HoldingsReport(
                    member=f"a{r}",
                    last_completed=100,
                    holds={"local": its, **{str(o): its for o in placement.held_by[r]}},
                ).encode(),
            )
            for key, r in zip(keys, survivors)
        ]
        _multi_set(writer, keys, reports)
        writer.add(Keys.HOLDINGS_COUNT.format(g=g), len(survivors))
        coord.tick()  # reads the reports, decides, publishes the roster
        if not costs.decisions or coord.roster.generation != g:
            raise RuntimeError(f"coordinator alone at {ranks} ranks: no decision")
        decision = costs.decisions[-1].cost
        interval = coord.detector.sweep_interval
        sweep_cpu = statistics.median(s.cpu_s for s in sweep)
        sweep_process_cpu = statistics.median(s.process_cpu_s for s in sweep)
        return {
            "ranks": ranks,
            "start_s": start_s,
            "keys_per_sweep": sweep[0].members,
            "requests_per_sweep": math.ceil(sweep[0].members / BATCH_KEYS),
            "sweep_cpu_ms": sweep_cpu * 1e3,
            "sweep_wall_ms": statistics.median(s.wall_s for s in sweep) * 1e3,
            "sweep_core_share": sweep_cpu / interval,
            "sweep_process_cpu_ms": sweep_process_cpu * 1e3,
            "sweep_process_core_share": sweep_process_cpu / interval,
            "notice_to_plan_s": plan_s,
            "notice_to_plan_cpu_s": plan_cpu,
            "reports_to_roster_s": decision.wall_s,
            "reports_to_roster_cpu_s": decision.cpu_s,
            "store_rss_growth_mib": rss_mib() - rss0,
        }
    finally:
        coord.close()
