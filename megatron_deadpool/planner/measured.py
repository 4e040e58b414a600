"""Figures of `deadpool plan`'s recovery estimate that come from measurements, not guesses.

`agree_s(world)`: seconds from a rank's failure until the coordinator published the new roster
in a job of `world` processes - the plan, every survivor's report of what it holds arriving
through the store, the decision and the roster. Measured by `deadpool bench control-plane` with
simulated ranks (one store connection each, doing what a rank does; the median of 3 failures
per size):

    deadpool bench control-plane --ranks 1024 4096 16384 --json control-plane.json

on `MEASURED_ON`, where 8 processes simulating the ranks share the two cores with the store and
the coordinator: an upper bound. The coordinator's own part is small (0.003 / 0.010 / 0.035 s
at the same sizes, measured alone in the same run); at 16,384 ranks the time goes to the
survivors' reports reaching the store while it also serves every rank's beat and plan watch
(0.77 s of the coordinator process's CPU from the failure to the roster).
Between the measured sizes the figure is interpolated in log2(world); below the smallest it is
the smallest's; above the largest it grows in proportion to the world (one report per rank).

Re-measure on the machine that will host the coordinator and replace `AGREE_S` with the
median `failure_to_roster_s` of each size in the JSON's "simulated" section.

`AGENT_DETECT_S`: seconds from a process's crash until the coordinator names it dead, when a
node agent started it (the Slurm scripts' default): the agent waits on its processes' pidfds and
reports the exit at once, waking the coordinator (`hotswap/launch/node_agent.py`). Measured by
`bench recovery`'s hot swap run by node agents (TP2xDP2, a SIGKILL at iteration 8; the injected
fault's stamp to the coordinator's `process_dead`, its "detect failure" row):

    deadpool bench recovery --node-agents --repeats 6

(2026-11-29, Python 3.12, torch 2.14.1: 0.032-0.074 s, median 0.045 s; before the agents waited
on pidfds, `deadpool train --node-agents` gave 0.24-0.86 s with a 1 s beat). A GPU process's
exit also tears its CUDA context down first: not included.

Pure data and arithmetic: no torch, no communication.
"""

from __future__ import annotations

import math

MEASURED_ON = (
    "the project's 2-core CPU machine, otherwise idle, torch 2.13 TCPStore (libuv) on loopback, "
    "the simulated ranks on the same cores, 2026-11-27: an upper bound for a coordinator host"
)
COMMAND = "deadpool bench control-plane --ranks 1024 4096 16384 --json cp.json"

AGREE_S: dict[int, float] = {1024: 0.076, 4096: 0.338, 16384: 1.300}
"""world size -> failure -> roster published (s), simulated ranks."""

AGENT_DETECT_S = 0.045
"""A crashed process -> named dead, through its node agent (s): median of 6 repeats."""
AGENT_DETECT_COMMAND = "deadpool bench recovery --node-agents --repeats 6"


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
