"""Pure planning and accounting of `deadpool chaos`, the random-failure soak (command: chaos_cli).

`plan_chaos` draws one episode's failures from a seed: a Bernoulli process over the iterations
(each iteration fails with probability 1/MTBF, so the gaps between failures are geometric -
the discrete exponential - with mean MTBF iterations, and at most one failure starts per
iteration). Every failure is one survivable event: a single rank killed or hung, or one whole
node (failure domain) killed or hung. Placement keeps every replica outside its owner's node,
so one such event never takes an owner with all its holders; the planner refuses a spare pool
smaller than the largest event, and the launcher refills the pool after each swap.

`match_failures` pairs the failures that fired with the recoveries the run recorded, and
`time_stats` summarises recovery times. Nothing here starts a process.
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..config.faults import FaultSpec, parse_fault
from ..errors import ConfigError

KINDS = ("kill", "hang", "node")
"""`kill`: one rank SIGKILLed; `hang`: one rank SIGSTOPped (found by the heartbeat monitor);
`node`: every rank of one failure domain killed (or hung, half of the time)."""

FIRST_ITERATION = 3
"""No failure before this iteration: iteration 1's replicas are still in flight at the start
of iteration 2, so an earlier failure has no committed snapshot to go back to."""


def episode_seed(seed: int, episode: int) -> str:
    """The planner's seed for `episode` (1-based) of a soak seeded with `seed`."""
    return f"deadpool-chaos:{seed}:{episode}"


def parse_kinds(text: str | Sequence[str]) -> tuple[str, ...]:
    """`kill,hang,node` -> ('kill', 'hang', 'node'); unknown kinds raise `ConfigError`."""
    items = text.split(",") if isinstance(text, str) else list(text)
    kinds = tuple(dict.fromkeys(k.strip() for k in items if k.strip()))
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ConfigError(
            f"chaos --kinds: {', '.join(bad) or 'nothing'} given; choose from {', '.join(KINDS)}"
        )
    return kinds


def spares_needed(kinds: Iterable[str], ranks_per_node: int) -> int:
    """Spares the largest single event of `kinds` takes at once."""
    return ranks_per_node if "node" in kinds else 1


def failure_iterations(
    rng: random.Random, iters: int, mtbf_iters: float, first: int = FIRST_ITERATION
) -> list[int]:
    """Iterations in [first, iters] that fail: geometric gaps with mean `mtbf_iters`."""
    if mtbf_iters < 1:
        raise ConfigError(f"chaos --mtbf-iters: must be >= 1, got {mtbf_iters}")
    p = 1.0 / mtbf_iters
    out: list[int] = []
    it = first - 1
    while True:
        if p >= 1.0:
            gap = 1
        else:  # inverse CDF of the geometric distribution on {1, 2, ...}
            gap = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))
        it += gap
        if it > iters:
            return out
        out.append(it)


def plan_chaos(
    seed: int | str,
    iters: int,
    mtbf_iters: float,
    world_size: int,
    ranks_per_node: int,
    spares: int,
    kinds: Sequence[str] = KINDS,
    *,
    first_iteration: int = FIRST_ITERATION,
) -> list[str]:
    """Fault specs (`faults.py` forms) of one episode, deterministic for `seed`."""
    kinds = parse_kinds(kinds)
    if world_size % ranks_per_node:
        raise ConfigError(
            f"chaos: ranks-per-node ({ranks_per_node}) must divide the world size {world_size}"
        )
    nodes = world_size // ranks_per_node
    if "node" in kinds and nodes < 2:
        raise ConfigError("chaos --kinds node: the job has one node; a node failure loses all")
    need = spares_needed(kinds, ranks_per_node)
    if spares < need:
        raise ConfigError(
            f"chaos: {spares} spare(s) cannot replace the largest failure of kinds "
            f"{','.join(kinds)} ({need} rank(s) at once); give --spares {need} or more"
        )
    rng = random.Random(seed if isinstance(seed, str) else f"deadpool-chaos:{seed}")
    specs: list[str] = []
    for it in failure_iterations(rng, iters, mtbf_iters, first_iteration):
        kind = rng.choice(kinds)
        if kind == "node":
            mode = rng.choice(("kill", "hang"))
            specs.append(f"node:{rng.randrange(nodes)}@{it}:{mode}")
        else:
            specs.append(f"{rng.randrange(world_size)}@{it}:{kind}")
    return specs


def describe(spec: str) -> str:
    """The chaos kind of a spec: kill, hang, node-kill or node-hang."""
    fault = parse_fault(spec)
    return f"node-{fault.kind}" if fault.node is not None else fault.kind


