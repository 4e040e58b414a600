"""Figures of `deadpool plan`'s recovery estimate that come from measurements, not guesses.

`agree_s(world)`: seconds the coordinator needs to agree on a recovery of a job of `world`
processes - from noticing the failure to the published plan, plus from the last survivor's
report to the published roster (reading every report, choosing the restore iteration, writing
the roster). Measured by `deadpool bench control-plane` ("coordinator alone": one client writes
the ranks' beats and reports in bulk, so that only the coordinator and its store are timed; the
median of 3 failures per size) with

    deadpool bench control-plane --ranks 1024 4096 16384 --sim-ranks --json control-plane.json

on `MEASURED_ON`. Between the measured sizes the figure is interpolated in log2(world); below
the smallest it is the smallest's; above the largest it grows in proportion to the world (the
coordinator reads one report per rank). Not included: the survivors' own round trips to the
store (one network round trip each, in parallel) and their time to notice the failure.

Re-measure on the machine that will host the coordinator and replace `AGREE_S` with the
`notice_to_plan_s + reports_to_roster_s` of each size in the JSON's "coordinator_alone".
Pure data and arithmetic: no torch, no communication.
"""

from __future__ import annotations

import math

MEASURED_ON = (
    "the project's 2-core CPU machine shared with other work (load average 45), torch 2.13 "
    "TCPStore (libuv) on loopback, 2026-11-22: an upper bound for an idle coordinator host"
)
COMMAND = "deadpool bench control-plane --ranks 1024 4096 16384 --sim-ranks --json cp.json"

AGREE_S: dict[int, float] = {1024: 0.158, 4096: 0.358, 16384: 1.906}
"""world size -> crash noticed -> plan published + every report in -> roster published (s)."""


def agree_s(world: int) -> float:
    """The measured agreement time for `world` processes (see the module docstring)."""
    sizes = sorted(AGREE_S)
    if world <= sizes[0]:
        return AGREE_S[sizes[0]]
    if world >= sizes[-1]:
        return AGREE_S[sizes[-1]] * world / sizes[-1]
    hi = next(i for i, n in enumerate(sizes) if n >= world)
    lo_n, hi_n = sizes[hi - 1], sizes[hi]
    frac = (math.log2(world) - math.log2(lo_n)) / (math.log2(hi_n) - math.log2(lo_n))
    return AGREE_S[lo_n] + frac * (AGREE_S[hi_n] - AGREE_S[lo_n])
