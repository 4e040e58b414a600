"""Simulated ranks for `deadpool bench control-plane`: what ranks do to the store, no training.

One process runs many simulated ranks (`python -m megatron_deadpool.bench.scale.sim_ranks CONFIG`,
CONFIG a JSON object). Every rank keeps its own connection to the coordinator's store and, on
it, issues the store operations a real rank issues, through the same `Membership` methods and in
the same order (`tests/bench/test_control_plane.py` checks the sequence against
`Recovery.agree`):

- start: `announce` (its ready key and first beat);
- while nothing fails: one beat per heartbeat interval (+1 on its counter), then the plan
  watch's read of the newest planned generation (not while recovering, and not by a spare);
- when a peer fails (the bench says "fail"): as a survivor in `Driver.recover`, report the
  failed collective (`report_failure`), then, in `Recovery.agree`, report its
  holdings (what the placement makes it hold: its own snapshot and its owners' replicas), wait
  for the decision, read the plan and wait for the newcomers' claims of their slots; then join
  the new generation as the driver does (read the
  sources, stamp `joined`), rendezvous on the generation's store the way torch's NCCL group
  does (rank 0 sets a 128-byte unique id, every other rank gets it), stamp `restored`; rank 0
  stamps `first_iteration` once every rank restored. Spares wait for a slot blocked on their
  wake-up key (as `Driver.wait_for_slot`), claim it and join as newcomers.

What differs from real ranks, and why (this machine has 2 cores and a 20,000-file limit):
- every simulated rank is a greenlet, its connection a `store_wire.WireStore` (torch's wire
  protocol, the same requests as torch's client, one at a time per connection): one thread per
  process waits for all its connections at once, so that the processes' CPU goes to the store
  and the coordinator, not to thread hand-offs and system calls per request, as it would on a
  cluster where every rank has a host of its own;
- heartbeats travel on one connection per `hb_group` ranks, and the plan watch's reads on
  another (a real rank makes both on a heartbeat connection of its own): 2 connections per rank
  would exceed the store process's file limit at 16,384 ranks; the server handles the same
  number of beats and reads per second;
- a spare waits for its wake-up key on its only connection (a real spare has a second one for
  it: `wakeup.spare_wakeups`);
- the processes run at a lower priority (`nice`) than the coordinator: on a cluster the
  coordinator's host is not shared with the ranks;
- pure work (the new roster, each rank's holdings) is computed once per process;
- the objects made so far are frozen out of Python's garbage collector (`gc.freeze`) once the
  ranks connected and after each recovery: one process holds thousands of ranks' objects, and
  collections of that heap in the middle of a recovery are no real rank's cost.

Control, one line each on stdin: `kill MEMBER` (the rank stops beating and stamps its fault,
like an injected crash; answered `killed MEMBER`), `fail` (run one recovery as survivors; answered
`recovered G`), `stop` (exit at once). `ready N` is printed once every rank connected.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from typing import Any

from ...hotswap.protocol.membership import Membership
from ...hotswap.protocol.messages import CLAIMED, HoldingsReport, Keys, Roster, Verdict
from ...hotswap.protocol.seal import JobSeal, job_secret
from ...replication.placement import Layout, place_replicas
from .store_wire import FOREVER_S, Hub, WireStore

UNIQUE_ID = b"\0" * 128  # the size of an ncclUniqueId


def survivor_report(
    members: Membership, g: int, rank: int, holds: dict[str, list[int]], iteration: int
) -> None:
    """A survivor's first step in `Recovery.agree`: its report for generation g (then it waits
    for the decision: `Membership.wait_decision`)."""
    report = HoldingsReport(
        member=members.member,
        last_completed=iteration,
        holds={k: tuple(v) for k, v in holds.items()},
    )
    members.report_holdings(g, rank, report)


class RankStore(WireStore):
    """What a real rank's client of the job's store sends (`connection.BoundedStore` over
    torch's): a `set` confirmed by a check after it, and `set_then_add` confirmed by its add
    (`store_protocol.ConfirmedSets`). The connection seen through a prefix (`prefixed`: the
    process groups' rendezvous, on torch's own client) sends torch's requests alone."""

    def set(self, key: str, value: str | bytes) -> None:
        super().set(key, value)
        self.check([key])

    def set_then_add(self, key: str, value: str, counter: str, amount: int) -> int:
        super().set(key, value)
        return self.add(counter, amount)


class SimProcess:
    """The simulated ranks and spares of one process, each a greenlet on `self.hub`."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.seal = JobSeal(job_secret() or "")  # the bench's, in the environment
        self.hub = Hub()
        self.iteration = int(cfg["iteration"])
        layout = Layout(**cfg["layout"])
        self.placement = place_replicas(layout, cfg["replicas"])
        self.world = layout.world_size
        self.roster = Roster(0, self.world, {r: f"a{r}" for r in range(self.world)})
        self.ranks: dict[int, Membership] = {}  # live ranks of this process
        self.spares: list[Membership] = []
        self.connected: set[str] = set()  # members that announced themselves: they beat
        self.dead: set[str] = set()  # killed: they no longer beat
        self.recovering = False  # this process's ranks are in a recovery: no plan watch

    def _store(self) -> RankStore:
        return RankStore(self.hub, self.cfg["address"], float(self.cfg["connect_timeout"]))

    # ------------------------------------------------------------------ start
    def connect(self) -> None:
        group = int(self.cfg["hb_group"])
        names = [f"a{r}" for r in self.cfg["ranks"]] + list(self.cfg["spares"])
        for i in range(0, len(names), group):
            beats, watch = self._store(), self._store()
            some = names[i : i + group]
            self.hub.spawn(self._beat, [Membership(beats, m, self.seal) for m in some])
            self.hub.spawn(self._watch, [Membership(watch, m, self.seal) for m in some])

        def announce(members: Membership) -> Membership:
            members.announce()
            self.connected.add(members.member)  # from now on it beats
            return members

        for members in self.hub.each(
            announce, [Membership(self._store(), m, self.seal) for m in names]
        ):
            if members.member.startswith("a"):
                self.ranks[int(members.member[1:])] = members
            else:
                self.spares.append(members)
        for members in self.spares:
            self.hub.spawn(self._spare, members)

    def _beat(self, beats: list[Membership]) -> None:
        """One beat per interval for each of `beats` (on their shared connection) that has
        connected and is not dead, spread over the interval."""
        pause = float(self.cfg["interval"]) / len(beats)
        while True:
            for members in beats:
                if self._beating(members.member):
                    members.heartbeat()
                self.hub.sleep(pause)

    def _watch(self, watches: list[Membership]) -> None:
        """The plan watch's read (`PlanWatch`: the newest planned generation) once per interval
        for each of `watches` (on their shared connection) that holds a slot and is not
        recovering, as a real rank's heartbeat thread reads after each beat. On a connection
        apart from the beats' so that neither waits for the other."""
        pause = float(self.cfg["interval"]) / len(watches)
        while True:
            for members in watches:
                if not self.recovering and self._holds_slot(members.member):
                    members.latest_plan()
                self.hub.sleep(pause)

    def _beating(self, member: str) -> bool:
        """`member` announced itself and was not killed."""
        return member in self.connected and member not in self.dead

    def _holds_slot(self, member: str) -> bool:
        """A live rank's member (a spare only once it joined)."""
        if not self._beating(member):
            return False
        return member.startswith("a") or any(m.member == member for m in self.ranks.values())

    def holds(self, rank: int) -> dict[str, list[int]]:
        """What a rank that replicated up to `iteration` holds (its own and its owners')."""
        its = [self.iteration - 1, self.iteration]
        return {"local": its, **{str(o): its for o in self.placement.held_by[rank]}}

    # ------------------------------------------------------------------ failures
    def kill(self, member: str) -> None:
        """The rank stops beating and stamps its fault (as an injected crash does)."""
        self.dead.add(member)
        rank = next(r for r, m in self.ranks.items() if m.member == member)
        self.ranks.pop(rank).record_fault()

    def recover(self) -> int:
        """Every live rank of this process goes through one recovery as a survivor, each in
        its own greenlet (so each blocks on the store as a real rank does)."""
        roster = self.roster
        g = roster.generation + 1
        new: list[Roster] = []

        def survive(item: tuple[int, Membership]) -> None:
            rank, members = item
            members.report_failure("a peer failed")  # `Driver.recover`'s first requests
            survivor_report(members, g, rank, self.holds(rank), self.iteration)
            decision = members.wait_decision(g, FOREVER_S)
            if decision is None or decision.verdict is not Verdict.ROSTER:
                raise RuntimeError(f"simulated recovery of generation {g}: decision {decision}")
            assert decision.restore_iteration is not None
            plan = members.plan(g)
            if plan is None:
                raise RuntimeError(f"simulated recovery: generation {g} decided without a plan")
            members.wait_newcomers(g, plan.needy, FOREVER_S)
            if not new:  # pure work, once per process
                new.append(roster.successor(plan, decision.restore_iteration) or members.roster(g))
            self._join(new[0], rank, members)

        self.recovering = True
        try:
            self.hub.each(survive, list(self.ranks.items()))
        finally:
            self.recovering = False
        self.roster = new[0]
        return g

    def _join(self, roster: Roster, rank: int, members: Membership) -> None:
        """Driver.join + restore as far as the store sees them; rank 0 then finishes its first
        iteration once every rank restored (its collectives would wait for them)."""
        g = roster.generation
        members.sources(g)
        members.stamp(g, "joined", rank)
        store = members.store
        assert isinstance(store, WireStore)
        pg_store = store.prefixed(Keys.PROCESS_GROUPS.format(g=g))  # `process_group_store`
        if rank == 0:
            pg_store.set("sim/unique_id", UNIQUE_ID)
        else:
            pg_store.get("sim/unique_id")
        members.stamp(g, "restored", rank)
        if rank == 0:
            while members.stamp_count(g, "restored") < self.world:
                self.hub.sleep(0.002)
            members.stamp(g, "first_iteration", 0)

    def _spare(self, members: Membership) -> None:
        """Driver.wait_for_slot (a newcomer claims its slot), then a newcomer's join;
        afterwards a rank like the others."""
        seen = members.spare_epoch()
        while True:
            if members.shutdown_requested():
                return
            roster = members.roster(members.generation())
            rank = roster.rank_of(members.member)
            if rank is not None:
                break
            if members.wait_spare_epoch(seen + 1, FOREVER_S):
                seen += 1
        if members.claim_slot(roster.generation, rank) != CLAIMED:
            raise RuntimeError(f"{members.member}: its slot was given up before it claimed it")
        self.roster = roster
        self._join(roster, rank, members)
        self.ranks[rank] = members

    # ------------------------------------------------------------------ control
    def serve(self) -> None:
        """Connect, then obey the bench's lines on stdin until `stop` or its end."""
        rss0 = _rss_kib()
        self.connect()
        gc.freeze()
        print(f"ready {len(self.ranks) + len(self.spares)} {_rss_kib() - rss0}", flush=True)
        pending = b""
        while True:
            self.hub.wait_readable(sys.stdin)
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                cmd, _, arg = line.decode().strip().partition(" ")
                if cmd == "kill":
                    self.kill(arg)
                    print(f"killed {arg}", flush=True)
                elif cmd == "fail":
                    g = self.recover()
                    gc.freeze()
                    print(f"recovered {g}", flush=True)
                elif cmd == "stop":
                    return


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
        sim.hub.run(sim.serve)
    except Exception:  # noqa: BLE001 - the bench reads the traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # greenlets are parked in store calls: no interpreter teardown


if __name__ == "__main__":
    main()
