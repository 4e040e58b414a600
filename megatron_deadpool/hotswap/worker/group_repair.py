"""A recovery's reconstruct step when the groups are repaired in place (`devices.reconfigure`).

Survivors keep every `ProcessGroup` object - torch's default group, Megatron's `parallel_state`
globals and every handle the model, DDP and the optimizer hold, DeadPool's replication group -
so nothing is released, walked or rebound: their abort only shuts the groups' connections down
(`devices.abort.keep_groups`), and once the roster of generation g is agreed each process
publishes its reconfigure handles (`RepairHandles`, sealed like every value of the job, under
``gen{g}/repair/{rank}``), reads its groups' members', and reconfigures each of its groups with
uuid g. A survivor does it in two parts: the groups no newcomer is in as soon as the roster is
agreed, while the newcomers still build and claim their slots (`InPlace.repair_ahead`, called
by `Recovery.agree`), the others once they have (`InPlace.reconstruct`) - so that after the
claims only the newcomers' groups are left to repair.

A newcomer builds its world as the survivors once did, on the same store prefix (the generation the
survivors' groups were created in, `RepairHandles.base`, read from a survivor's handles) and in the
same order - so its groups have the survivors' names and rendezvous keys - but created to be
reconfigured (`reconfigurable_creation`: nothing connects); it then publishes its handles and joins
every repaired group. Every wait is bounded (`REPAIR_TIMEOUT_S`; in gloo's reconfigure
`RECONNECT_TIMEOUT_S`): a member lost during the repair fails it with `DistBackendError`, a peer
failure, and the recovery starts over in the next generation (every group is reconnected again,
under a new uuid). It need not wait that long: the groups rendezvous on a `RepairStore`, and once
the coordinator plans a later generation during a repair, it is abandoned
(`InPlace.abandon_if_planned`) - by the plan waiter, which a repair of generation g sets waiting for
plan g+1's wake-up (`InPlace.on_repair`), or at the latest by the heartbeat thread after its next
beat: its waits for the members' addresses end at once and the repair fails the same way. A member
lost before it published its handles is marked in their place by the coordinator as it plans the
later generation (`REPAIR_ABANDONED`): the wait for them ends.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from ...devices import reconfigure
from ...devices.abort import keep_groups
from ...devices.reconfigure import RepairPlanError
from ...devices.repair_store import RepairStore
from ...errors import DeadpoolRuntimeError
from ..protocol.messages import REPAIR_ABANDONED, Roster
from ..protocol.worker_view import WorkerView
from .injection import FaultInjector

log = logging.getLogger(__name__)
T = TypeVar("T")

REPAIR_TIMEOUT_S = 60.0
"""Longest wait for the other ranks' handles (`read`)."""

RECONNECT_TIMEOUT_S = 10.0
"""The timeout of each group's reconfigure, once every member published its handles (no member
is then more than a few groups behind): gloo's wait for the members' addresses, and for each
connection - to a member lost after it wrote its address, gloo waits up to 5 x this (measured,
torch 2.14.1: `tests/devices/test_reconfigure.py`), a wait no abandon reaches (`RepairStore` ends
the waits for addresses)."""

PREDICTED_BASE = 0
"""The generation on whose store prefix survivors' groups were created, as a newcomer predicts it
to create its own before the survivors publish it (`InPlace.creating_ahead`): a job whose groups
are repaired in place creates them once, in generation 0, and every newcomer creates its own on
the same prefix. Checked as the newcomer joins (`InPlace.join_ahead`)."""


