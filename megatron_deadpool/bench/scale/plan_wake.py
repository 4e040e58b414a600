"""`deadpool bench plan-wake`: how soon after the coordinator plans a recovery every survivor's
plan waiter has woken, at 1,024-16,384 ranks.

A crash's survivors stop training when their plan waiter (`hotswap/worker/plan_waiter.py`) wakes:
each blocks in a store WAIT on its own wake-up key of the next generation (`Keys.PLAN_WAKE`), and
the coordinator sets one per member of its roster right after it published the plan
(`CoordinatorView.publish_plan`, then `wake_plan_waiters`: the sealed wake-up keys in batches of
`BATCH_KEYS`). This process hosts the store (torch's TCPStore, as `deadpool coordinator` does)
and makes those two calls; `--procs` waiter processes hold one store connection per simulated
survivor (`store_wire.WireStore`: the requests torch's client sends, on greenlets), each blocked
in the WAIT a real waiter makes, and record when each is answered. Per size, the median of `--repeats` plans:

- publish_s: the coordinator's `publish_plan` and `wake_plan_waiters` calls (its own cost);
- wake_s: the call's start -> the last survivor's WAIT answered (every survivor can stop).

    deadpool bench plan-wake --ranks 1024 4096 16384 --json plan-wake.json

What differs from a cluster: the waiter processes share this machine's cores with the store
(at a lower priority, `NICE`, as `bench control-plane`'s simulated ranks): an upper bound for
the store's side; a real waiter then reads the latest plan (one round trip) and starts its abort
(`devices.abort`), not included. `planner/measured.py` holds the figures `deadpool plan` uses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from ...config.numbers import number_arg
from ...hotswap.protocol.membership import Membership, host_store
from ...hotswap.protocol.messages import Keys, Plan
from ...hotswap.protocol.seal import JobSeal
from .store_wire import FOREVER_S, Hub, WireStore

NICE = 10
"""Niceness of the waiter processes (`bench control-plane`'s simulated ranks' default)."""
SETTLE_S = 1.0
"""Pause between every waiter's WAIT sent and the plan, so that the store has them all."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ranks",
        type=number_arg(integer=True, minimum=1, maximum=16384),
        nargs="+",
        default=[1024, 4096, 16384],
        help="survivors per measurement (default 1024 4096 16384)",
    )
    parser.add_argument(
        "--repeats",
        type=number_arg(integer=True, minimum=1),
        default=3,
        help="plans per size: medians (default 3)",
    )
    parser.add_argument(
        "--procs",
        type=number_arg(integer=True, minimum=1, maximum=64),
        default=4,
        help="waiter processes (each holds ranks/procs connections; default 4)",
    )
    parser.add_argument("--json", dest="json_path", help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    results = [measure(n, args.repeats, args.procs) for n in args.ranks]
    print(f"{'ranks':>7}  {'publish_plan':>12}  {'plan -> last survivor woken':>27}")
    for r in results:
        print(f"{r['ranks']:>7,}  {r['publish_s']:>11.3f}s  {r['wake_s']:>26.3f}s")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump({"sizes": results}, f, indent=2)
    return 0


def measure(ranks: int, repeats: int, procs: int) -> dict[str, Any]:
    """`repeats` plans, each waking `ranks` blocked waiters spread over `procs` processes."""
    store = host_store("127.0.0.1", 0)
    coordinator = Membership(store, "coordinator", JobSeal("plan-wake bench"))
    members = [f"a{i}" for i in range(ranks)]
    per = -(-ranks // procs)
    waiters = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                __name__,
                f"127.0.0.1:{store.port}",
                str(first),
                str(min(per, ranks - first)),
                str(repeats),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        for first in range(0, ranks, per)
    ]
    publish, wake = [], []
    try:
        for g in range(1, repeats + 1):
            for w in waiters:
                _expect(w, f"ready {g}")
            time.sleep(SETTLE_S)
            plan = Plan(
                generation=g,
                base=g - 1,
                world_size=ranks,
                dead=(0,),
                needy=(0,),
                replaced={0: f"s{g}"},
            )
            t0 = time.time()
            coordinator.publish_plan(plan)
            coordinator.wake_plan_waiters([g], members)
            publish.append(time.time() - t0)
            last = max(float(_expect(w, f"woke {g}").split()[2]) for w in waiters)
            wake.append(last - t0)
    finally:
        for w in waiters:
            w.kill()
            w.wait()
    return {
        "ranks": ranks,
        "publish_s": statistics.median(publish),
        "wake_s": statistics.median(wake),
        "publish_each_s": publish,
        "wake_each_s": wake,
    }


def _expect(waiter: subprocess.Popen[str], prefix: str) -> str:
    assert waiter.stdout is not None
    line = waiter.stdout.readline().strip()
    if not line.startswith(prefix):
        raise RuntimeError(f"a waiter process said {line!r}, expected {prefix!r}")
    return line


def waiters(address: str, first: int, count: int, repeats: int) -> None:
    """One waiter process: `count` connections (members a{first}..), each blocked on its
    wake-up key of generation 1, then 2, ... `repeats`; says "ready G" once every WAIT of G is
    sent and "woke G T" (T: the wall time the last was answered) once all were."""
    os.nice(NICE)  # the store's server first, as on a cluster
    hub = Hub()

    def main() -> None:
        stores = hub.each(lambda i: WireStore(hub, address, FOREVER_S), range(count))
        for g in range(1, repeats + 1):
            woke: list[float] = []

            def one(i: int, g: int = g, woke: list[float] = woke) -> None:
                stores[i].wait([Keys.PLAN_WAKE.format(g=g, member=f"a{first + i}")])
                woke.append(time.time())

            def announce(g: int = g) -> None:
                print(f"ready {g}", flush=True)

            for i in range(count):
                hub.spawn(one, i)
            hub.spawn(announce)  # after every WAIT was sent: the hub runs them in order
            while len(woke) < count:
                hub.sleep(0.01)
            print(f"woke {g} {max(woke)!r}", flush=True)

    hub.run(main)


if __name__ == "__main__":
    waiters(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
