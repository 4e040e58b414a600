"""The driver of one process's hot-swap life cycle, the same for every job.

connect -> wait for a slot -> join a generation (a newcomer: build in a private world, then
take the slot) -> (train: fire injected faults, replicate after every step) -> on a peer
failure: release, agree, join the next generation, rebind, restore -> train on -> finish. The
job - the embedded GPT job (`embedded.job`) or Megatron-LM's training loop
(`megatron_lm.session`) - plugs its objects and decisions in through a `JobAdapter`
(`adapter.py`: which objects hold process-group handles, how Megatron's groups are created,
what else survivors report and restore) and is driven through four entry points:

- `start(job)`: connect, wait for a slot, a newcomer's build in its private world; the groups
  and the job's objects, unless the job's own start-up makes them (Megatron-LM's, hooked:
  `init_process_group`, `groups_made`, `bind`);
- `train(attempt)`: the job's training loop, a newcomer's slot taken before its first attempt,
  every peer failure in it caught, recovered from (one `Recovery` per failure, `recovery.py`)
  and the loop resumed from the restore iteration;
- `step(n)`: the context of one training step (faults, replication, progress);
- the end: `finish_training`, `training_over`, `end_failure`, `finish`.

The job reads what it reports through the driver (`stop_requested`, `report_*`,
`survivor_reports`), never through its store access. torchft's `Manager` and
nvidia-resiliency-ext's in-process wrapper are the models: one protocol, thin adapters. The
coordinator's decisions live in `coordinator/` (pure planning in `restore_plan.py`), the
store's keys in `membership.py`, injected faults in `injection.py`.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from ...config.deadpool import DeadpoolConfig, split_coordinators
from ...config.faults import check_faults, parse_fault
from ...devices import Device, active_device, descriptors, nccl
from ...devices.abort import bound_aborts, start_abort
from ...devices.failures import is_peer_failure
from ...devices.health import DeviceWatch
from ...digest import rank_digest
from ...errors import ConfigError, CoordinatorUnreachableError, DeadpoolRuntimeError, first_line
from ...logs import set_context
from ...replication import segments
from ...replication.placement import Layout, Placement, RankOrder
from ...replication.replicator import Replicator
from ...replication.segments import SegmentHoldings
from ...replication.snapshot import Snapshotter
from ..protocol.connection import Heartbeat
from ..protocol.joining import member_name, unnamed
from ..protocol.messages import Phase, Registration, Roster
from ..protocol.seal import JobSeal, job_binding
from ..protocol.sealed_store import SealedStore
from ..protocol.wakeup import StoreWaiter, spare_wakeups
from ..protocol.worker_view import WorkerView
from . import group_repair, newcomer_build, orphaned, private_world, rebind
from .adapter import JobAdapter, RecoveryRecord
from .error_report import error_report
from .failover import CoordinatorLink, FailoverStore, host_id
from .inheritance import Inheritance
from .injection import FaultInjector
from .job_channel import JobChannel
from .newcomer_build import NewcomerBuild
from .newcomer_claim import agreed, claim, slot_roster
from .plan_waiter import PlanStop, PlanWaiter
from .plan_watch import PlanWatch
from .recovery import Recovery
from .step import Step
from .weights import forget_cached_collectives, sync_params_from_main

log = logging.getLogger("megatron_deadpool.driver")

T = TypeVar("T")

REPLICATION = "DEADPOOL_REPLICATION"
"""The name the replication group goes by when its handle is released and rebound."""

HOST_REPLICATION = "DEADPOOL_HOST_REPLICATION"
"""The same for the data-parallel peers' gloo group of replicas in host memory (CUDA)."""


