"""A standby coordinator that takes the job over when the coordinators listed before it are lost.

On a cluster the primary coordinator runs on the batch host, which also trains. A standby
(`deadpool coordinator --standby`, on another node) hosts a store of its own but serves no job:
it holds no job token (a seal that only the job's secret makes: `seal.py`), so no process can
join it. It watches the coordinators listed before it in `--deadpool-coordinator` as a store
client; once none of them has answered for the heartbeat timeout, it takes over:
  1. it publishes its identity (epoch = its place in the list) and the job token: processes
     looking for a coordinator (`failover.py`) now find it;
  2. it collects their re-registrations, until every rank of the newest roster reported or the
     heartbeat timeout after the first process that held a rank did. While no such process
     came and an earlier coordinator answers again, it withdraws (token gone) and watches on:
     the job is never split across two stores;
  3. it rebuilds the job's state from them (`rebuild.py`) in its store and hands the
     coordinator (`coordinator.py`) the roster, the waiting spares and the ranks that never
     re-registered, which are then recovered as any dead rank is: spares take their slots, or
     the job ends out of redundancy with the survivors saving what they hold.
`StandbyWatch` is the primary's side: it notes a standby it cannot reach (harmless while the
primary lives) and sees a standby that took over, so that the primary stands down.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections.abc import Callable

from ...config.deadpool import DeadpoolConfig
from ...devices.threads import DeviceThread, start_thread
from ...errors import CoordinatorUnreachableError
from ..protocol.connection import STORE_ERRORS, BoundedStore, open_client
from ..protocol.coordinator_view import CoordinatorView
from ..protocol.messages import CoordinatorIdentity, Registration, member_of
from ..protocol.seal import JobSeal
from ..protocol.sealed_store import SealedStore
from .coordinator import Coordinator
from .events import EventLog
from .rebuild import Rebuilt, rebuild

JOINED_SCAN_S = 1.0
"""Seconds between two looks for re-registrations of spares that joined after the start."""


class PeerWatch:
    """Bounded store clients of the job's other coordinators, each store opened with its own
    seal (its entry's in `coordinators`: a value copied there from another store proves
    nothing)."""

    def __init__(self, seal: JobSeal, op_timeout: float, coordinators: list[str]) -> None:
        """`coordinators`: the job's `--deadpool-coordinator` list, primary first."""
        self.seal = seal
        self.op_timeout = op_timeout
        self.coordinators = coordinators
        self.clients: dict[str, CoordinatorView] = {}

    def probe(self, address: str) -> tuple[bool, CoordinatorView | None]:
        """(whether the store at `address` answers, a client of it if it serves this job)."""
        try:
            membership = self.clients.get(address)
            if membership is None:
                client = open_client(address, max(0.5, min(2.0, self.op_timeout)))
                store = BoundedStore(client, self.op_timeout)
                seal = self.seal.for_store(self.coordinators.index(address))
                membership = CoordinatorView(SealedStore(store, "coordinator", seal))
                self.clients[address] = membership
            return True, membership if membership.serves_job() else None
        except STORE_ERRORS:
            self.clients.pop(address, None)
            return False, None

    def ended(self, address: str, membership: CoordinatorView) -> bool | None:
        """Whether the job ended at the coordinator at `address` (`membership`: its client);
        None when it stopped answering since its probe (frozen or lost in between)."""
        try:
            return membership.shutdown_requested()
        except STORE_ERRORS:
            self.clients.pop(address, None)
            return None

    def serving(self, addresses: list[str]) -> tuple[str, CoordinatorView] | None:
        """The first of `addresses` that serves this job, with a client of it."""
        for address in addresses:
            membership = self.probe(address)[1]
            if membership is not None:
                return address, membership
        return None

    def watch_in_background(self, addresses: list[str], interval: float) -> threading.Event:
        """Probe `addresses` every `interval` on a thread (a probe of a frozen store takes
        seconds); the event is set once one of them serves this job. Stops when it is set by
        the caller too."""
        answering = threading.Event()

        def run() -> None:
            while not answering.is_set():
                if self.serving(addresses) is not None:
                    answering.set()
                time.sleep(interval)

        start_thread(run, name="deadpool-peer-watch")
        return answering


