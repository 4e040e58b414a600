"""Figures of `deadpool plan`'s recovery estimate that come from measurements, not guesses.

`agree_s(world)`: seconds from a rank's failure until the coordinator published the new roster
in a job of `world` processes - the plan, every survivor's report of what it holds arriving
through the store, the decision and the roster. Measured by `deadpool bench control-plane` with
simulated ranks (one store connection each, doing what a rank does; the median of 3 failures
per size):

    deadpool bench control-plane --ranks 1024 4096 16384 --json control-plane.json

on `MEASURED_ON`, where 8 processes simulating the ranks share the two cores with the store and
the coordinator: an upper bound for that, but the simulated survivors did not yet report the
failed collective (5 requests each, as `Driver.recover` does first; on a slower machine on
2026-12-01 it added 2-3 s at 16,384 ranks: docs/reproduce.md). The coordinator's own part is
small (0.003 / 0.010 / 0.035 s at the same sizes, measured alone in the same run); at 16,384
ranks the time goes to the survivors' reports reaching the store while it also serves every
rank's beat and plan watch (0.77 s of the coordinator process's CPU from the failure to the
roster).
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

`PLAN_WAKE_S`: seconds from the coordinator's plan until the last survivor's plan waiter woke
(`hotswap/worker/plan_waiter.py`: on NCCL a crash's survivors stop training then, not at their
next collective with the dead rank), in a job of `world` processes: the coordinator publishes the
plan through its real code (`publish_plan`, then `wake_plan_waiters`: one sealed wake-up key per
member) on the store it hosts,
and waiter processes hold one blocked WAIT per survivor (`bench/scale/plan_wake.py`; median of 3
plans per size) - on the same 2 cores, so an upper bound:

    deadpool bench plan-wake --ranks 1024 4096 16384

(2026-11-29, Python 3.11, torch 2.13, 4 waiter processes: 0.103-0.131 s at 1,024, 0.177-0.201 s
at 4,096, 0.667-0.938 s at 16,384; the coordinator's two calls themselves 0.04-0.11 s.)
Interpolated like `AGREE_S`.

Pure data and arithmetic: no torch, no communication.
"""

from __future__ import annotations

import math

MEASURED_ON = (
    "the project's 2-core CPU machine, otherwise idle, torch 2.13 TCPStore (libuv) on loopback, "
    "the simulated ranks on the same cores, 2026-11-27, without the survivors' failure reports"
)
COMMAND = "deadpool bench control-plane --ranks 1024 4096 16384 --json cp.json"

AGREE_S: dict[int, float] = {1024: 0.076, 4096: 0.338, 16384: 1.300}
"""world size -> failure -> roster published (s), simulated ranks."""

AGENT_DETECT_S = 0.045
"""A crashed process -> named dead, through its node agent (s): median of 6 repeats."""
AGENT_DETECT_COMMAND = "deadpool bench recovery --node-agents --repeats 6"


PLAN_WAKE_S: dict[int, float] = {1024: 0.120, 4096: 0.186, 16384: 0.743}
"""world size -> the plan published -> every survivor's plan waiter woken (s)."""
PLAN_WAKE_COMMAND = "deadpool bench plan-wake --ranks 1024 4096 16384"
PLAN_WAKE_DATE = "2026-11-29"


def agree_s(world: int) -> float:
    """The measured agreement time for `world` processes (see the module docstring)."""
    return _at(AGREE_S, world)


def plan_wake_s(world: int) -> float:
    """The measured plan wake-up for `world` processes (see the module docstring)."""
    return _at(PLAN_WAKE_S, world)


def _at(figures: dict[int, float], world: int) -> float:
    """`figures` (world size -> seconds) at `world`: log2-interpolated between the measured
    sizes, the smallest's below them, in proportion to the world above them (one request per
    rank)."""
    sizes = sorted(figures)
    if world <= sizes[0]:
        return figures[sizes[0]]
    if world >= sizes[-1]:
        return figures[sizes[-1]] * world / sizes[-1]
    hi = next(i for i, n in enumerate(sizes) if n >= world)
    lo_n, hi_n = sizes[hi - 1], sizes[hi]
    frac = (math.log2(world) - math.log2(lo_n)) / (math.log2(hi_n) - math.log2(lo_n))
    return figures[lo_n] + frac * (figures[hi_n] - figures[lo_n])