class InPlace:
    """One process's way with its groups on a recovery: repaired in place where
    `devices.reconfigure.choose` says so (then an abort keeps them), else rebuilt; and the
    generation whose store prefix its groups were created on."""

    def __init__(self, backend: str) -> None:
        self.base: int | None = None
        self.ahead: int | None = None  # a newcomer's groups, created ahead on this base
        self._repaired_ahead: tuple[int, frozenset[str]] = (-1, frozenset())  # `repair_ahead`'s
        self.faults: FaultInjector | None = None  # the driver's: `RANK@repair` strikes in `repair`
        self.store: RepairStore | None = None  # the store this process's groups were created on
        self._lock = threading.Lock()
        self._repairing: int | None = None  # the generation whose repair is under way
        self.on_repair: Callable[[int], None] = lambda generation: None
        """Called as a repair for generation g starts: the driver's plan waiter then watches
        for plan g+1, which abandons the repair at once (`abandon_if_planned`)."""
        self.choose(backend)

    def choose(self, backend: str) -> None:
        """Decide for groups of `backend` (again, when the job names its backend later)."""
        self.choice = reconfigure.choose(backend)
        keep_groups(self.choice.repair)
        log.info("process groups on a recovery: %s (%s)", self.choice.way, self.choice.reason)

    def repairs(self, generation: int | None = None) -> bool:
        """Whether this process's groups are repaired in place: on its next recovery (it has
        groups), or (`generation`) as a newcomer joining generation g (not the first)."""
        if generation is not None:
            return self.choice.repair and generation > 0
        return self.choice.repair and self.base is not None

    def init_process_group(
        self, args: dict[str, Any], init: Callable[..., object] = dist.init_process_group
    ) -> None:
        """`init(**args)`: the default group, on ``args["store"]`` - wrapped, where the groups
        are repaired in place, so that a later plan can end the waits of their repair
        (`RepairStore`; every group created after it rendezvous on a prefix of it)."""
        if self.choice.repair:
            self.store = RepairStore(args["store"])
            args = {**args, "store": self.store}
        init(**args)

    @contextlib.contextmanager
    def creating(
        self, membership: WorkerView, roster: Roster, pg_args: dict[str, Any], newcomer: bool
    ) -> Iterator[None]:
        """The default group of `roster`'s generation (`init_process_group` with `pg_args`),
        then the groups the block creates. A `newcomer` whose groups are repaired in place
        creates them on the survivors' store prefix, reconfigurable (nothing connects), and
        joins the survivors' after the block (`reconstruct`); otherwise they are created (and
        connected) on generation g's prefix, the base of later repairs."""
        g = roster.generation
        if not (newcomer and self.repairs(g)):
            self.init_process_group(pg_args)
            yield
            self.created(g)
            return
        self.base = newcomer_base(membership, roster)
        with reconfigure.reconfigurable_creation():
            self.init_process_group({**pg_args, "store": membership.process_group_store(self.base)})
            yield
        self.reconstruct(membership, roster, int(pg_args["rank"]), joining=True)

    @contextlib.contextmanager
    def creating_ahead(self, membership: WorkerView, pg_args: dict[str, Any]) -> Iterator[None]:
        """A newcomer whose groups are repaired in place, before it claims its slot: the
        default group (`pg_args`) and the groups the block creates, reconfigurable, on the
        prefix of `PREDICTED_BASE` - nothing connects or waits on another process; joined as
        it takes its slot (`join_ahead`)."""
        with reconfigure.reconfigurable_creation():
            store = membership.process_group_store(PREDICTED_BASE)
            self.init_process_group({**pg_args, "store": store})
            yield
        self.ahead = PREDICTED_BASE

    def join_ahead(self, membership: WorkerView, roster: Roster, rank: int) -> bool:
        """Join the survivors' groups of `roster` with the groups created ahead, when they were
        created on the survivors' prefix (True); False when none were, or (one line says so)
        on another prefix than the survivors': the caller creates them again. A peer lost
        before the survivors' prefix is read, like one lost in the repair, fails it with
        `DistBackendError` and leaves the groups created ahead the base of the recovery's
        repair (not a rebuild: the survivors repair theirs)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return False
        self.base = ahead
        base = newcomer_base(membership, roster)
        if base != ahead:
            log.warning(
                "the survivors' groups were created in generation %d, not %d as predicted: "
                "creating this newcomer's groups again",
                *(base, ahead),
            )
            self.base = None
            return False
        self.reconstruct(membership, roster, rank, joining=True)
        return True

    def created(self, generation: int) -> None:
        """Its groups were just created, connected, on generation g's store prefix."""
        self.base = generation
        log.info("generation %d: world group %s", generation, world_id())

    def forgetting(self, forget: Callable[[], T]) -> T:
        """`forget()` with aborts that forget the groups (a newcomer's private world)."""
        keep_groups(False)
        try:
            return forget()
        finally:
            keep_groups(self.choice.repair)

    def repair_ahead(
        self,
        membership: WorkerView,
        roster: Roster,
        rank: int,
        newcomers: frozenset[int],
        *,
        taken: Callable[[Roster], None],
    ) -> None:
        """A survivor, `rank` of `roster` (its restore iteration agreed), while the `newcomers`
        still build and claim their slots: repair now the groups none of them is in (with the
        other survivors, who do the same), the rest in `reconstruct` once they joined. Failed -
        a member lost - the process takes `roster` first (`taken`), as after a failed repair:
        the next recovery is for the generation after it, which repairs every group again."""
        if self.base is None:
            raise DeadpoolRuntimeError("no process groups to repair: this process never joined")
        try:
            with self._abandonable(roster.generation):
                names = repair(
                    membership,
                    roster.generation,
                    rank,
                    self.base,
                    newcomers=newcomers,
                    faults=self.faults,
                )
        except dist.DistBackendError:
            taken(roster)
            raise
        self._repaired_ahead = (roster.generation, names)

    def reconstruct(
        self, membership: WorkerView, roster: Roster, rank: int, *, joining: bool = False
    ) -> None:
        """Repair every group of this process in place for `roster` (`repair`) but those it
        repaired ahead for the same generation (`repair_ahead`): a survivor's reconstruct step,
        or a newcomer's (`joining`) once its groups exist (`creating`)."""
        if self.base is None:
            raise DeadpoolRuntimeError("no process groups to repair: this process never joined")
        g, done = self._repaired_ahead
        self._repaired_ahead = (-1, frozenset())
        with self._abandonable(roster.generation):
            repair(
                membership,
                roster.generation,
                rank,
                self.base,
                done=done if g == roster.generation else frozenset(),
                faults=self.faults,
            )
        log.info(
            "generation %d: rank %d %s its groups in place (world group %s)",
            *(roster.generation, rank, "joined" if joining else "repaired", world_id()),
        )

    @contextlib.contextmanager
    def _abandonable(self, generation: int) -> Iterator[None]:
        """The block repairs the groups for `generation`: `abandon_if_planned` may end it."""
        if self.store is None:
            yield
            return
        with self.store.abandonable():
            with self._lock:
                self._repairing = generation
            self.on_repair(generation)
            try:
                yield
            finally:
                with self._lock:
                    self._repairing = None

    def abandon_if_planned(self, membership: WorkerView, by: str = "heartbeat") -> bool:
        """(The plan waiter's thread as plan g+1 appears, `on_repair`; the heartbeat's after
        each beat: `by`, on its own connection `membership`) A repair under way for generation
        g whose members are not all coming - the coordinator planned a later generation - is
        abandoned: its waits for the members' addresses end at once (`RepairStore.abandon`), it
        fails like a repair with a lost member, and the recovery starts over for the later
        plan, instead of after the repair's timeout. Nothing is read while no repair is under
        way. Whether a repair was under way (abandoned now, or not yet planned past)."""
        with self._lock:
            g, store = self._repairing, self.store
            if g is None or store is None or self.base is None:
                return False
            latest = membership.latest_plan()
            if latest <= g:
                return True
            self._repairing = None  # once
            ended = store.abandon(membership.process_group_store(self.base))
        log.warning(
            "generation %d was planned during this process's repair of its groups for generation "
            "%d: repair abandoned by the %s (%d waits for members ended)",
            *(latest, g, by, len(ended)),
        )
        return True