# ---------------------------------------------------------------------- accounting
_INJECTED = re.compile(
    r"\[deadpool r(?P<rank>\d+) g\d+\] WARNING fault injection: (?P<kind>\w+) "
    r"at iteration (?P<it>\d+)"
)


def fired_from_logs(texts: Iterable[str]) -> set[tuple[int, int]]:
    """(rank, iteration) of every injected failure the workers' logs report."""
    out: set[tuple[int, int]] = set()
    for text in texts:
        for m in _INJECTED.finditer(text):
            out.add((int(m["rank"]), int(m["it"])))
    return out


@dataclass
class Failure:
    """One planned failure and what became of it."""

    spec: str
    kind: str
    iteration: int
    ranks: list[int]
    injected: bool = False
    recovered: bool = False
    recovery: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "kind": self.kind,
            "iteration": self.iteration,
            "ranks": self.ranks,
            "injected": self.injected,
            "recovered": self.recovered,
            "recovery": self.recovery,
        }


def match_failures(
    specs: Sequence[str],
    ranks_per_node: int,
    fired: set[tuple[int, int]],
    recoveries: Sequence[dict[str, Any]],
    *,
    run_ok: bool,
) -> tuple[list[Failure], list[dict[str, Any]]]:
    """Pair fired failures (in iteration order) with the run's recoveries (in order).

    A failure is covered when the next recoveries' dead ranks together include every rank it
    hit (a node's ranks may be found dead in one recovery or, rarely, two); it counts as
    recovered when covered and `run_ok` (the run finished with the reference's losses and
    digest). Returns the failures and the recoveries no failure explains."""
    faults: list[tuple[str, FaultSpec]] = sorted(
        ((s, parse_fault(s)) for s in specs), key=lambda x: x[1].iteration
    )
    out: list[Failure] = []
    queue = list(recoveries)
    for spec, fault in faults:
        ranks = fault.ranks(ranks_per_node)
        f = Failure(spec, describe(spec), fault.iteration, ranks)
        f.injected = any((r, fault.iteration) in fired for r in ranks)
        out.append(f)
        if not f.injected:
            continue
        covered: set[int] = set()
        used: list[dict[str, Any]] = []
        while queue and not set(ranks) <= covered:
            dead = set(queue[0]["dead_ranks"])
            if used and not dead & set(ranks):
                break  # the next recovery belongs to another failure
            used.append(queue.pop(0))
            covered |= dead
        if set(ranks) <= covered:
            f.recovered = run_ok
            f.recovery = _merge(used)
    return out, queue


def _merge(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One failure's recovery record (the sum of two when a node was found dead in two)."""
    phases: dict[str, float] = {}
    for rec in recs:
        for k, v in rec.get("phases_s", {}).items():
            phases[k] = round(phases.get(k, 0.0) + v, 4)
    return {
        "generations": [rec.get("generation") for rec in recs],
        "dead_ranks": sorted({r for rec in recs for r in rec["dead_ranks"]}),
        "replaced_by": {k: v for rec in recs for k, v in rec.get("replaced_by", {}).items()},
        "restore_iteration": recs[-1].get("restore_iteration"),
        "recomputed_iterations": sum(rec.get("recomputed_iterations", 0) for rec in recs),
        "phases_s": phases,
        "total_s": round(sum(rec.get("total_s", 0.0) for rec in recs), 4),
    }


def spare_ages(events: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """generation -> {spare member: seconds since it was spawned} when that generation's plan
    gave it a slot, from the coordinator's event log. A young spare may still be importing
    megatron-core when it is assigned: its recovery then includes its start-up."""
    start = next((e["t"] for e in events if e.get("event") == "roster"), None)
    born: dict[str, float] = {}
    out: dict[int, dict[str, float]] = {}
    for e in events:
        if e.get("event") == "spare_added":
            born[e["member"]] = e["t"]
        elif e.get("event") == "plan" and "slots" in e:
            needy = {str(r) for r in e.get("needy", [])}
            ages = {}
            for rank, member in e["slots"].items():
                t0 = born.get(member, start)
                if rank in needy and t0 is not None:
                    ages[member] = round(e["t"] - t0, 2)
            out[e["generation"]] = ages
    return out


def time_stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, min, median, mean, p90 and max of `values` (seconds)."""
    if not values:
        return {"count": 0, "min": None, "median": None, "mean": None, "p90": None, "max": None}
    s = sorted(values)
    p90 = s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)]
    return {
        "count": len(s),
        "min": round(s[0], 3),
        "median": round(statistics.median(s), 3),
        "mean": round(statistics.fmean(s), 3),
        "p90": round(p90, 3),
        "max": round(s[-1], 3),
    }
