"""`deadpool bench planning`: DeadPool's pure planning steps timed at a large job's size.

Two steps run on one core with no communication, and their time grows with the job:

* **replica placement** (`replication/placement.py`), which every process computes at start-up
  and after each recovery: tp=8 pp=4 dp=N/32 with 4 ranks per node, and pure data parallelism
  (tp=1 pp=1 dp=N, one rank per node; Megatron's groups built outside the timed part), k=2;
* **a standby's rebuild** (`hotswap/coordinator/rebuild.py`) of the job's state from the survivors'
  re-registrations after it took over, with one node (8 ranks) lost.

Targets at 16,384 ranks (the default size): placement under 1 s (NVRx's rank assignment scale
test: 2^14 ranks in under a second), a rebuild under 2 s. Each step runs once untimed, then
`--repeats` times (interleaved); the best and the median are reported, and the target is judged on the best
(what the machine can do; a shared machine's load only adds). `--check` exits 1 when a target
is missed. The tests check the same steps' results, not their time.

    deadpool bench planning [--ranks 16384] [--repeats 3] [--json planning.json] [--check]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from ..config.numbers import number_arg
from ..hotswap.coordinator.rebuild import Registration, rebuild
from ..replication.placement import Layout, place_replicas
from .report import publish, text_row

RANKS_PER_LOST_NODE = 8


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ranks",
        type=number_arg(integer=True, minimum=32),
        default=16384,
        help="job size (a multiple of 32; default 16384)",
    )
    parser.add_argument(
        "--replicas",
        type=number_arg(integer=True, minimum=1),
        default=2,
        help="replicas per shard (default 2)",
    )
    parser.add_argument(
        "--repeats",
        type=number_arg(integer=True, minimum=1),
        default=3,
        help="runs of each step (default 3)",
    )
    parser.add_argument("--json", dest="json_path", help="write the results as JSON here")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")


def steps(ranks: int, replicas: int) -> dict[str, tuple[str, float, Callable[[], object]]]:
    """name -> (what it does, target in seconds at 16,384 ranks, the step)."""
    dp = ranks // 32
    flat = Layout(tp=1, pp=1, dp=ranks, ranks_per_node=1)
    flat.dp_groups  # noqa: B018 - Megatron's groups, built outside the timed part
    slots = {r: f"a{r}" for r in range(ranks)}
    lost = range(3 * RANKS_PER_LOST_NODE, 4 * RANKS_PER_LOST_NODE)  # node 3
    records = {
        f"a{r}": Registration(f"a{r}", rank=r, generation=0, world_size=ranks, slots=slots)
        for r in range(ranks)
        if r not in lost
    }
    return {
        "placement": (
            f"place k={replicas}: tp 8 x pp 4 x dp {dp}, 4 ranks per node",
            1.0,
            lambda: place_replicas(Layout(tp=8, pp=4, dp=dp, ranks_per_node=4), replicas),
        ),
        "placement_dp": (
            f"place k={replicas}: dp {ranks}, 1 rank per node",
            1.0,
            lambda: place_replicas(flat, replicas),
        ),
        "rebuild": (
            f"standby rebuild: {len(records)} re-registrations, one node lost",
            2.0,
            lambda: rebuild(records, world_size=ranks, spares=[]),
        ),
    }


def measure(ranks: int, replicas: int, repeats: int) -> dict[str, Any]:
    """Each step `repeats` times, interleaved: seconds (best, median, all) and the target."""
    todo = steps(ranks, replicas)
    for _, _, step in todo.values():
        step()  # warm-up, untimed: first-call costs (lazy imports, caches) are not the step's
    times: dict[str, list[float]] = {name: [] for name in todo}
    for _ in range(repeats):
        for name, (_, _, step) in todo.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return {
        "ranks": ranks,
        "replicas": replicas,
        "repeats": repeats,
        "steps": {
            name: {
                "what": what,
                "best_s": min(times[name]),
                "median_s": statistics.median(times[name]),
                "runs_s": times[name],
                "target_s": target,
                "met": min(times[name]) < target,
            }
            for name, (what, target, _) in todo.items()
        },
    }


def table(result: dict[str, Any]) -> list[str]:
    specs = ["<60", ">9", ">9", ">8", ">4"]
    lines = [text_row(["step", "best", "median", "target", "met"], specs)]
    for s in result["steps"].values():
        cells = [s["what"], f"{s['best_s']:.3f}s", f"{s['median_s']:.3f}s", f"<{s['target_s']}s"]
        lines.append(text_row([*cells, "yes" if s["met"] else "NO"], specs))
    return lines


def run(args: argparse.Namespace) -> int:
    if args.ranks < 32 or args.ranks % 32 or args.repeats < 1 or args.replicas < 1:
        print(
            "deadpool bench planning: --ranks must be a multiple of 32, --repeats and "
            "--replicas at least 1",
            file=sys.stderr,
        )
        return 2
    print(f"deadpool bench planning: {args.ranks} ranks, best of {args.repeats}", flush=True)
    result = measure(args.ranks, args.replicas, args.repeats)
    publish(table(result), result, args.json_path)
    missed = [name for name, s in result["steps"].items() if not s["met"]]
    return 1 if args.check and missed else 0