class Driver(JobChannel, NewcomerBuild):
    """One process of a DeadPool job: its place in the job, replication and recovery."""

    def __init__(
        self,
        cfg: DeadpoolConfig,
        device: Device,
        *,
        coordinator: str,
        token: str,
        member: str | None = None,
        task: int | None = None,
    ) -> None:
        """`member` (a{r} / s{i}) or `task` (a task index: actives first, then spares; the
        member name follows once the coordinator's world size is known), or neither with
        `cfg.join` (a spare joining a running job: its name comes from the coordinator)."""
        if (member is not None) + (task is not None) != (0 if cfg.join else 1):
            raise ValueError("give one of member and task (none when joining: see cfg.join)")
        self.cfg = cfg
        self.device = device
        self.coordinator = coordinator
        # The secret stays in this object: never stored, never shown; bound to this run's id.
        self.seal = JobSeal(token, job_binding())
        self.member = member or ""
        self.task = task
        self.sigterm = threading.Event()
        self.rank: int | None = None
        self.generation = 0
        self.layout: Layout | None = None
        self.placement: Placement | None = None
        self.replicator: Replicator | None = None
        self.repl_group: dist.ProcessGroup | None = None
        self.host_repl_group: dist.ProcessGroup | None = None  # CUDA, replicas in host memory
        self.pg_backend = device.backend
        self.pg_timeout = datetime.timedelta(seconds=cfg.pg_timeout)
        self.groups = group_repair.InPlace(str(self.pg_backend))  # or rebuilt on a recovery
        self.committed: int | None = None
        self.completed: int | None = None  # training completed at this iteration
        self.last_completed = 0
        self.resumed_at: int | None = None
        self.recoveries: list[RecoveryRecord] = []
        self._inherited = Inheritance(segments.folder())  # a respawned process's
        # a peer frozen in a collective with us, or (NCCL) a collective that failed silently
        self.plan_watch = PlanWatch(start_abort, errors=self._collective_errors)
        self._device_watch: DeviceWatch | None = None  # CUDA: this GPU still completes work
        self.recovering_now = False  # between a failed collective and the restore
        self.done = False  # finished its work
        self._newcomer = False  # a spare given a slot after the start, its slot not yet taken
        # a newcomer's snapshotter, built before its first restore (`snapshotter_ahead`); that
        # restore's recovery may be a later one, when the generation it joined fails first
        self._ahead: Snapshotter | None = None
        self.joined_late = False  # a spare given a slot after the start
        self._job: JobAdapter | None = None
        self._roster: Roster | None = None
        self._membership: WorkerView | None = None
        self._heartbeat: Heartbeat | None = None
        self._plan_waiter: PlanWaiter | None = None
        self._plan_stop = PlanStop()  # where a plan that woke the waiter stops this process
        self._faults: FaultInjector | None = None
        self._link: CoordinatorLink | None = None
        self._slot_waiter: StoreWaiter | None = None
        self._world_size = 0  # the job's, as the coordinator's first roster says (`connect`)

    # ------------------------------------------------------------------ what it holds
    @property
    def membership(self) -> WorkerView:
        if self._membership is None:
            raise DeadpoolRuntimeError("not connected to the coordinator yet (`connect`)")
        return self._membership

    @property
    def roster(self) -> Roster:
        if self._roster is None:
            raise DeadpoolRuntimeError(f"{self.member or 'this process'} holds no slot yet")
        return self._roster

    @property
    def job(self) -> JobAdapter:
        if self._job is None:
            raise DeadpoolRuntimeError("the job's objects are not built yet (`bind`)")
        return self._job

    @property
    def faults(self) -> FaultInjector:
        if self._faults is None:
            raise DeadpoolRuntimeError("not connected to the coordinator yet (`connect`)")
        return self._faults

    def _rank(self) -> int:
        if self.rank is None:
            raise DeadpoolRuntimeError(f"{self.member} holds no rank")
        return self.rank

    def _layout(self) -> Layout:
        if self.layout is None:
            raise DeadpoolRuntimeError("Megatron's groups do not exist yet (`place_replicas`)")
        return self.layout

    # ------------------------------------------------------------------ start-up
    def connect(self, world_size: int | None = None) -> None:
        """Reach the coordinator, check that it serves this job (its token opens with this
        process's secret), announce this process, start beating.
        Every connection fails over to a standby coordinator that takes over (`failover.py`).
        `world_size`: the job's own, which must be the coordinator's."""
        self._link = link = CoordinatorLink(
            split_coordinators(self.coordinator),
            self.seal,
            connect_timeout=self.cfg.connect_timeout,
            op_timeout=min(self.cfg.heartbeat_timeout, self.cfg.connect_timeout),
            rebuild_timeout=2 * self.cfg.heartbeat_timeout + self.cfg.connect_timeout,
            beat_s=self.cfg.heartbeat_interval,
            member=lambda: self.member or unnamed(self.task),
            record=self.rejoin_record,
        )
        link.connect()
        store = FailoverStore(link)
        name = self.member or unnamed(self.task)
        membership = WorkerView(SealedStore(store, name, link.store_seal))
        membership.check_token()
        # The coordinator's first roster is the authority on the world size.
        world = membership.wait_newest_roster(self.cfg.pg_timeout).world_size
        if world_size is not None and world != world_size:
            raise ConfigError(
                f"deadpool-coordinator: the coordinator at {self.coordinator} runs a job of "
                f"{world} ranks, this process's job has {world_size} (tp*pp*dp); start "
                f"`deadpool coordinator --world-size {world_size}`"
            )
        self._world_size = world
        if not self.member:
            self.member = member_name(membership, self.task, world)
            membership = membership.sibling(store, self.member)
        self._membership = membership
        self.groups.faults = self._faults = FaultInjector(self.cfg.fail, membership)
        if self.member.startswith("s"):
            set_context(spare=self.member)
        membership.announce()
        bound_aborts(self.cfg.abort_bound)  # a hung abort ends the process (exit code 7)
        beat = Heartbeat(membership.sibling(FailoverStore(link)), self.cfg.heartbeat_interval)
        self._heartbeat = beat
        beat.after_beat = self._after_beat
        beat.start()
        self._plan_waiter = self.plan_watch.waiter = PlanWaiter(membership, self._on_plan_wake)
        self.groups.on_repair = self._plan_waiter.watch
        self._plan_waiter.start()
        atexit.register(self.stop_heartbeat)  # whatever way this process ends (`Heartbeat.stop`)

    def _on_plan_wake(self, membership: WorkerView) -> None:
        """A plan after this rank's generation appeared (plan waiter's thread): the main thread
        stops where `PlanStop.stop` says; in a repair of the groups in place, the repair is
        abandoned instead (`InPlace.on_repair`)."""
        if not self.groups.abandon_if_planned(membership, by="plan waiter"):
            cuda = self.device.kind == "cuda"
            self._plan_stop.stop(cuda, self.replicator, self.plan_watch, membership)

    def _after_beat(self, membership: WorkerView) -> None:
        """After each heartbeat (heartbeat thread): the plan watch, a repair of the groups that
        a later plan abandons (`InPlace.abandon_if_planned`), then (CUDA) whether this GPU still
        completes work (`devices.health`: a hung GPU ends the process, exit code 8)."""
        self.plan_watch(membership)
        self.groups.abandon_if_planned(membership)
        if self._device_watch is not None:
            self._device_watch(membership)

    def _collective_errors(self) -> list[str]:
        """This rank's NCCL groups whose collective failed or timed out (`get_error`)."""
        return nccl.backend_errors() if self.device.kind == "cuda" else []

    def phase(self) -> Phase:
        """Where this process is in its life (what its error report names)."""
        if self.rank is None:
            return Phase.WAITING
        if self.completed is not None:
            return Phase.AFTER_TRAINING
        if self.recovering_now:
            return Phase.RECOVERY
        return Phase.START_UP if self.committed is None else Phase.TRAINING

    def report_error(self, exc: BaseException) -> None:
        """This process ends with `exc`, an error no recovery accounts for: tell the coordinator
        (`ErrorReport`: phase, the exception's type and first line, the end of its traceback),
        which tells the job's own error from a lost process (`job_error.py`). Nothing is
        reported for a peer's failure (the peer's death is the failure), for the errors in
        `NOT_THE_JOBS_ERRORS`, or before this process reached the coordinator; a report that
        cannot be delivered is only logged (the exit is seen all the same)."""
        if self._membership is None or self.is_peer_failure(exc):
            return
        report = error_report(
            exc, member=self.member, rank=self.rank, generation=self.generation, phase=self.phase()
        )
        if report is None:
            return
        try:
            self._membership.report_error(report)
        except (RuntimeError, OSError) as failed:  # no store: the exit counts as a failure
            log.warning("could not report this error to the coordinator: %s", first_line(failed))

    def rejoin_record(self) -> Registration:
        """What this process tells a standby coordinator that took over (read by whichever of
        its threads first notices the loss)."""
        roster = self._roster
        return Registration(
            member=self.member or unnamed(self.task),
            host=host_id(),
            rank=self.rank,
            generation=roster.generation if roster else -1,
            world_size=roster.world_size if roster else None,
            slots=dict(roster.slots) if roster else None,
            restore_iteration=roster.restore_iteration if roster else None,
            last_completed=self.last_completed,
            completed=self.completed,
            done=self.done,
            layout=self._layout_record(),
            plan_seen=self._membership.plan_seen if self._membership else 0,
            recovering=self.recovering_now,
        )

    def start(self, job: JobAdapter, world_size: int | None = None) -> Roster | None:
        """Start-up: `connect` (`world_size`: the job's own), wait for a slot (None: the job
        ended without needing this spare), tell the job its slot (`slot_taken`); a newcomer
        then builds in its private world. Unless the job's own start-up makes them
        (`owns_start_up`), the groups are created (joined, or the private world's) and the job's
        objects built and bound - a spare's head start first (`newcomer_build`: its rehearsal while
        no plan names it, its build as soon as one does); a job's own start-up begins as soon as a
        plan names the spare (`agreed_slot` then waits for the agreed roster) - unless it holds
        its node's segment files (a respawn), which it reports to every plan until the roster.
        Returns the roster this process holds its slot in (a newcomer's: planned, or agreed)."""
        self.connect(world_size)
        descriptors.reserve(descriptors.wanted_entries(self._world_size))  # not in a recovery
        own = job.owns_start_up
        head = None
        if not own and not self.member.startswith("a"):
            drop = functools.partial(self._drop_build, job)
            head = newcomer_build.HeadStart(self._newcomer_build(job), drop)
            if newcomer_build.planned_roster(self.membership, self.member) is None:
                build = functools.partial(self._build_private, job)
                args = (self._world_size, str(self.pg_backend), build, head.drop)
                newcomer_build.rehearse(job, self.groups, *args)
        planned = own and self._inherited.where is None
        roster = self.wait_for_slot(meanwhile=head.on_plan if head else None, planned=planned)
        if roster is None:
            return None
        if own:
            self._export_slot(roster)
        job.slot_taken(roster)
        self._newcomer = self.joined_late = roster.generation > 0
        if self._newcomer and head is not None:  # its slot is taken at its first attempt
            head.build(roster, self.member)
        elif self._newcomer:
            self.build_privately(self._rank(), roster.world_size, self._adopt)
        elif not own:
            self.join(roster, job.init_model_parallel)
            job.build()
        if not own:
            self.bind(job)
        return roster

    def _export_slot(self, roster: Roster) -> None:
        """torch's environment for this process's slot, which a job's own start-up reads
        (Megatron's `initialize_megatron`): RANK, WORLD_SIZE (the active world, not the tasks),
        LOCAL_RANK unless set (SLURM_LOCALID, else 0)."""
        os.environ.update(RANK=str(roster.rank_of(self.member)), WORLD_SIZE=str(roster.world_size))
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))

    def report_early_error(self, exc: BaseException) -> None:
        """The job raised `exc` before its start-up began (`start`): an active member connects,
        takes its slot of generation 0 (named at once) and reports `exc` as its start-up error,
        so that the coordinator ends the job instead of handing the slot to a spare; a spare
        reports nothing (it held no slot)."""
        self.connect()
        if self.member.startswith("a"):
            self.wait_for_slot()
            self.report_error(exc)
        self.stop_heartbeat()

    def catch_sigterm(self) -> Any:
        """From now on SIGTERM (Slurm's time limit, preemption) sets `self.sigterm` instead of
        ending the process; returns the previous handler."""
        return signal.signal(signal.SIGTERM, lambda *_: self.sigterm.set())

    def wait_for_slot(
        self,
        after: int = -1,
        meanwhile: Callable[[WorkerView, str], None] | None = None,
        planned: bool = False,
    ) -> Roster | None:
        """Block until a roster names this process; None when the job ends (or SIGTERM)
        before it needs this spare. A newcomer (a spare taking a slot after the start) then
        builds its objects in a private world (`build_privately`) and claims its slot as it
        joins (`take_slot`). `after`: only a roster of a later generation counts;
        `meanwhile(membership, member)`: each time it looks, before it waits (a spare's head
        start, `HeadStart.on_plan`); `planned`: a plan naming this process counts too (its
        roster's restore iteration not agreed yet: `agreed_slot`)."""
        previous = self.catch_sigterm()
        try:
            return self._wait_for_slot(after, meanwhile, planned)
        finally:
            signal.signal(signal.SIGTERM, previous)
            if self._slot_waiter is not None:
                self._slot_waiter.stop()
                self._slot_waiter = None

    def _wait_for_slot(
        self, after: int, meanwhile: Callable[[WorkerView, str], None] | None, planned: bool
    ) -> Roster | None:
        m, faults = self.membership, self.faults
        may_fail = faults.waiting_faults(self.member)
        while True:
            if m.shutdown_requested() or self.sigterm.is_set():
                self.stop_heartbeat()
                log.info("released: the job ended without needing this spare")
                return None
            faults.while_waiting(self.member)  # `spare:I@ITER`: a waiting spare fails
            self._inherited.report(m, self.member)
            found = slot_roster(m, self.member, after, planned)
            if found is not None:
                self._take(found)
                return found
            if meanwhile is not None:  # a plan naming it: its head start's build
                meanwhile(m, self.member)
            if self._slot_waiter is None:  # from now on every roster and the shutdown wake us
                self._slot_waiter = spare_wakeups(m)
                continue  # look again: what happened before the waiter started is visible now
            # Rosters, the shutdown and a plan naming a spare or respawned process wake it; the
            # timeout is for SIGTERM and faults.
            self._slot_waiter.wait(0.2 if may_fail else 1.0)

    def _take(self, roster: Roster) -> None:
        """Become the rank `roster` gives this process (before any group exists)."""
        self._roster = roster
        self.generation = roster.generation
        self.rank = roster.rank_of(self.member)
        set_context(rank=self.rank, generation=self.generation)

    def bind(self, job: JobAdapter, *, check: bool = False) -> None:
        """The job's objects exist: from now on failures are recovered around them. `check`:
        refuse a process group they hold that a recovery could not rebind
        (`rebind.check_rebindable`)."""
        self._job = job
        if check:
            extra = {REPLICATION: self.repl_group, HOST_REPLICATION: self.host_repl_group}
            rebind.check_rebindable(self._roots(), extra)

    # ------------------------------------------------------------------ generations
    def process_group_args(self) -> dict[str, Any]:
        """`init_process_group` arguments of the current generation's default group."""
        return {
            "backend": self.pg_backend,
            "store": self.membership.process_group_store(self.generation),
            "rank": self.rank,
            "world_size": self.roster.world_size,
            "timeout": self.pg_timeout,
            **nccl.init_kwargs(self.pg_backend),  # eager communicators (device_id)
        }

    def init_process_group(self, real: Callable[..., None], kwargs: dict[str, Any]) -> None:
        """Generation 0's default group, created by the job's own start-up (`owns_start_up`:
        Megatron-LM's `init_process_group`, `real`, with its `kwargs`) on the coordinator's
        store, with the rank and world size of the roster; its backend and timeout are kept for
        every later generation's default group."""
        self._adopt(kwargs)
        self.groups.init_process_group({**kwargs, **self.process_group_args()}, real)

    def _adopt(self, kwargs: dict[str, Any]) -> None:
        """The job's `init_process_group` arguments: its backend (groups repaired in place, or
        rebuilt, `group_repair.choose`) and timeout become the driver's."""
        self.pg_backend = kwargs.get("backend") or "gloo"
        self.groups.choose(str(self.pg_backend))
        self.pg_timeout = kwargs.get("timeout") or datetime.timedelta(minutes=10)

    def groups_made(self, order: RankOrder, *, iterations: int) -> Layout:
        """The job's own start-up created Megatron's groups (`owns_start_up`; Megatron-LM's
        `initialize_model_parallel`, in `order`): the device it selected is this process's,
        replicas are placed, the injected faults checked against the layout and `iterations`,
        and - unless a newcomer builds in its private world (its groups are made as it joins) -
        the replication group created and generation 0 counted joined."""
        self.device = active_device()
        layout = self.place_replicas(order=order)
        faults = [parse_fault(spec) for spec in self.cfg.fail]
        check_faults(faults, layout.world_size, layout.ranks_per_node, iterations)
        if not self.building_privately():
            self.new_replication_group()
            self.plan_watch.joined(self.generation)  # generation 0's groups: the job made them
            self.groups.created(self.generation)
        return layout

    def join(
        self, roster: Roster, init_model_parallel: Callable[[], None], *, newcomer: bool = False
    ) -> None:
        """Create generation g's default group, Megatron's groups (`init_model_parallel`) and
        the replication group. A `newcomer` whose groups are repaired in place creates them as
        the survivors did, reconfigurable, and joins the survivors' (`group_repair.InPlace`)."""
        self._take(roster)
        with self.groups.creating(self.membership, roster, self.process_group_args(), newcomer):
            init_model_parallel()
            self.place_replicas()
            if self.cfg.enabled:
                self.new_replication_group()
        self.plan_watch.joined(self.generation)
        log.info(
            "joined generation %d as rank %d of %d", self.generation, self.rank, roster.world_size
        )

    def take_slot(self, target: int | None = None) -> int:
        """A newcomer whose objects exist (built in its private world, `bind` done) takes its
        slot: it releases the private world's groups, joins the generation its roster names
        like the survivors, rebinds its objects and restores its shard from the holder; returns
        the restore iteration T. `target`: the step the job goes on at (T+1 unless the
        survivors recompute more). Where groups are repaired in place, its objects are on its
        real groups before it joins (`_create_ahead`, unless its head start did it): a peer lost
        during the join fails it with a peer failure, and the recovery that follows repairs
        them as a survivor's, the process still needy (it restores as the newcomer it is)."""
        t0 = time.time()
        self._ahead = self.snapshotter_ahead()  # while the survivors agree
        roster = self._claim(self.agreed_slot(self.roster))
        self._take(roster)
        if self.groups.ahead is None and self.groups.repairs(roster.generation):
            self._create_ahead(self.job)  # its objects on them first: a failed join repairs them
        if self.groups.join_ahead(self.membership, roster, self._rank()):
            self.plan_watch.joined(self.generation)
        else:  # the private world's groups (or those created ahead on another prefix) go for good
            held = self.groups.forgetting(rebind.forget)
            private_world.leave()
            self.join(roster, self.job.init_model_parallel, newcomer=True)
            stale: list[str] = []  # the forgotten groups -> the real ones of their names
            self._rebound(rebind.swap(self._roots(), held, stale=stale), stale)
        rec = self._recovery(roster, self.replicator, started=t0)
        rec.inherit(self._inherited.take)  # a respawn's own snapshot
        rec.mark("join")
        return self.restore(rec, newcomer=True, target=target)

    def agreed_slot(self, roster: Roster) -> Roster:
        """The agreed roster this newcomer joins (`newcomer_claim.agreed`: `roster` is the one
        its start-up began with, planned or agreed); from now on its slot's."""
        self._take(agreed(roster, self.member, self.wait_for_slot))
        return self.roster

    def _claim(self, roster: Roster) -> Roster:
        """Claim this newcomer's slot, its objects built (`newcomer_claim.claim`); the roster it
        joins."""
        if roster.generation == 0:
            return roster
        return claim(self.membership, self.faults, self.member, roster, self.wait_for_slot)

    # ------------------------------------------------------------------ training steps
    def train(
        self,
        attempt: Callable[[int | None], T],
        *,
        target: int | None = None,
        pending: BaseException | None = None,
        on_failure: Callable[[], None] = lambda: None,
    ) -> T:
        """The job's training (`recovering`); a newcomer first takes its slot (`take_slot`:
        its first attempt is then handed the restore iteration T, and a failure from there on
        is recovered like a survivor's)."""

        def first(restored: int | None) -> T:
            if self._newcomer:
                self._newcomer = False
                restored = self.take_slot(target)
            return attempt(restored)

        return self.recovering(first, target=target, pending=pending, on_failure=on_failure)

    @contextlib.contextmanager
    def step(self, n: int, *, carries_verdict: bool = False, last: bool = False) -> Iterator[Step]:
        """Training step n. On entry: stop without the coordinator, fire the faults injected at
        n (`_begin_step`); with `carries_verdict` (the job's step collective carries the
        replicas' verdict: `Step.settle`, `Step.verdict`) the optimizer waits for the last
        capture first (`Replicator.before_step`). On exit without an error (unless the job
        ended it, `Step.done`): replicate step n (DeadPool on) and record it completed; with
        `last`, training is finished there (`finish_training`)."""
        try:  # the plan stop's step ends whatever raises, `_begin_step` included
            self._begin_step(n)
            started = time.perf_counter()
            repl = self.replicator if carries_verdict else None
            if repl is not None:
                repl.before_step()
            step = Step(n, started, repl.settle if repl is not None else None, self._end_step)
            yield step
        finally:
            self._plan_stop.step_ends()
        if n not in step.ended:
            step.done(n)
        if last:  # a failure in here is recovered like any other
            self.finish_training(n)

    def _end_step(self, step: Step, k: int) -> None:
        t0 = time.perf_counter()
        if self.cfg.enabled:
            step.committed = self.replicate(k, step.verdict)
        step.replication_s = time.perf_counter() - t0
        self._step_completed(k)

    def recovering(
        self,
        attempt: Callable[[int | None], T],
        *,
        target: int | None = None,
        pending: BaseException | None = None,
        on_failure: Callable[[], None] = lambda: None,
    ) -> T:
        """The job's training loop with recovery: `attempt(None)` - or, when `pending` (a peer
        failure the job met between steps) is given, a recovery first - and after every peer
        failure in it a recovery and `attempt(T)`, T the restore iteration every rank is back
        at, until an attempt returns. Any other error ends the process as before.
        `on_failure()` runs as each failure is caught (the job's clean-up of a cut-short step);
        `target`: the step the job returns to afterwards (`recover`)."""
        failure, restored = pending, None
        while True:
            try:
                if failure is not None:
                    restored = self.recover(failure, target=target)
                    failure = None
                return attempt(restored)
            except Exception as exc:
                if not self.is_peer_failure(exc):
                    raise
                on_failure()
                failure = exc

    def _begin_step(self, n: int) -> None:
        """As step n starts: stop without the coordinator; stop for a plan that woke the plan
        waiter between steps or on gloo (`_on_plan_wake`: a peer failure, which the job's
        recovery loop takes); fire the faults injected at n."""
        beat = self._heartbeat
        if beat is not None and beat.lost:
            raise self.coordinator_lost(beat.lost)
        if self._plan_stop.step_begins() and self.plan_watch.planned_after(self.membership):
            # Before any collective of the step: the recovery aborts the groups itself, with
            # nothing under way (on gloo an abort in a collective can leave a send unfinished).
            raise dist.DistBackendError(f"a recovery was planned before step {n}: not started")
        self.faults.at_iteration(
            self._rank(), n, self._layout().ranks_per_node, self.replicator, self.generation
        )

    def _step_completed(self, n: int) -> None:
        """Step n is done on this rank (on CUDA: its work queued, watched until done)."""
        if self.device.kind == "cuda":
            if self._device_watch is None:
                bound = self.pg_timeout.total_seconds() + self.cfg.heartbeat_timeout
                self._device_watch = DeviceWatch(bound)
            self._device_watch.step_done(n)
        self.last_completed = n
        if self.rank == 0:
            self._publish_progress(n)
            if self.resumed_at == n:
                self.membership.stamp(self.generation, "first_iteration", 0)

    def _publish_progress(self, n: int) -> None:
        """Rank 0's `Progress` after step n - the committed iteration and replica bytes now -
        which the launchers' metrics files read (`report/metrics_file.py`)."""
        nbytes = self.replicator.bytes_per_round if self.replicator else 0
        self.membership.set_progress(n, self.generation, self.committed, nbytes)

    # ------------------------------------------------------------------ recovery
    def is_peer_failure(self, exc: BaseException) -> bool:
        """A collective's error because a peer died or hung (`devices.failures`), not an OOM,
        a CUDA fault, a bug or one of DeadPool's own decisions; after the plan watch aborted
        this generation's groups, any error but DeadPool's own (`plan_watch`): out of
        redundancy, raised by a recovery, must end the process, not start another recovery
        (which would raise it again, a survivor looping on it for good)."""
        if isinstance(exc, DeadpoolRuntimeError):
            return False
        return is_peer_failure(exc) or self.plan_watch.fired is not None

    def recover(self, exc: BaseException, *, target: int | None = None) -> int:
        """Survivor side of a hot swap after `exc`: release every group, agree on the restore
        iteration T with the coordinator, join the next generation, rebind, restore T; returns
        T. `target`: the step the job returns to afterwards (recomputing T+1..target-1)."""
        self.plan_watch.recovering()
        self.recovering_now = True
        log.warning("collective failed (%s): entering recovery", first_line(exc))
        self.membership.report_failure(first_line(exc))
        # The traceback's frames hold the failed collective's group: drop them, or the group
        # (and its connections) outlive the release below.
        traceback.clear_frames(exc.__traceback__)
        # Repaired in place, every group stays (its connections shut down by the abort).
        # Rebuilt, the group is handed over in a dict the release empties: no reference may
        # outlive it.
        repairing = self.groups.repairs()
        # A respawn not restored yet (its join, or its restore, failed): its segment files.
        rec = self._recovery(self.roster, self._inherited.holdings or self.replicator)
        rec.abort(self._roots(), None if repairing else self._hand_over_groups())
        self.faults.in_recovery(self._rank(), self.replicator, self.generation + 1)
        rec.mark("abort")
        ahead = functools.partial(self.groups.repair_ahead, self.membership, taken=self._take)
        roster = rec.agree(  # releases the old groups' handles while the coordinator decides
            self.job.recovery_report(),
            last_completed=self.last_completed,
            deadline=rec.started + self.cfg.heartbeat_timeout + self.cfg.agreement_timeout,
            cause=exc,
            salvage_target=self.job.salvage_target,
            before_newcomers=ahead if repairing else None,  # a repair ahead
        )
        rec.mark("agree")  # the release of the old groups included (and a repair ahead)
        if isinstance(rec.replicator, SegmentHoldings):  # they restore it, or a holder does
            rec.inherit(self._inherited.take)
        if repairing:
            self._take(roster)
            self.groups.reconstruct(self.membership, roster, self._rank())
            self.plan_watch.joined(self.generation)
        else:
            self.join(roster, self.job.init_model_parallel)
            self.attach()
            log.info("released %d group handles, re-attached the new generation's", rec.released)
        self.job.after_rejoin(roster)
        rec.mark("join")
        newcomer = self.joined_late and self.resumed_at is None  # its join failed: never restored
        return self.restore(rec, newcomer=newcomer, target=target)

    def attach(self) -> None:
        """Put the new generation's groups in every released handle; none may stay stale."""
        stale: list[str] = []
        groups = {REPLICATION: self.repl_group, HOST_REPLICATION: self.host_repl_group}
        self._rebound(rebind.attach(self._roots(), groups, stale), stale)

    def _rebound(self, n: int, stale: list[str]) -> None:
        """`n` group handles were rebound, `stale` still found: reported; none may stay."""
        self.membership.report_stale_refs(self.generation, self._rank(), len(stale))
        if stale:
            raise DeadpoolRuntimeError(
                f"objects still reference groups of an old generation: {stale[:3]}"
            )
        log.info("rebound %d process-group references", n)

    def restore(self, rec: Recovery, *, newcomer: bool, target: int | None = None) -> int:
        """Bring this rank to the restore iteration T of the recovery's roster; returns T.

        Holders send the needy ranks their shard of T (verified by its checksum on arrival);
        the others roll back to their local snapshot of T. Then weights are re-derived from
        the main params, replication restarts with a round of T (which also re-sends the
        replicas the dead ranks held), and the job repositions itself (`newcomer`: from what a
        newcomer's start-up built, not from what this process trained). The recovery is
        recorded (`recoveries`; `target`: the step the job returns to).
        """
        t_iter = rec.roster.restore_iteration
        assert t_iter is not None
        state = self.job.rank_state()
        from_holder = rec.exchange_shards(
            state, self.repl_group, needy=rec.needy, host_group=self.host_repl_group
        )
        sync_params_from_main(self.job.model(), state.optimizer)
        forget_cached_collectives(state.optimizer)
        self.replicator = self._make_replicator(rec.kept)
        self._inherited.restored()
        self._ahead = None  # kept by the replicator, or not this state's layout
        self.replicator.start_round(t_iter)
        self.committed = self.replicator.finish_round()
        self.job.after_restore(t_iter, newcomer=newcomer)
        self.membership.stamp(self.generation, "restored", self._rank())
        self.resumed_at = t_iter + 1
        self.last_completed = t_iter
        source = "from holder" if from_holder else "from local snapshot"
        anew = "" if rec.kept is not None else "; its snapshotter built anew"  # another layout
        log.info("restored iteration %d (%s)%s", t_iter, source, anew)
        self.recovering_now = False
        rec.mark("restore")
        self.recoveries.append(rec.record(target))
        return t_iter

    def _recovery(
        self, roster: Roster, holds: Replicator | SegmentHoldings | None, **more: Any
    ) -> Recovery:
        """One recovery of this process, over what it holds now (a newcomer not yet restored:
        and the snapshotter it built ahead)."""
        return Recovery(
            self.membership, self.member, self.rank, roster, holds, snapshotter=self._ahead, **more
        )

    # ------------------------------------------------------------------ the end
    def finish_training(self, n: int) -> None:
        """Step n was the last: commit its replication round (a peer failure here is an
        ordinary one: step n is recomputed after the recovery) and report training complete,
        so that a loss from now on costs no recovery (`end_failure`)."""
        for _ in range(2):  # a replica of n that failed its checksum: send the round again
            if self.drain() == n or self.replicator is None:
                break
            self.replicator.start_round(n)
        self.completed = n
        if self.rank == 0 and self.replicator is not None:  # its round committed since
            self._publish_progress(n)
        if self.cfg.enabled:
            self.membership.report_finished(self._rank(), n)
            self.plan_watch.training_completed()

    def training_ended(self, n: int) -> BaseException | None:
        """The job's loop ended after step n outside any step (Megatron-LM's `train()`
        returned): `finish_training` unless done. A peer failure in it is returned for the job
        to defer (`end_failure` then: training counts as completed at n, no step to recompute
        outside the loop)."""
        if self.completed is None:
            try:
                self.finish_training(n)
            except Exception as exc:
                if not self.is_peer_failure(exc):
                    raise
                self.completed = n
                return exc
        return None

    def training_over(self) -> None:
        """The job's training loop has ended (after `finish_training`); its final work (final
        save, evaluation, the last barrier) comes next. Fires `RANK@end` faults."""
        self.faults.after_training(self._rank())

    def end_failure(self, exc: BaseException, where: str) -> str:
        """A collective failed after training completed (final save, final report): a peer
        is gone, but no step is lost. Release the groups, learn from the coordinator who died,
        save the final state of this rank and the dead ranks' copies it holds under the job's
        save directory (a complete snapshot set of the completed iteration, when every dead
        rank's holder survives), and say what was saved. The job's remaining final work, which
        needs the dead peers, is skipped."""
        log.warning("collective failed in %s after training completed (%s)", where, first_line(exc))
        traceback.clear_frames(exc.__traceback__)
        self.plan_watch.recovering()
        self.membership.report_failure(first_line(exc))
        rec = self._recovery(self.roster, self.replicator)
        rec.abort(self._roots(), self._hand_over_groups())
        rec.release()
        deadline = time.time() + self.cfg.heartbeat_timeout + self.cfg.agreement_timeout
        return rec.after_training(self.completed, where, deadline, self.job.salvage_target)

    def finish(self) -> str | None:
        """Training is over on this rank: drain replication, publish the model digest
        (None: no model was built), mark the process done."""
        digest = None
        if self._job is not None:
            self.drain()
            digest = rank_digest(self._job.model())
            self.membership.publish_digest(self._rank(), digest)
        self.membership.mark_done()
        self.done = True
        self.stop_heartbeat()
        return digest

    def stop_heartbeat(self) -> None:
        """No more beats, no plan waited for: this process's work is done (its silence is no
        failure)."""
        if self._plan_waiter is not None:
            self._plan_waiter.stop()
        if self._heartbeat is not None:
            self._heartbeat.stop(self.cfg.heartbeat_interval + self.cfg.heartbeat_timeout)

    def without_coordinator(self) -> None:
        """No coordinator is left (the primary's and the standby's nodes both lost): a rank
        saves what it holds (`Recovery.save_held`), then ends the Slurm job (`orphaned`); a
        process that never joined (a spare, a job that never started) just leaves."""
        if self.rank is not None and self._job is not None and self._membership is not None:
            saved = self._recovery(self.roster, self.replicator).save_held(self._job.salvage_target)
            log.error("%s", saved)
            log.error("%s", orphaned.end_slurm_job(self.cfg.coordinators))

    def coordinator_lost(self, why: str) -> CoordinatorUnreachableError:
        who = f"rank {self.rank}" if self.rank is not None else self.member
        return CoordinatorUnreachableError(
            f"lost the coordinator {self.coordinator} ({why.splitlines()[0][:160]}); stopping "
            f"{who}: without it no failure could be recovered"
        )

    # ------------------------------------------------------------------ helpers
    def _roots(self) -> list[Any]:
        return [*(self._job.roots() if self._job else []), self.replicator]

    def _hand_over_groups(self) -> dict[str, dist.ProcessGroup | None]:
        """DeadPool's own groups, by name, for `rebind.release` (this object keeps none)."""
        extra = {REPLICATION: self.repl_group, HOST_REPLICATION: self.host_repl_group}
        self.repl_group = self.host_repl_group = None
        return extra