@dataclass(frozen=True)
class RepairHandles:
    """What one rank publishes for a repair: its handle of every group it is in (by torch's
    group name) and the generation whose store prefix its groups were created on."""

    base: int
    handles: dict[str, str]

    def encode(self) -> str:
        return json.dumps({"base": self.base, "handles": self.handles}, sort_keys=True)

    @classmethod
    def decode(cls, rank: int, raw: bytes | None) -> RepairHandles:
        """Checked before use: `RepairPlanError` naming the rank when it is not one."""
        if raw is None:
            raise RepairPlanError(f"rank {rank}'s reconfigure handles are not the job's")
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise RepairPlanError(f"rank {rank}'s reconfigure handles are not JSON") from exc
        base = data.get("base") if isinstance(data, dict) else None
        if not isinstance(base, int) or isinstance(base, bool) or base < 0:
            raise RepairPlanError(f"rank {rank}'s reconfigure handles name no base generation")
        return cls(base, reconfigure.check_handles(rank, data.get("handles")))


def publish(membership: WorkerView, generation: int, rank: int, base: int) -> None:
    """Publish this process's handles of every group it is in for generation g's repair;
    `DistBackendError` when the coordinator took this rank for lost first (a later plan)."""
    payload = RepairHandles(base, reconfigure.own_handles()).encode()
    if not membership.publish_repair_handles(generation, rank, payload):
        raise dist.DistBackendError(
            f"repairing the process groups of generation {generation}: rank {rank} was taken "
            "for lost before it published its reconfigure handles (a later generation is planned)"
        )