class Standby:
    """Entry `index` of `--deadpool-coordinator`, waiting to take the job over."""

    def __init__(
        self,
        cfg: DeadpoolConfig,
        index: int,
        world_size: int,
        membership: CoordinatorView,
        events: EventLog,
        say: Callable[[str], None],
    ) -> None:
        """`membership`: this standby's own store (not serving until it takes over), sealed
        with the job's secret."""
        self.cfg = cfg
        self.index = index
        self.earlier = cfg.coordinators[:index]
        self.world_size = world_size
        self.membership = membership
        self.events = events
        self.say = say
        self.watch = PeerWatch(
            membership.seal, max(0.5, min(2.0, cfg.heartbeat_timeout / 4)), cfg.coordinators
        )
        self.spares = [f"s{i}" for i in range(cfg.spares)]
        self.members = [f"a{r}" for r in range(world_size)] + self.spares
        # Where each process re-registers: under its member name, or its task index when it
        # connected for the first time during the takeover without knowing its name yet
        # (Megatron-LM).
        self.keys = {m: m for m in self.members}
        self.keys.update({f"task{t}": member_of(t, world_size) for t in range(len(self.members))})
        self.registrations: dict[str, Registration] = {}
        self.primary_last_seen: float | None = None  # wall time the earlier one last answered
        self._next_late_read = 0.0
        self._next_scan = 0.0

    # ------------------------------------------------------------------ watching
    def wait_for_loss(self) -> bool:
        """Block while an earlier coordinator serves the job: True once none answered for the
        heartbeat timeout, False when the job ended there (this standby was not needed)."""
        cfg = self.cfg
        start = time.monotonic()
        last_seen: float | None = None
        while True:
            found = self.watch.serving(self.earlier)
            now = time.monotonic()
            ended = None if found is None else self.watch.ended(*found)
            if found is not None and ended is not None:
                address = found[0]
                if last_seen is None:
                    self.events("standby_watching", coordinator=address, epoch=self.index)
                    self.say(
                        f"standby for {address}: taking over if it is silent for "
                        f"{cfg.heartbeat_timeout:g}s"
                    )
                last_seen = now
                if ended:
                    self.events("standby_not_needed", coordinator=address)
                    self.say(f"the job ended at {address}: standby not needed")
                    return False
            elif last_seen is None:
                if now - start > cfg.connect_timeout:
                    raise CoordinatorUnreachableError(
                        f"standby: no coordinator of this job answered at "
                        f"{','.join(self.earlier)} within {cfg.connect_timeout:.0f}s (start the "
                        "primary first; the same job secret, DEADPOOL_JOB_TOKEN(_FILE))"
                    )
            elif now - last_seen > cfg.heartbeat_timeout:
                silent = now - last_seen
                self.primary_last_seen = time.time() - silent
                self.events(
                    "coordinator_lost",
                    coordinators=self.earlier,
                    silent_s=round(silent, 3),
                    last_seen=time.time() - silent,
                )
                self.say(f"{','.join(self.earlier)} silent for {silent:.1f}s: taking over")
                return True
            time.sleep(cfg.heartbeat_interval / 2)

    # ------------------------------------------------------------------ taking over
    def take_over(self) -> Rebuilt | None:
        """Serve the job and collect the re-registrations; the rebuilt state, or None when
        this standby withdrew (an earlier coordinator answers again before anyone came)."""
        cfg = self.cfg
        self.membership.set_identity(CoordinatorIdentity(self.index, secrets.token_hex(8)))
        self.membership.set_token()
        self.events("taking_over", epoch=self.index)
        answering = PeerWatch(
            self.membership.seal, self.watch.op_timeout, cfg.coordinators
        ).watch_in_background(self.earlier, cfg.heartbeat_interval)
        first_active: float | None = None
        while True:
            self._read_registrations()
            now = time.monotonic()
            if first_active is None:
                if any(r.slots is not None for r in self.registrations.values()):
                    first_active = now
                    answering.set()  # committed: stop watching
                elif answering.is_set():
                    self.membership.withdraw(self.members)
                    self.registrations.clear()
                    self.events("withdrew", coordinators=self.earlier)
                    self.say(
                        f"{','.join(self.earlier)} answers again before any process came: "
                        "withdrew"
                    )
                    return None
            if first_active is not None:
                state = rebuild(self.registrations, self.world_size, self.spares)
                if state is not None and (
                    not state.missing or now - first_active > cfg.heartbeat_timeout
                ):
                    return state
            time.sleep(0.05)

    def hand_over(self, coord: Coordinator, state: Rebuilt) -> None:
        """Write the rebuilt state into this store, give `coord` the job, and let the waiting
        processes go on (`rebuilt`)."""
        m = self.membership
        if state.layout is not None:
            m.publish_layout(state.layout)
        m.set_progress(state.progress)
        for rank, iteration in sorted(state.finished.items()):
            m.report_finished(rank, iteration)
        for member in state.done:
            m.restore_done(member)
        why = (
            f"did not re-register with standby coordinator {self.cfg.coordinators[self.index]} "
            f"within {self.cfg.heartbeat_timeout:g}s (lost with its node?)"
        )
        coord.adopt(
            state.roster,
            state.spares,
            state.next_generation,
            {member: why for member in state.missing.values()},
            lost_at=self.primary_last_seen,
        )
        m.publish_rebuilt(self.index)
        self.events(
            "rebuilt",
            generation=state.roster.generation,
            slots=state.roster.slots,
            missing=sorted(state.missing),
            spares=state.spares,
            next_generation=state.next_generation,
            progress=state.progress,
            registered=sorted(self.registrations),
        )
        self.say(
            f"took over generation {state.roster.generation} at iteration {state.progress}: "
            f"{len(self.registrations)} process(es) re-registered"
            + (f"; rank(s) {sorted(state.missing)} never did" if state.missing else "")
        )

    def late_registrations(self, coord: Coordinator) -> None:
        """After the hand-over (call every tick): a spare that re-registers late, or starts
        only now (it announces itself), waits again."""
        now = time.monotonic()
        if now < self._next_late_read:
            return
        self._next_late_read = now + 0.5
        late = self._read_registrations()
        for member in self.spares:
            if (
                not coord.knows(member)
                and member not in self.registrations
                and self.membership.announced(member)
            ):
                self.registrations[member] = Registration(member=member)
                late.append(member)
        for member in late:
            record = self.registrations[member]
            if record.rank is None and not record.done:
                coord.add_spare(member, "spare_rejoined")

    def _find_joined_spares(self) -> None:
        """Spares that joined the job after it started (`joining.py`) re-register under names
        this standby could not know in advance: look for them among the store's keys (every
        `JOINED_SCAN_S` at most: a listing of every key)."""
        now = time.monotonic()
        if now < self._next_scan:
            return
        self._next_scan = now + JOINED_SCAN_S
        for name in self.membership.registered_names():
            if name not in self.keys and name[:1] == "s" and name[1:].isdigit():
                self.keys[name] = name
                self.spares.append(name)
                self.members.append(name)

    def _read_registrations(self) -> list[str]:
        """Read the re-registrations not read yet; their members."""
        new = []
        self._find_joined_spares()
        for key, member in self.keys.items():
            if member in self.registrations:
                continue
            record = self.membership.registration(key)
            if record is not None:
                self.registrations[member] = dataclasses.replace(record, member=member)
                self.events(
                    "rejoined",
                    member=member,
                    rank=record.rank,
                    generation=record.generation,
                    last_completed=record.last_completed,
                )
                new.append(member)
        return new


