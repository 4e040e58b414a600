"""A newcomer's build: in a private world, for the slot a plan names it for, rehearsed.

A newcomer's critical path - from the agreement to its groups joined - is its build in a private
world (`private_world`: the job's objects built as its rank, without the survivors), its groups
created and repaired (`group_repair`), its objects rebound. `NewcomerBuild` (a part of `Driver`,
kept apart for its size) is the build; what takes part of the path away from after the
agreement, for a job whose objects the driver builds (the embedded job; Megatron-LM's `pretrain`
builds its own, `owns_start_up`: no rehearsal, and its start-up begins at the plan,
`Driver.wait_for_slot(planned=True)`, then waits for the agreement where it first needs the restore
iteration, `Driver.agreed_slot`), is the rest of this module:

- **the rehearsal** (`rehearse`): the first time a process does any of it costs far more than
  any later time. The build imports what Megatron imports lazily (megatron-core 0.19's optimizer
  set-up, its `mimo` modules), and a process forked from a warm interpreter
  (`hotswap.launch.forkserver`) pays a copy-on-write fault on every page of the server's it
  first writes - Python writes to every object it touches (reference counts) - and every
  group gloo creates starts threads and allocates. Measured on 2 cores, TP2xDP2, a forked
  spare's build took ~35 ms and the creation of Megatron's 25 groups ~20 ms of CPU; after a
  rehearsal ~14 and ~8 ms. So a spare, once connected and not yet needed, builds the job's
  objects for rank 0 in a private world, creates the groups as a newcomer whose groups are
  repaired in place would (`reconfigurable_creation`, on a store of its own: nothing connects),
  and drops all of it: torch forgets the groups (`rebind.forget`), the job its objects
  (`JobAdapter.discard`). A failure while it rehearses waits for the rehearsal.
- **the build at the plan** (`HeadStart.on_plan`): the coordinator's plan names the spare that
  takes each dead rank's slot before the survivors' reports fix the restore iteration and the
  roster is published (the agreement). What a newcomer builds depends on its rank alone, so the
  spare builds as soon as a plan names it, while the survivors agree - its objects, and where
  its groups are repaired in place its real groups too, created reconfigurable on the prefix
  the survivors' were created on (`group_repair.PREDICTED_BASE`) with its objects moved onto
  them (`Driver._create_ahead`): after the agreement it only claims its slot and joins the
  survivors' groups. If a later plan of the same recovery gives it another rank (a death
  meanwhile), all of it is dropped and built again. A process respawned in place is named by
  the plan before it starts: it builds at once and never rehearses.

Nothing of either survives into training: the seeds are set again by each build, the state
comes from a holder.
"""

from __future__ import annotations

import datetime
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ...devices import reconfigure
from ..protocol.messages import Roster
from ..protocol.worker_view import WorkerView
from . import private_world, rebind
from .adapter import JobAdapter
from .group_repair import InPlace
from .replicas import Replicas

log = logging.getLogger(__name__)

REHEARSAL_RANK = 0
"""The rank a spare rehearses as: any is as good (each builds the same kinds of object)."""


def rehearse(
    job: JobAdapter,
    groups: InPlace,
    world_size: int,
    backend: str,
    build: Callable[[int, int], None],
    drop: Callable[[], None],
) -> None:
    """Build as rank 0 (`build(rank, world_size)`: in a private world) and drop it (`drop`);
    then - where groups are repaired in place - create the groups as a newcomer would
    (reconfigurable, on a store of its own: nothing connects) and let torch forget them. A
    rehearsal that fails costs a takeover its first time's costs, nothing else (one line says
    so).

    What the process holds before it is frozen out of the garbage collector first (`gc.freeze`:
    a later collection - in a takeover - need not walk it). No collection here: a full one holds
    the GIL throughout, and on a loaded node it kept a spare's heartbeat silent past the
    coordinator's timeout (3 s in the Slurm lab). The dropped objects are collected when Python
    collects; they hold no gloo group (whose destructor joins threads), only the private world's
    fake ones."""
    t0 = time.perf_counter()
    gc.freeze()
    try:
        try:
            build(REHEARSAL_RANK, world_size)
        finally:
            drop()
        if groups.choice.repair:
            with reconfigure.reconfigurable_creation():
                dist.init_process_group(
                    backend=backend,
                    store=dist.HashStore(),
                    rank=REHEARSAL_RANK,
                    world_size=world_size,
                    timeout=datetime.timedelta(seconds=60),
                )
                try:
                    job.init_model_parallel()
                finally:
                    groups.forgetting(rebind.forget)
    except Exception as exc:  # noqa: BLE001 - an optimisation: the real build meets it again
        log.warning("a spare's rehearsal failed (%s); a takeover pays its first build", exc)
        return
    log.info("rehearsed a newcomer's build and groups in %.2fs", time.perf_counter() - t0)


def planned_roster(
    membership: WorkerView, member: str, generation: int | None = None
) -> Roster | None:
    """The roster the newest plan (or plan `generation`) leads to - its restore iteration not
    yet agreed - if it names `member` for a slot, else None."""
    g = membership.latest_plan() if generation is None else generation
    plan = membership.plan(g) if g > 0 else None
    if plan is None or member not in plan.replaced.values():
        return None
    return membership.roster(plan.base).successor(plan, restore_iteration=None)