def read(
    membership: WorkerView, generation: int, ranks: list[int], timeout_s: float
) -> dict[int, RepairHandles]:
    """The handles `ranks` published for generation g; `DistBackendError` when they are not all
    there within `timeout_s` (a rank was lost: the recovery starts over)."""
    try:
        raw = membership.repair_handles(generation, ranks, timeout_s)
    except dist.DistError as exc:  # the store's timeout
        raise dist.DistBackendError(
            f"repairing the process groups of generation {generation}: not every rank "
            f"published its reconfigure handles within {timeout_s:g}s ({exc})"
        ) from exc
    lost = [r for r, v in zip(ranks, raw) if v == REPAIR_ABANDONED.encode()]
    if lost:
        raise dist.DistBackendError(
            f"repairing the process groups of generation {generation}: rank(s) {lost} lost "
            "before publishing their reconfigure handles, and a later generation is planned"
        )
    return {r: RepairHandles.decode(r, v) for r, v in zip(ranks, raw)}


def base_of(membership: WorkerView, generation: int, survivor: int, timeout_s: float) -> int:
    """The generation whose store prefix the survivors' groups were created on (a newcomer
    creates its own there), from `survivor`'s handles of generation g."""
    return read(membership, generation, [survivor], timeout_s)[survivor].base


def newcomer_base(membership: WorkerView, roster: Roster) -> int:
    """The generation whose store prefix the survivors' groups were created on, for a newcomer
    of `roster`'s generation (from the handles of its first rank that is no newcomer)."""
    plan = membership.plan(roster.generation)
    needy = set(plan.needy) if plan is not None else set()
    survivor = next(r for r in range(roster.world_size) if r not in needy)
    return base_of(membership, roster.generation, survivor, REPAIR_TIMEOUT_S)


def world_id() -> str:
    """The default group's identity, as the logs show it (the same object after a repair)."""
    return f"{id(dist.distributed_c10d._get_default_group()):#x}"


def repair(
    membership: WorkerView,
    generation: int,
    rank: int,
    base: int,
    timeout_s: float = REPAIR_TIMEOUT_S,
    *,
    newcomers: frozenset[int] | None = None,
    done: frozenset[str] = frozenset(),
    faults: FaultInjector | None = None,
) -> frozenset[str]:
    """Publish this process's handles (unless it repaired groups of generation g already:
    `done`), read its groups' members', and reconfigure each of its groups but `done` in place
    under uuid `generation`; returns the names of the groups reconfigured. `newcomers`: only
    the groups none of them is in (a survivor's repair ahead, `InPlace.repair_ahead`). A member
    lost meanwhile: `DistBackendError` within `timeout_s` while the handles are read, then
    within `RECONNECT_TIMEOUT_S` per group (5 x that for a connection). `faults`: where a
    `RANK@repair` fault strikes, once the handles are out (its peers then wait for it in the
    reconfigure), and a `RANK@handles` fault, before (they wait for its handles)."""
    if not done:
        if faults is not None:
            faults.in_repair(rank, published=False)
        publish(membership, generation, rank, base)
    if faults is not None:
        faults.in_repair(rank)
    groups: list[tuple[str, Sequence[int]]] = [
        (name, ranks)
        for name, _, ranks in reconfigure.known_groups()
        if name not in done and reconfigure.repaired(ranks)
    ]
    if newcomers is not None:
        groups = reconfigure.split_by_members(groups, newcomers)[0]
    if not groups:
        return frozenset()
    t0 = time.perf_counter()
    members = sorted({r for _, ranks in groups for r in ranks})
    published = read(membership, generation, members, timeout_s)
    bases = {h.base for h in published.values()}
    if bases != {base}:
        raise RepairPlanError(
            f"generation {generation}: ranks created their groups in different generations "
            f"{sorted(bases)}: their groups cannot be repaired together"
        )
    plan = reconfigure.plan_repair(groups, {r: h.handles for r, h in published.items()})
    try:
        bound = datetime.timedelta(seconds=min(timeout_s, RECONNECT_TIMEOUT_S))
        report = reconfigure.repair(plan, generation, bound)
    except RepairPlanError:
        raise
    except RuntimeError as exc:
        raise dist.DistBackendError(
            f"repairing the process groups of generation {generation} in place failed: "
            f"{str(exc).splitlines()[0][:200]}"
        ) from exc
    log.info(
        "repaired %d process groups in place in %.3fs (handles read in %.3fs)%s",
        report.groups,
        report.seconds,
        time.perf_counter() - t0 - report.seconds,
        " before the newcomers joined" if newcomers is not None else "",
    )
    return frozenset(step.name for step in plan)