class StandbyWatch(DeviceThread):
    """The primary's view of its standbys: one it cannot reach is logged (harmless while the
    primary lives); one that took over (`superseded`) means the primary must stand down."""

    def __init__(
        self,
        cfg: DeadpoolConfig,
        seal: JobSeal,
        events: EventLog,
        say: Callable[[str], None],
    ) -> None:
        super().__init__(name="deadpool-standby-watch", daemon=True)
        self.cfg = cfg
        self.standbys = cfg.coordinators[1:]
        self.watch = PeerWatch(
            seal, max(0.5, min(2.0, cfg.heartbeat_timeout / 4)), cfg.coordinators
        )
        self.events = events
        self.say = say
        self.superseded: str | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        """A standby is lost once silent for the heartbeat timeout; one that never answered,
        after the connect timeout (it may still be starting)."""
        start = time.monotonic()
        last_seen: dict[str, float] = {}
        lost: set[str] = set()
        while not self.stopped.wait(self.cfg.heartbeat_interval):
            for address in self.standbys:
                reachable, serving = self.watch.probe(address)
                now = time.monotonic()
                if serving is not None and serving.rebuilt():
                    self.superseded = address
                    self.events("superseded", standby=address)
                    return
                if reachable:
                    last_seen[address] = now
                    if address in lost:
                        lost.discard(address)
                        self.events("standby_back", standby=address)
                        self.say(f"standby {address} answers again")
                    continue
                seen = last_seen.get(address)
                silent = now - (start if seen is None else seen)
                limit = self.cfg.connect_timeout if seen is None else self.cfg.heartbeat_timeout
                if address not in lost and silent > limit:
                    lost.add(address)
                    self.events("standby_lost", standby=address, ever_seen=seen is not None)
                    self.say(
                        f"standby {address} unreachable: harmless while this coordinator lives, "
                        "but a loss of this node would now end the job"
                    )
