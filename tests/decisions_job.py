"""A job's coordinator on an in-memory store with a manual clock, driven by hand: the members,
launcher and agents a coordinator sees, for the unit tests of its decisions
(`hotswap/coordinator/test_decisions.py`) and of the store protocol that feeds them
(`hotswap/protocol/test_seal.py`, `test_retention.py`, `test_unsealed_counts.py`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from stores import SEAL

from megatron_deadpool.hotswap.coordinator.clock import ManualClock
from megatron_deadpool.hotswap.coordinator.coordinator import Coordinator
from megatron_deadpool.hotswap.coordinator.events import EventLog
from megatron_deadpool.hotswap.coordinator.liveness import Liveness
from megatron_deadpool.hotswap.coordinator.respawn import RespawnBudget
from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.hotswap.protocol.messages import (
    Decision,
    ErrorReport,
    HoldingsReport,
    Phase,
)
from megatron_deadpool.replication.placement import Layout, place_replicas

HEARTBEAT_TIMEOUT = 10.0
AGREE_TIMEOUT = 20.0


class Launcher:
    """What a local launcher shows the coordinator: the exits it saw, the kills it made."""

    def __init__(self) -> None:
        self.codes: dict[str, int] = {}
        self.killed: list[str] = []

    def exited(self, member: str) -> int | None:
        return self.codes.get(member)

    def exits(self) -> dict[str, int]:
        return dict(self.codes)

    def kill(self, member: str) -> bool:
        self.killed.append(member)
        self.codes[member] = -9
        return True


class Agents:
    """The nodes' agents as a launcher is: each respawn starts a member named, as a joining
    spare is, from the store's counter (`claim`: set once the store exists); a node in `lost`
    has no agent left."""

    def __init__(self, world: int, per_node: int) -> None:
        self.world, self.per_node = world, per_node
        self.claim: Callable[[], str] | None = None
        self.lost: set[int] = set()
        self.nodes: dict[str, int] = {}
        self.started: list[tuple[int, str, int, str]] = []  # (rank, dead, node, new member)

    def node_of(self, member: str) -> int:
        """a{r} on node r // per_node, the spares on the nodes after the actives'."""
        task = int(member[1:]) + (self.world if member[0] == "s" else 0)
        return self.nodes.get(member, task // self.per_node)

    def alive(self, node: int) -> bool:
        return node not in self.lost

    def respawn(self, rank: int, dead: str, node: int) -> str:
        assert self.claim is not None
        member = self.claim()
        self.nodes[member] = node
        self.started.append((rank, dead, node, member))
        return member


class Job:
    """A job of `world` ranks (`per_node` to a node, one replica each) and `spares` spares
    around a real coordinator; every member beats before each tick unless it is `silent`."""

    def __init__(
        self,
        *,
        world: int = 4,
        per_node: int = 1,
        spares: int = 1,
        liveness: Liveness | None = None,
        suspect_after: float | None = None,
        start: bool = True,
        respawn_limit: int = 0,
        respawn_window: float = 3600.0,
        layout: Layout | None = None,
        learn_layout: bool = False,
        join_timeout: float = 600.0,
    ) -> None:
        """`layout`: tp 1 x pp 1 x dp `world` unless given; `learn_layout`: the coordinator is
        given no placement and learns it from the layout rank 0 publishes (a cluster's)."""
        self.store = MemoryStore()
        self.clock = ManualClock()
        self.layout = layout or Layout(tp=1, pp=1, dp=world, ranks_per_node=per_node)
        self.placement = place_replicas(self.layout, 1)
        self.launcher = Launcher()
        self.events = EventLog(None, clock=self.clock.time)
        self.said: list[str] = []
        self.agents = Agents(world, per_node)
        self.agents.claim = Membership(self.store.clone(), "agent", SEAL).claim_spare_name
        self.coord = Coordinator(
            Membership(self.store, "coordinator", SEAL),
            world,
            None if learn_layout else self.placement,
            [f"s{i}" for i in range(spares)],
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            agree_timeout=AGREE_TIMEOUT,
            join_timeout=join_timeout,
            liveness=liveness if liveness is not None else self.launcher,
            events=self.events,
            say=self.said.append,
            sweep_interval=0.0,
            suspect_after=suspect_after,
            clock=self.clock,
            agents=self.agents if respawn_limit else None,
            respawn=RespawnBudget(respawn_limit, respawn_window),
        )
        self.world = world
        names = [f"a{r}" for r in range(world)] + [f"s{i}" for i in range(spares)]
        self.members = {name: Membership(self.store.clone(), name, SEAL) for name in names}
        self.silent: set[str] = set()
        if start:
            self.coord.start()
        for m in self.members.values():
            m.announce()

    def m(self, name: str = "a0") -> Membership:
        return self.members.setdefault(name, Membership(self.store.clone(), name, SEAL))

    def tick(self, seconds: float = 1.0) -> None:
        """Time passes, every member that is not silent beats, the coordinator ticks."""
        self.clock.advance(seconds)
        for name, m in self.members.items():
            if name not in self.silent and name not in self.launcher.codes:
                m.heartbeat()
        self.coord.tick()

    def die(self, *names: str) -> None:
        """Crashed: the launcher sees them exit, their beats stop."""
        for name in names:
            self.launcher.codes[name] = -9

    def holds(self, rank: int, iterations: Iterable[int] = (3, 4)) -> dict[str, tuple[int, ...]]:
        """What rank `rank` holds: its own snapshots, and its owners' replicas."""
        its = tuple(iterations)
        owners = [o for o in range(self.world) if rank in self.placement.holders[o]]
        return {"local": its, **{str(o): its for o in owners}}

    def report(
        self,
        generation: int,
        ranks: Iterable[int],
        last_completed: int = 5,
        segments: bool = True,
    ) -> None:
        """The survivors `ranks` report for plan g, and so do the processes respawned in place
        that the plan names: what their predecessors' segment files hold (`segments`: what the
        survivor would have held; False: nothing, e.g. replicas in GPU memory)."""
        roster = self.coord.roster
        for rank in ranks:
            member = roster.slots[rank]
            report = HoldingsReport(member, last_completed, self.holds(rank))
            self.m(member).report_holdings(generation, rank, report)
        plan = self.m().plan(generation)
        respawned = {started[-1] for started in self.agents.started}
        for rank, member in (plan.replaced if plan else {}).items():
            if member in respawned:
                holds = self.holds(rank) if segments else {"local": ()}
                self.m(member).report_holdings(generation, rank, HoldingsReport(member, 0, holds))

    def raised(
        self,
        member: str,
        phase: Phase,
        *,
        rank: int | None,
        generation: int = 0,
        message: str = "One or both of the .idx and .bin files cannot be found at /nonexistent",
    ) -> None:
        """`member` ends with an exception of its own: it reports it (as `Driver.report_error`
        does) - nothing else; `die` makes the launcher see it exit."""
        tail = ("Traceback (most recent call last):", f"AssertionError: {message}")
        report = ErrorReport(
            1, member, rank, generation, phase, "AssertionError", message, self.clock.time(), tail
        )
        self.m(member).report_error(report)

    def complete(self, generation: int) -> None:
        """Every rank of `generation` joined, restored and trained its first iteration: the
        recovery is over at the next tick."""
        for phase in ("joined", "restored", "first_iteration"):
            for rank, member in self.coord.roster.slots.items():
                self.m(member).stamp(generation, phase, rank)
        self.tick()
        assert not self.coord.recovering

    def decided(self, *members: str) -> None:
        """Ranks `members` (a{r}) crash, the survivors report for plan 1, and the coordinator
        decides it: a roster."""
        self.die(*members)
        self.tick()
        dead = {int(member[1:]) for member in members}
        self.report(1, [r for r in range(self.world) if r not in dead])
        self.tick()
        assert self.decision(1) == Decision.roster(self.world)

    def decision(self, generation: int) -> Decision | None:
        return self.m().wait_decision(generation, 0.0)

    def holder(self, rank: int) -> int:
        return self.placement.holders[rank][0]