class HeadStart:
    """One waiting spare's build for the slot a plan names it for (module docstring).
    `build(roster)`: build for `roster`'s slot (its objects, and its groups where they are
    repaired in place); `drop()`: drop all of that."""

    def __init__(self, build: Callable[[Roster], None], drop: Callable[[], None]) -> None:
        self._build = build
        self._drop = drop
        self.built_for: int | None = None
        """The rank this process built for, if any."""
        self._plan_seen = 0

    def on_plan(self, membership: WorkerView, member: str) -> None:
        """While waiting: build for the rank the newest plan names this spare for, unless built
        for it already (once per plan)."""
        g = membership.latest_plan()
        if g <= self._plan_seen:
            return
        self._plan_seen = g
        roster = planned_roster(membership, member, g)
        if roster is None:  # a later plan that no longer names it: what it built goes
            if self.built_for is not None:
                self.drop()
            return
        t0 = time.perf_counter()
        if self.build(roster, member):
            log.info(
                "plan %d names this spare for rank %s: built in %.3fs, before the roster",
                *(g, self.built_for, time.perf_counter() - t0),
            )

    def build(self, roster: Roster, member: str) -> bool:
        """Hold what `member` builds for its slot of `roster` (built now, after dropping what
        was built for another rank, if any); whether it built."""
        rank = roster.rank_of(member)
        if rank is None or rank == self.built_for:
            return False
        if self.built_for is not None:
            self.drop()
        try:
            self._build(roster)
        except BaseException:
            self.drop()
            raise
        self.built_for = rank
        return True

    def drop(self) -> None:
        """Drop what was built."""
        self._drop()
        self.built_for = None


class NewcomerBuild(Replicas):
    """How a newcomer builds (a part of `Driver`): in a private world, and ahead of its slot's
    claim (`HeadStart`)."""

    pg_backend: Any
    groups: InPlace
    _roster: Roster | None

    def _take(self, roster: Roster) -> None:
        """Become the rank `roster` gives this process (`Driver._take`)."""
        raise NotImplementedError

    def _rank(self) -> int:
        raise NotImplementedError

    def process_group_args(self) -> dict[str, Any]:
        raise NotImplementedError

    def _rebound(self, n: int, stale: list[str]) -> None:
        raise NotImplementedError

    def build_privately(
        self,
        rank: int,
        world_size: int,
        record: Callable[[dict[str, Any]], None] = lambda kwargs: None,
        init_model_parallel: Callable[[], None] | None = None,
    ) -> None:
        """A newcomer: from now on its job builds its objects in a private world (`rank` of
        `world_size`, `private_world`), without the survivors; `init_model_parallel` creates
        the private default group and Megatron's groups at once (a job whose start-up does that
        itself passes None; `record` receives its `init_process_group` arguments)."""
        private_world.enter(rank, world_size, record)
        if init_model_parallel is not None:
            dist.init_process_group(backend=self.pg_backend)  # the private world's default group
            init_model_parallel()

    def building_privately(self) -> bool:
        """Whether this process builds in its private world (a newcomer before `take_slot`)."""
        return private_world.active()

    def _newcomer_build(self, job: JobAdapter) -> Callable[[Roster], None]:
        """How a newcomer builds for its slot of a roster: `job`'s objects in its private world,
        then (its groups repaired in place) its real groups (`_create_ahead`)."""

        def build(roster: Roster) -> None:
            self._take(roster)
            self._build_private(job, self._rank(), roster.world_size)
            if self.groups.repairs(roster.generation):
                self._create_ahead(job)

        return build

    def _build_private(self, job: JobAdapter, rank: int, world_size: int) -> None:
        """`job`'s objects, built as `rank` of `world_size` in a private world."""
        self.build_privately(rank, world_size, init_model_parallel=job.init_model_parallel)
        job.build()

    def _create_ahead(self, job: JobAdapter) -> None:
        """A newcomer whose groups are repaired in place, its objects built for the slot of its
        (planned) roster: its real groups created now, before its slot is claimed - nothing of
        it waits on another process (`InPlace.creating_ahead`) - and its objects moved onto
        them from its private world; as it takes its slot it only joins them (`take_slot`)."""
        private = self.groups.forgetting(rebind.forget)
        private_world.leave()
        with self.groups.creating_ahead(self.membership, self.process_group_args()):
            job.init_model_parallel()
            self.place_replicas()
            if self.cfg.enabled:
                self.new_replication_group()
        stale: list[str] = []
        self._rebound(rebind.swap(job.roots(), private, stale=stale), stale)

    def _drop_build(self, job: JobAdapter) -> None:
        """Drop what a newcomer built (`_newcomer_build`): its objects and groups."""
        job.discard()
        if dist.is_initialized():
            self.groups.forgetting(rebind.forget)
        private_world.leave()
        self.groups.ahead = None
        self.repl_group = self.host_repl_group = None
        self.rank, self._roster, self.generation = None, None, 0  # a spare's: no slot yet
