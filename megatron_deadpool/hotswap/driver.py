"""The driver of one process's hot-swap life cycle, the same for every job.

connect -> wait for a slot -> join a generation -> (train: fire injected faults, replicate after
every step) -> on a peer failure: release, agree, join the next generation, rebind, restore ->
train on -> finish. The job - the embedded GPT job (`embedded.job`) or Megatron-LM's training
loop (`megatron_lm.session`) - owns its training loop and calls the driver around each step; it
plugs its own objects and decisions in through a `JobAdapter` (`adapter.py`): which objects hold
process-group handles, how Megatron's groups are created, what else survivors report and
restore. torchft's `Manager` and nvidia-resiliency-ext's in-process wrapper are the models: one
protocol, thin adapters.

The communication steps of a recovery live in `recovery.py`, the coordinator's decisions in
`coordinator.py` (pure planning in `restore_plan.py`), the store's keys in `membership.py`.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..config.deadpool import DeadpoolConfig, split_coordinators
from ..config.faults import end_faults, iteration_faults, recovery_faults, spare_faults
from ..devices import Device, nccl
from ..devices.abort import abort_groups
from ..devices.failures import is_peer_failure
from ..devices.groups import replication_backend
from ..devices.memory import ReplicaMemory
from ..digest import rank_digest
from ..errors import ConfigError, CoordinatorUnreachableError, DeadpoolRuntimeError, first_line
from ..logs import set_context
from ..replication.placement import Layout, Placement, place_replicas
from ..replication.replicator import Replicator
from ..replication.snapshot import Snapshotter
from . import orphaned, rebind, recovery
from .adapter import JobAdapter, RecoveryRecord
from .connection import Heartbeat
from .failover import CoordinatorLink, FailoverStore, host_id
from .injection import inject
from .membership import Membership
from .plan_watch import PlanWatch
from .rebuild import Registration
from .roster import Roster, pid_of
from .wakeup import StoreWaiter, spare_wakeups
from .weights import sync_params_from_main

log = logging.getLogger("megatron_deadpool.driver")


class Driver:
    """One process of a DeadPool job: its place in the job, replication and recovery."""

    def __init__(
        self,
        cfg: DeadpoolConfig,
        device: Device,
        *,
        coordinator: str,
        token: str,
        pid: str | None = None,
        task: int | None = None,
    ) -> None:
        """`pid` (a{r} / s{i}) or `task` (a task index: actives first, then spares; the pid
        follows once the coordinator's world size is known)."""
        if (pid is None) == (task is None):
            raise ValueError("give exactly one of pid and task")
        self.cfg = cfg
        self.device = device
        self.coordinator = coordinator
        self.token = token
        self.pid = pid or ""
        self.task = task
        self.job: JobAdapter | None = None
        self.link: CoordinatorLink | None = None
        self.members: Membership | None = None
        self.heartbeat: Heartbeat | None = None
        self.sigterm = threading.Event()
        self._slot_waiter: StoreWaiter | None = None
        self.rank: int | None = None
        self.generation = 0
        self.roster: Roster | None = None
        self.layout: Layout | None = None
        self.placement: Placement | None = None
        self.replicator: Replicator | None = None
        self.repl_group: dist.ProcessGroup | None = None
        self.pg_backend = device.backend
        self.pg_timeout = datetime.timedelta(seconds=cfg.pg_timeout)
        self.committed: int | None = None
        self.completed: int | None = None  # training completed at this iteration
        self.last_completed = 0
        self.resumed_at: int | None = None
        self.recoveries: list[RecoveryRecord] = []
        self.plan_watch = PlanWatch(abort_groups)  # a peer frozen in a collective with us
        self.recovering = False  # between a failed collective and the restore
        self.done = False  # finished its work

    # ------------------------------------------------------------------ start-up
    def connect(self, world_size: int | None = None) -> None:
        """Reach the coordinator, show the job token, announce this process, start beating.
        Every connection fails over to a standby coordinator that takes over (`failover.py`).
        `world_size`: the job's own, which must be the coordinator's."""
        cfg = self.cfg
        self.link = CoordinatorLink(
            split_coordinators(self.coordinator),
            self.token,
            connect_timeout=cfg.connect_timeout,
            op_timeout=min(cfg.heartbeat_timeout, cfg.connect_timeout),
            rebuild_timeout=2 * cfg.heartbeat_timeout + cfg.connect_timeout,
            beat_s=cfg.heartbeat_interval,
            pid=lambda: self.pid or f"task{self.task}",
            record=self.rejoin_record,
        )
        self.link.connect()
        store = FailoverStore(self.link)
        members = Membership(store, self.pid or f"task{self.task}")
        members.check_token(self.token)
        # The coordinator's first roster is the authority on the world size.
        world = members.wait_roster(0, self.cfg.pg_timeout).world_size
        if world_size is not None and world != world_size:
            raise ConfigError(
                f"deadpool-coordinator: the coordinator at {self.coordinator} runs a job of "
                f"{world} ranks, this process's job has {world_size} (tp*pp*dp); start "
                f"`deadpool coordinator --world-size {world_size}`"
            )
        if not self.pid:
            self.pid = pid_of(self.task, world)
            members = Membership(store, self.pid)
        self.members = members
        if self.pid.startswith("s"):
            set_context(spare=self.pid)
        members.announce()
        self.heartbeat = Heartbeat(FailoverStore(self.link), self.pid, cfg.heartbeat_interval)
        self.heartbeat.after_beat = self.plan_watch
        self.heartbeat.start()
        atexit.register(self.stop_heartbeat)  # whatever way this process ends (`Heartbeat.stop`)

    def rejoin_record(self) -> Registration:
        """What this process tells a standby coordinator that took over (read by whichever of
        its threads first notices the loss)."""
        roster = self.roster
        return Registration(
            pid=self.pid or f"task{self.task}",
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
            plan_seen=self.members.plan_seen if self.members else 0,
            recovering=self.recovering,
        )

    def catch_sigterm(self) -> Any:
        """From now on SIGTERM (Slurm's time limit, preemption) sets `self.sigterm` instead of
        ending the process; returns the previous handler."""
        return signal.signal(signal.SIGTERM, lambda *_: self.sigterm.set())

    def wait_for_slot(self) -> Roster | None:
        """Block until a roster names this process; None when the job ends (or SIGTERM)
        before it needs this spare."""
        previous = self.catch_sigterm()
        try:
            return self._wait_for_slot()
        finally:
            signal.signal(signal.SIGTERM, previous)
            if self._slot_waiter is not None:
                self._slot_waiter.stop()
                self._slot_waiter = None

    def _wait_for_slot(self) -> Roster | None:
        faults = spare_faults(self.cfg.fail, self.pid)
        while True:
            if self.members.shutdown_requested() or self.sigterm.is_set():
                self.stop_heartbeat()
                log.info("released: the job ended without needing this spare")
                return None
            for index, iteration, kind in faults:  # `spare:I@ITER`: a waiting spare fails
                progress = self.members.progress()
                if progress >= iteration and self.members.fire_once(index, self.pid):
                    self._inject(kind, f"while waiting (training at iteration {progress})")
            g = self.members.generation()
            if g >= 0:
                roster = self.members.roster(g)
                rank = roster.rank_of(self.pid)
                if rank is not None:
                    if g > 0:  # a recovery's newcomer: claim the slot before anyone waits on it
                        self._claim(g, rank)
                    self.take(roster)
                    return roster
            if self._slot_waiter is None:  # from now on every roster and the shutdown wake us
                self._slot_waiter = spare_wakeups(self.members)
                continue  # look again: what happened before the waiter started is visible now
            self._slot_waiter.wait(0.2 if faults else 1.0)  # the timeout: SIGTERM, `spare:` faults

    def _claim(self, g: int, rank: int) -> None:
        """Claim rank `rank` of generation g (`Membership.claim_slot`), unless a
        `spare:I@recovery` fault fires first; the survivors join once every newcomer claimed."""
        for index, _, kind in spare_faults(self.cfg.fail, self.pid, assigned=True):
            if self._fire(index):
                self._inject(kind, f"given rank {rank} of generation {g}, before claiming it")
        if not self.members.claim_slot(g, rank):
            raise DeadpoolRuntimeError(
                f"the coordinator gave up rank {rank} of generation {g} before this spare "
                "claimed it (it took this process for lost)"
            )

    def take(self, roster: Roster) -> None:
        """Become the rank `roster` gives this process (before any group exists)."""
        self.roster = roster
        self.generation = roster.generation
        self.rank = roster.rank_of(self.pid)
        set_context(rank=self.rank, generation=self.generation)

    def bind(self, job: JobAdapter) -> None:
        """The job's objects exist: from now on failures are recovered around them."""
        self.job = job

    # ------------------------------------------------------------------ generations
    def process_group_args(self) -> dict[str, Any]:
        """`init_process_group` arguments of the current generation's default group."""
        return {
            "backend": self.pg_backend,
            "store": self.members.process_group_store(self.generation),
            "rank": self.rank,
            "world_size": self.roster.world_size,
            "timeout": self.pg_timeout,
            **nccl.init_kwargs(self.pg_backend),  # eager communicators (device_id)
        }

    def join(self, roster: Roster, init_model_parallel: Callable[[], None]) -> None:
        """Create generation g's default group, Megatron's groups (`init_model_parallel`) and
        the replication group."""
        self.take(roster)
        dist.init_process_group(**self.process_group_args())
        init_model_parallel()
        self.place_replicas()
        if self.cfg.enabled:
            self.new_replication_group()
        self.plan_watch.joined(self.generation)
        log.info(
            "joined generation %d as rank %d of %d", self.generation, self.rank, roster.world_size
        )

    def place_replicas(self, ranks_per_node: int | None = None) -> Layout:
        """Megatron's groups exist: the first time, work out the layout from them and place the
        replicas (rank 0 of generation 0 publishes the layout for the coordinator)."""
        if self.layout is None:
            from megatron.core import parallel_state as ps

            tp = ps.get_tensor_model_parallel_world_size()
            per_node = ranks_per_node or self.cfg.ranks_per_node or _ranks_per_node_from_env(tp)
            self.layout = Layout(
                tp=tp,
                pp=ps.get_pipeline_model_parallel_world_size(),
                dp=ps.get_data_parallel_world_size(),
                ranks_per_node=per_node,
            )
            if not self.cfg.enabled:
                return self.layout
            self.placement = place_replicas(self.layout, self.cfg.replicas)
            if self.generation == 0 and self.rank == 0:
                self.members.publish_layout(self._layout_record())
        return self.layout

    def _layout_record(self) -> dict[str, int] | None:
        """The layout as the coordinator learns it (None before replicas are placed)."""
        if self.layout is None or self.placement is None:
            return None
        return {
            "tp": self.layout.tp,
            "pp": self.layout.pp,
            "dp": self.layout.dp,
            "ranks_per_node": self.layout.ranks_per_node,
            "replicas": self.cfg.replicas,
        }

    def new_replication_group(self) -> None:
        """Create this generation's replication group (every rank, after Megatron's groups)."""
        self._replica_memory()  # refuses 'gpu' without CUDA before any step
        backend = replication_backend(self.device)
        self.repl_group = dist.new_group(backend=backend, timeout=self.pg_timeout)

    # ------------------------------------------------------------------ training steps
    def begin_step(self, n: int) -> None:
        """As step n starts: stop without the coordinator; fire the faults injected at n
        (each spec fires once per job: not again for the process that takes the slot, nor
        when the step is recomputed)."""
        if self.heartbeat.lost:
            raise self.coordinator_lost(self.heartbeat.lost)
        hit = iteration_faults(self.cfg.fail, self.rank, self.layout.ranks_per_node).get(n)
        if hit is not None and self._fire(hit[0]):
            self._inject(hit[1], f"at iteration {n}")

    def replicate(self, n: int, verdict: bool | None = None) -> int | None:
        """After optimizer step n: end the previous round (committed by `verdict`, every
        rank's agreement carried by the step; None: agree here) and start round n. Returns the
        globally committed iteration."""
        if self.replicator is None:
            self.replicator = self._make_replicator()
        if verdict is None:
            self.committed = self.replicator.finish_round()
        else:
            self.committed = self.replicator.commit(verdict)
        self.replicator.start_round(n)
        return self.committed

    def step_completed(self, n: int) -> None:
        """Step n is done on this rank."""
        self.last_completed = n
        if self.rank == 0:
            self.members.set_progress(n)
            if self.resumed_at == n:
                self.members.stamp(self.generation, "first_iteration", 0)

    # ------------------------------------------------------------------ recovery
    def is_peer_failure(self, exc: BaseException) -> bool:
        """A collective's error because a peer died or hung (`devices.failures`), not an OOM,
        a CUDA fault, a bug or one of DeadPool's own decisions; after the plan watch aborted
        this generation's groups, any error (`plan_watch`)."""
        return is_peer_failure(exc) or self.plan_watch.fired is not None

    def recover(self, exc: BaseException, *, target: int | None = None) -> int:
        """Survivor side of a hot swap after `exc`: release every group, agree on the restore
        iteration T with the coordinator, join the next generation, rebind, restore T; returns
        T. `target`: the step the job returns to afterwards (recomputing T+1..target-1)."""
        t0 = time.time()
        self.plan_watch.recovering()
        self.recovering = True
        log.warning("collective failed (%s): entering recovery", first_line(exc))
        self.members.report_failure(first_line(exc))
        # The traceback's frames hold the failed collective's group: drop them, or the group
        # (and its connections) outlive the release below.
        traceback.clear_frames(exc.__traceback__)
        # The group is handed over in a dict the release empties: no reference may outlive it.
        extra, self.repl_group = {"DEADPOOL_REPLICATION": self.repl_group}, None
        held = recovery.abort_and_salvage(self.replicator)
        for index, kind in recovery_faults(self.cfg.fail, self.rank):
            if self._fire(index):
                self._inject(kind, "while in recovery")
        t_released = time.time()
        released: list[int] = []

        def release() -> None:  # while the coordinator decides, after this rank's report
            released.append(rebind.release(self._roots(), extra, held))

        roster = recovery.agree(
            self.members,
            roster=self.roster,
            rank=self.rank,
            pid=self.pid,
            replicator=self.replicator,
            report={"last_completed": self.last_completed, **self.job.recovery_report()},
            deadline=t0 + self.cfg.heartbeat_timeout + self.cfg.agreement_timeout,
            cause=exc,
            on_abort=self._salvage,
            meanwhile=release,
        )
        t_agreed = time.time()
        self.join(roster, self.job.init_model_parallel)
        self.attach()
        log.info("released %d group handles, re-attached the new generation's", released[0])
        self.job.after_rejoin(roster)
        t_joined = time.time()
        self.restore(roster, needy=False)
        self.recovering = False
        self._record(
            roster,
            target,
            t0,
            {
                "abort": t_released - t0,
                "agree": t_agreed - t_released,  # the release of the old groups included
                "join": t_joined - t_agreed,
                "restore": time.time() - t_joined,
            },
        )
        return roster.restore_iteration

    def attach(self) -> None:
        """Put the new generation's groups in every released handle; none may stay stale."""
        roots = self._roots()
        stale: list[str] = []
        n = rebind.attach(roots, {"DEADPOOL_REPLICATION": self.repl_group}, stale)
        self.members.report_stale_refs(self.generation, self.rank, len(stale))
        if stale:
            raise DeadpoolRuntimeError(
                f"objects still reference groups of an old generation: {stale[:3]}"
            )
        log.info("rebound %d process-group references", n)

    def release(self) -> int:
        """Release every group handle the job's objects hold (a newcomer's private world)."""
        return rebind.release(self._roots())

    def restore(self, roster: Roster, *, needy: bool) -> int:
        """Bring this rank to the restore iteration T; returns T.

        Holders send the needy ranks their shard of T (verified by its checksum on arrival);
        the others roll back to their local snapshot of T. Then weights are re-derived from
        the main params, replication restarts with a round of T (which also re-sends the
        replicas the dead ranks held), and the job repositions itself.
        """
        t_iter = roster.restore_iteration
        state = self.job.rank_state()
        from_holder = recovery.exchange_shards(
            self.members,
            roster,
            rank=self.rank,
            state=state,
            replicator=self.replicator,
            group=self.repl_group,
            needy=needy,
        )
        sync_params_from_main(self.job.model(), state.optimizer)
        self.replicator = self._make_replicator()
        self.replicator.start_round(t_iter)
        self.committed = self.replicator.finish_round()
        self.job.after_restore(t_iter, needy=needy)
        self.members.stamp(self.generation, "restored", self.rank)
        self.resumed_at = t_iter + 1
        self.last_completed = t_iter
        log.info(
            "restored iteration %d (%s)",
            t_iter,
            "from holder" if from_holder else "from local snapshot",
        )
        return t_iter

    def _record(
        self, roster: Roster, target: int | None, t0: float, phases: dict[str, float]
    ) -> None:
        t_iter = roster.restore_iteration
        self.recoveries.append(
            RecoveryRecord(
                generation=roster.generation,
                dead=self.members.plan(roster.generation).get("dead", []),
                restore_iteration=t_iter,
                recomputed=max(0, (target or t_iter + 1) - 1 - t_iter),
                total_s=time.time() - t0,
                phases_s=phases,
            )
        )

    def record_newcomer(self, roster: Roster, target: int, t0: float, t_joined: float) -> None:
        """A newcomer's own record of the recovery it completed (join, restore)."""
        self._record(roster, target, t0, {"join": t_joined - t0, "restore": time.time() - t_joined})

    def _salvage(self, report: dict[str, Any]) -> str:
        """Out of redundancy: this survivor's part of the snapshot set; says what was saved."""
        save = report.get("save") or {}
        root, extra = self.job.salvage_target(save.get("iteration", -1))
        return recovery.salvage(
            self.members,
            self.replicator,
            root=root,
            report=report,
            rank=self.rank,
            world_size=self.roster.world_size,
            extra=extra,
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
        if self.cfg.enabled:
            self.members.report_finished(self.rank, n)
            self.plan_watch.training_completed()

    def training_over(self) -> None:
        """The job's training loop has ended (after `finish_training`); its final work (final
        save, evaluation, the last barrier) comes next. Fires `RANK@end` faults."""
        for index, kind in end_faults(self.cfg.fail, self.rank):
            if self._fire(index):
                self._inject(kind, "after training completed")

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
        self.members.report_failure(first_line(exc))
        extra, self.repl_group = {"DEADPOOL_REPLICATION": self.repl_group}, None
        recovery.release_groups(self.replicator, self._roots(), extra)
        deadline = time.time() + self.cfg.heartbeat_timeout + self.cfg.agreement_timeout
        report = self.members.end()
        while report is None and time.time() < deadline:
            time.sleep(0.05)
            report = self.members.end()
        if report is None:
            return (
                f"training completed at iteration {self.completed}; a collective failed in "
                f"{where} but the coordinator named no lost process: nothing saved"
            )
        saved = self._salvage(report)
        return (
            f"training completed at iteration {self.completed}; rank(s) "
            f"{report['dead_ranks']} lost afterwards, in {where}: {saved}"
        )

    def drain(self) -> int | None:
        """Settle and commit the round in flight (end of training); the committed iteration."""
        if self.replicator is not None and self.repl_group is not None:
            self.committed = self.replicator.finish_round()
        return self.committed

    def finish(self) -> str | None:
        """Training is over on this rank: drain replication, publish the parameter digest
        (None: no model was built), mark the process done."""
        digest = None
        if self.job is not None:
            self.drain()
            digest = rank_digest(self.job.model())
            self.members.publish_digest(self.rank, digest)
        self.members.mark_done()
        self.done = True
        self.stop_heartbeat()
        return digest

    def stop_heartbeat(self) -> None:
        """No more beats: this process's work is done (its silence is no failure)."""
        self.heartbeat.stop(self.cfg.heartbeat_interval + self.cfg.heartbeat_timeout)

    def without_coordinator(self) -> None:
        """No coordinator is left (the primary's and the standby's nodes both lost): a rank
        saves what it holds (`recovery.save_held`), then ends the Slurm job (`orphaned`); a
        process that never joined (a spare, a job that never started) just leaves."""
        if self.rank is not None:
            log.error("%s", recovery.save_held(self.replicator, self.rank, self.roster, self.job))
            log.error("%s", orphaned.end_slurm_job(self.cfg.coordinators))

    def coordinator_lost(self, why: str) -> CoordinatorUnreachableError:
        who = f"rank {self.rank}" if self.rank is not None else self.pid
        return CoordinatorUnreachableError(
            f"lost the coordinator {self.coordinator} ({why.splitlines()[0][:160]}); stopping "
            f"{who}: without it no failure could be recovered"
        )

    # ------------------------------------------------------------------ helpers
    def _roots(self) -> list[Any]:
        return [*(self.job.roots() if self.job else []), self.replicator]

    def _replica_memory(self) -> ReplicaMemory:
        return ReplicaMemory(self.cfg.replica_device, self.device)

    def _make_replicator(self) -> Replicator:
        """A new replicator (after a restore: it takes over its predecessor's buffers)."""
        return Replicator(
            Snapshotter(self.job.rank_state(), self.rank),
            self.placement,
            self.rank,
            self.repl_group,
            self._replica_memory(),
            previous=self.replicator,
        )

    def _fire(self, index: int) -> bool:
        return self.members.fire_once(index, self.pid if self.rank is None else self.rank)

    def _inject(self, kind: str, when: str) -> None:
        if kind == "flip":  # memory corruption of the replicas this rank holds
            if self.replicator is not None:  # nothing held before the first round
                log.warning("fault injection: flip %s", when)
                self.replicator.flip_bits_at_rest()
            return
        log.warning("fault injection: %s %s", kind, when)
        self.members.record_fault()
        inject(kind)


def _ranks_per_node_from_env(default: int) -> int:
    text = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE")
    return int(text) if text else default
