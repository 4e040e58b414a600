"""A failure trace for `deadpool bench goodput`: which failures strike a run, where (pure).

A trace is a list of `--fail` specs (`config/faults.py`), one per failure, spread over the
run's iterations with a seeded jitter, each of a kind drawn from a mix:
  - ``crash``: one process ends (`RANK@ITER`), its node fine;
  - ``hang``: one process stops answering (`RANK@ITER:hang`);
  - ``node``: a whole node is lost (`node:N@ITER`).
The default mix groups the 419 unexpected interruptions of Llama 3 405B's 54-day pre-training
(16,384 H100, "The Llama 3 Herd of Models", Table 5) by what they do to a job:
  - crash, 324 (77.3%): a GPU's own fault - faulty GPU 148, HBM3 72, SRAM 19, GPU system
    processor 17, thermal interface and sensor 6, silent data corruption 6 - and software bugs
    54 and dependencies 2, each ending the process on that GPU;
  - node, 88 (21.0%): network switch or cable 35, host maintenance 32, NIC 7, SSD 3, power
    supply 3, server chassis 2, IO expansion board 2, CPU 2, system memory 2;
  - hang, 7 (1.7%): NCCL watchdog timeouts.
A GPU fault may strike again on the same GPU; the trace treats each failure as independent
(which favours respawning in place: `--deadpool-respawn-limit` is what bounds a bad node).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

from ..config.faults import parse_fault
from ..errors import ConfigError

KINDS = ("crash", "node", "hang")
LLAMA3_MIX: dict[str, float] = {"crash": 324 / 419, "node": 88 / 419, "hang": 7 / 419}
"""Llama 3 405B's unexpected interruptions by what they do to a job (module docstring)."""
MIN_GAP = 3
"""Iterations between two failures: each recovery (which recomputes at most one iteration)
is over before the next failure strikes."""
FIRST = 3
"""The first iteration a failure may strike: iteration 1's replication round committed."""


def parse_mix(text: str) -> dict[str, float]:
    """`crash=0.8,node=0.2` -> {"crash": 0.8, "node": 0.2}; `ConfigError` naming --mix."""
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, value = part.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if kind not in KINDS or not weight >= 0 or weight == float("inf"):
            raise ConfigError(
                f"--mix: {part!r} is not KIND=WEIGHT with KIND one of {', '.join(KINDS)} and "
                "WEIGHT a finite number >= 0, e.g. crash=0.77,node=0.21,hang=0.02"
            )
        mix[kind] = weight
    if not sum(mix.values()) > 0:
        raise ConfigError("--mix: the weights must not all be 0, e.g. crash=1")
    return mix


def failure_trace(
    *,
    iters: int,
    failures: int,
    mix: Mapping[str, float],
    world_size: int,
    ranks_per_node: int,
    seed: int,
) -> list[str]:
    """`failures` `--fail` specs in iteration order, at least MIN_GAP iterations apart, between
    FIRST and iters - 1, their kinds drawn from `mix` and their ranks and nodes at random."""
    span = iters - 1 - FIRST
    if failures < 0 or span < failures * MIN_GAP:
        raise ConfigError(
            f"--failures: {failures} failure(s) need --iters {FIRST + 1 + failures * MIN_GAP} or "
            f"more (one per {MIN_GAP} iterations from iteration {FIRST}); --iters is {iters}"
        )
    rng = random.Random(seed)
    step = span / failures if failures else 0.0
    slack = step - MIN_GAP  # the jitter: two failures stay MIN_GAP apart (floors below)
    kinds = rng.choices(list(mix), weights=list(mix.values()), k=failures)
    nodes = world_size // ranks_per_node
    specs = []
    for i, kind in enumerate(kinds):
        iteration = FIRST + math.floor(i * step + rng.uniform(0, slack))
        if kind == "node":
            specs.append(f"node:{rng.randrange(nodes)}@{iteration}")
        else:
            rank = rng.randrange(world_size)
            specs.append(f"{rank}@{iteration}" + (":hang" if kind == "hang" else ""))
    return specs


def kind_of(spec: str) -> str:
    """The trace kind of a `--fail` spec of a trace."""
    fault = parse_fault(spec)
    return "node" if fault.node is not None else "hang" if fault.kind == "hang" else "crash"
