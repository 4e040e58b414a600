"""`deadpool bench store-state`: the coordinator's store over a long run, with and without pruning.

A real store server (`membership.host_store`, as `deadpool coordinator` hosts it) runs in a
child process; this process plays the job's side through `Membership`'s own methods:
  - every iteration, rank 0 publishes its record (`publish_metrics`) and its progress;
  - every `--iterations / --generations` iterations, a recovery of `--ranks` ranks: the plan, every
    survivor's holdings report, the sources, the roster and the decision, torch's rendezvous key
    of each rank under the new generation's prefix (`process_group_store`), and every rank's
    phase stamps; the generation is then complete.
Two runs: **kept** (every record stays: what the store held before `hotswap/protocol/retention.py`) and
**pruned** (rank 0's window, and the coordinator's `Pruner` deleting finished generations a
batch per iteration, as it does a batch per tick). Sampled at 0%, 10%, ... 100% of the
iterations: the store's key count (`num_keys`) and the server process's resident memory (VmRSS).

    deadpool bench store-state --iterations 100000 --json store-state.json
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from typing import Any

import torch.distributed as dist

from ...config.numbers import number_arg
from ...errors import ConfigError
from ...hotswap.coordinator.pruning import Pruner
from ...hotswap.protocol.membership import Membership
from ...hotswap.protocol.messages import (
    Decision,
    HoldingsReport,
    IterationRecord,
    Plan,
    Roster,
    Sources,
)
from ...hotswap.protocol.retention import RETAINED_ITERATIONS
from ...hotswap.protocol.seal import JobSeal, new_secret
from ..report import publish, text_row
from .control_plane_job import rss_mib

SERVER = (
    "import sys; from megatron_deadpool.hotswap.protocol.membership import host_store; "
    "store = host_store('127.0.0.1', 0); print(store.port, flush=True); sys.stdin.read()"
)
"""The child process: hosts the store until its stdin closes."""

SAMPLES = 10


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--iterations",
        type=number_arg(integer=True, minimum=1),
        default=100_000,
        help="iterations per run (default 100000)",
    )
    parser.add_argument(
        "--ranks",
        type=number_arg(integer=True, minimum=1),
        default=64,
        help="simulated ranks per generation (default 64)",
    )
    parser.add_argument(
        "--generations",
        type=number_arg(integer=True, minimum=1),
        default=20,
        help="recoveries per run (default 20)",
    )
    parser.add_argument("--json", dest="json_path", help="write the results as JSON here")


def _record(iteration: int, generation: int) -> IterationRecord:
    """A record of the size rank 0 publishes (~380 bytes)."""
    return IterationRecord(
        iteration=iteration,
        time=time.time(),
        loss=2.345678901234,
        grad_norm=1.23456789,
        lr=2.9999e-4,
        iter_time_s=0.123456789,
        replication_s=0.0123456789,
        generation=generation,
        committed_iteration=iteration - 1 or None,
        replica_bytes_sent=123456789,
        replication_parts_s={"copy": 0.00123, "send": 0.00456, "wait": 0.000789},
    )


def _recover(coord: Membership, ranks: list[Membership], g: int, iteration: int) -> None:
    """Generation g's recovery, every key it writes (rank g % world replaced by a spare)."""
    world = len(ranks)
    dead = g % world
    plan = Plan(g, g - 1, world, (dead,), (dead,), {dead: f"s{g}"})
    coord.publish_plan(plan)
    for r, m in enumerate(ranks):
        if r != dead:
            holds: dict[str, tuple[int, ...]] = {
                "local": (iteration,),
                str((r - 1) % world): (iteration,),
            }
            m.report_holdings(g, r, HoldingsReport(f"a{r}", iteration, holds))
    coord.publish_sources(g, Sources({dead: (dead + 1) % world}))
    slots = {r: f"s{g}" if r == dead else f"a{r}" for r in range(world)}
    coord.publish_roster(Roster(g, world, slots, restore_iteration=iteration))
    coord.decide(g, Decision.roster(iteration))
    for r, m in enumerate(ranks):
        m.process_group_store(g).set(f"0//cpu//0/{r}", "127.0.0.1:12345")  # as torch's gloo
        m.stamp(g, "joined", r)
        m.stamp(g, "restored", r)
    ranks[0].stamp(g, "first_iteration", 0)


def run_one(args: argparse.Namespace, pruned: bool) -> dict[str, Any]:
    """One run against a fresh server; its samples."""
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60)
        )
        seal = JobSeal(new_secret())
        coord = Membership(client, "coordinator", seal)
        ranks = [Membership(client, f"a{r}", seal) for r in range(args.ranks)]
        coord.publish_roster(Roster(0, args.ranks, {r: f"a{r}" for r in range(args.ranks)}))
        pruner = Pruner(coord) if pruned else None
        per_generation = args.iterations // (args.generations + 1)
        every = max(1, args.iterations // SAMPLES)
        samples: list[dict[str, Any]] = []
        g, t0 = 0, time.monotonic()
        for it in range(1, args.iterations + 1):
            if it % every == 1 or every == 1:
                samples.append(_sample(client, server.pid, it - 1, t0))
            if it % per_generation == 0 and g < args.generations:
                g += 1
                _recover(coord, ranks, g, it - 1)
                if pruner is not None:
                    pruner.completed(g)
            ranks[0].publish_metrics(
                _record(it, g), retain=None if pruner is None else RETAINED_ITERATIONS
            )
            ranks[0].set_progress(it)
            if pruner is not None:
                pruner.step()
        samples.append(_sample(client, server.pid, args.iterations, t0))
        return {"mode": "pruned" if pruned else "kept", "generations": g, "samples": samples}
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(timeout=30)


def _sample(client: Any, pid: int, iteration: int, t0: float) -> dict[str, Any]:
    return {
        "iteration": iteration,
        "keys": client.num_keys(),
        "server_rss_mib": round(rss_mib(pid), 2),
        "wall_s": round(time.monotonic() - t0, 2),
    }


def run(args: argparse.Namespace) -> int:
    if args.iterations < 1 or args.ranks < 2 or args.generations < 0:
        raise ConfigError("store-state: --iterations >= 1, --ranks >= 2, --generations >= 0")
    if args.iterations // (args.generations + 1) < 1:
        raise ConfigError("store-state: --iterations must exceed --generations")
    runs = [run_one(args, pruned) for pruned in (False, True)]
    specs = ["<7", ">10", ">10", ">12", ">9"]
    lines = [text_row(["mode", "iteration", "keys", "server MiB", "wall s"], specs)]
    for result in runs:
        for s in result["samples"]:
            cells = [result["mode"], str(s["iteration"]), str(s["keys"])]
            cells += [f"{s['server_rss_mib']:.1f}", f"{s['wall_s']:.1f}"]
            lines.append(text_row(cells, specs))
    settings = {k: getattr(args, k) for k in ("iterations", "ranks", "generations")}
    publish(lines, {"settings": settings, "runs": runs}, args.json_path)
    return 0
