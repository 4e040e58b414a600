"""Simulated ranks for `deadpool bench control-plane`: what ranks do to the store, no training.

One process runs many simulated ranks (`python -m megatron_deadpool.bench.sim_ranks CONFIG`,
CONFIG a JSON object). Every rank keeps its own connection to the coordinator's store and, on
it, issues the store operations a real rank issues, through the same `Membership` methods and in
the same order (`tests/bench/test_control_plane.py` checks the sequence against
`recovery.agree`):

- start: `announce` (its ready key and first beat);
- while nothing fails: one beat per heartbeat interval (+1 on its counter);
- when a peer fails (the bench says "fail"): as a survivor in `recovery.agree`, wait for the
  plan, report its holdings (what the placement makes it hold: its own snapshot and its owners'
  replicas), wait for the decision and for the newcomers' claims of their slots; then join
  the new generation as the driver does (read the
  sources, stamp `joined`), rendezvous on the generation's store the way torch's NCCL group
  does (rank 0 sets a 128-byte unique id, every other rank gets it), stamp `restored`; rank 0
  stamps `first_iteration` once every rank restored. Spares wait for a slot blocked on their
  wake-up key (`wakeup.spare_wakeups`, as `Driver.wait_for_slot`), claim it and join as
  newcomers.

What differs from real ranks, and why (this machine has 2 cores and a 20,000-file limit):
- each process walks its ranks phase by phase (all its ranks report, then all wait for the
  decision, then all join) with `workers` threads, instead of one thread per rank: per
  connection the operations are the same, but a rank's `wait` for a key that already exists is
  answered at once instead of being parked on the server and answered when the key is set;
- heartbeats travel on one connection (and thread) per `hb_group` ranks (a real rank has a
  heartbeat connection and thread of its own): 2 connections per rank would exceed the store
  process's file limit at 16,384 ranks; the server handles the same number of beats per second;
- the processes run at a lower priority (`nice`) than the coordinator: on a cluster the
  coordinator's host is not shared with the ranks;
- pure work (the new roster, each rank's holdings) is computed once per process.

Control, one line each on stdin: `kill PID` (the rank stops beating and stamps its fault, like
an injected crash; answered `killed PID`), `fail` (run one recovery as survivors; answered
`recovered G`), `stop` (exit at once). `ready N` is printed once every rank connected.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..hotswap.connection import open_client
from ..hotswap.membership import Membership
from ..hotswap.roster import Roster
from ..hotswap.wakeup import spare_wakeups
from ..replication.placement import Layout, place_replicas

FOREVER_S = 24 * 3600.0
UNIQUE_ID = b"\0" * 128  # the size of an ncclUniqueId


def survivor_report(
    members: Membership, g: int, rank: int, holds: dict[str, list[int]], iteration: int
) -> dict[str, Any]:
    """A survivor's side of `recovery.agree` up to its report for plan g (then it waits for
    the decision: `Membership.wait_decision`); returns the plan."""
    plan = members.wait_plan(g, FOREVER_S)
    members.report_holdings(
        g,
        rank,
        {"last_completed": iteration, "holds": holds, "pid": members.pid},
        expected=plan["world_size"] - len(plan["needy"]),
    )
    return plan


class SimProcess:
    """The simulated ranks and spares of one process."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.address = cfg["address"]
        self.iteration = int(cfg["iteration"])
        layout = Layout(**cfg["layout"])
        self.placement = place_replicas(layout, cfg["replicas"])
        self.world = layout.world_size
        self.roster = Roster(0, self.world, {r: f"a{r}" for r in range(self.world)})
        self.ranks: dict[int, Membership] = {}  # live ranks of this process
        self.lock = threading.Lock()
        self.connected: set[str] = set()  # pids that announced themselves: they beat
        self.dead: set[str] = set()  # killed: they no longer beat
        self.spare_threads: list[threading.Thread] = []
        self.pool = ThreadPoolExecutor(int(cfg["workers"]))

    def _each(self, fn: Callable[..., Any], *items: Any) -> list[Any]:
        """`fn` over `items` on the pool (each connection is used by one thread at a time)."""
        return list(self.pool.map(fn, *items))

    # ------------------------------------------------------------------ start
    def connect(self) -> None:
        timeout = float(self.cfg["connect_timeout"])
        group = int(self.cfg["hb_group"])
        pids = [f"a{r}" for r in self.cfg["ranks"]] + list(self.cfg["spares"])

        def heartbeat_connection(i: int) -> tuple[int, Any]:
            store = open_client(self.address, timeout)
            beats = [Membership(store, pid) for pid in pids[i : i + group]]
            threading.Thread(target=self._beat, args=(beats,), daemon=True).start()
            return i, store

        self._each(heartbeat_connection, range(0, len(pids), group))

        def connect(pid: str) -> Membership:
            members = Membership(open_client(self.address, timeout), pid)
            members.announce()
            with self.lock:  # from now on it beats
                self.connected.add(pid)
            return members

        for members in self._each(connect, pids):
            if members.pid.startswith("a"):
                self.ranks[int(members.pid[1:])] = members
            else:
                thread = threading.Thread(target=self._spare, args=(members,), daemon=True)
                self.spare_threads.append(thread)
        for thread in self.spare_threads:
            thread.start()

    def _beat(self, beats: list[Membership]) -> None:
        """One beat per interval for each of `beats` (on their shared connection) that has
        connected and is not dead, spread over the interval."""
        interval = float(self.cfg["interval"])
        while True:
            for members in beats:
                t0 = time.monotonic()
                with self.lock:
                    live = members.pid in self.connected and members.pid not in self.dead
                if live:
                    members.heartbeat()
                time.sleep(max(0.0, interval / len(beats) - (time.monotonic() - t0)))

    def holds(self, rank: int) -> dict[str, list[int]]:
        """What a rank that replicated up to `iteration` holds (its own and its owners')."""
        its = [self.iteration - 1, self.iteration]
        return {"local": its, **{str(o): its for o in self.placement.held_by[rank]}}

    # ------------------------------------------------------------------ failures
    def kill(self, pid: str) -> None:
        """The rank stops beating and stamps its fault (as an injected crash does)."""
        with self.lock:
            self.dead.add(pid)
        rank = next(r for r, m in self.ranks.items() if m.pid == pid)
        self.ranks.pop(rank).record_fault()

    def recover(self) -> int:
        """Every live rank of this process goes through one recovery as a survivor."""
        with self.lock:
            ranks = dict(self.ranks)
        roster = self.roster
        g = roster.generation + 1

        def report(rank: int, members: Membership) -> dict[str, Any]:
            return survivor_report(members, g, rank, self.holds(rank), self.iteration)

        plan = self._each(report, ranks, ranks.values())[-1]
        decision = self._each(lambda m: m.wait_decision(g, FOREVER_S), ranks.values())[-1]
        if "roster" not in decision:
            raise RuntimeError(f"simulated recovery of generation {g}: decision {decision}")
        self._each(lambda m: m.wait_newcomers(g, plan["needy"], FOREVER_S), ranks.values())
        self.roster = roster.successor(plan, decision["roster"])
        self._each(self._join, ranks, ranks.values())
        if 0 in ranks:
            self._first_iteration(ranks[0])
        return g

    def _join(self, rank: int, members: Membership) -> None:
        """Driver.join + restore as far as the store sees them."""
        g = self.roster.generation
        members.sources(g)
        members.stamp(g, "joined", rank)
        pg_store = members.process_group_store(g)
        if rank == 0:
            pg_store.set("sim/unique_id", UNIQUE_ID)
        else:
            pg_store.get("sim/unique_id")
        members.stamp(g, "restored", rank)

    def _first_iteration(self, members: Membership) -> None:
        """Rank 0 finishes its first iteration once every rank restored (its collectives
        would wait for them)."""
        g = self.roster.generation
        while members.stamp_count(g, "restored") < self.world:
            time.sleep(0.002)
        members.stamp(g, "first_iteration", 0)

    def _spare(self, members: Membership) -> None:
        """Driver.wait_for_slot, then a newcomer's join; afterwards a rank like the others."""
        waiter = spare_wakeups(members)
        while True:
            if members.shutdown_requested():
                return
            roster = members.roster(members.generation())
            rank = roster.rank_of(members.pid)
            if rank is not None:
                break
            waiter.wait(1.0)
        waiter.stop()
        members.claim_slot(roster.generation, rank)
        self.roster = roster
        self._join(rank, members)
        if rank == 0:
            self._first_iteration(members)
        with self.lock:
            self.ranks[rank] = members


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    code = 0
    os.nice(int(os.environ.get("DEADPOOL_SIM_NICE", "0")))
    try:
        sim = SimProcess(json.loads(sys.argv[1]))
        rss0 = _rss_kib()
        sim.connect()
        print(f"ready {len(sim.ranks) + len(sim.spare_threads)} {_rss_kib() - rss0}", flush=True)
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "kill":
                sim.kill(arg)
                print(f"killed {arg}", flush=True)
            elif cmd == "fail":
                print(f"recovered {sim.recover()}", flush=True)
            elif cmd == "stop":
                break
    except Exception:  # noqa: BLE001 - the bench reads the traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # threads are blocked in store calls: no interpreter teardown


if __name__ == "__main__":
    main()
