"""The life of one embedded-job process: join a generation, train, replicate, report.

Survivors keep their Python objects for the whole run; a spare builds its own when it is
assigned a slot. The training loop is Megatron's: forward/backward through
`get_forward_backward_func`, the distributed optimizer's step, the LR scheduler; DeadPool adds
a replication round after each step (`Replicator.start_round`, settled and committed during
the next step, off the critical path) and failure handling around it.
"""

from __future__ import annotations

import datetime
import logging
import signal
import threading
import time
import traceback
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state as ps

from ..config.faults import iteration_faults, recovery_faults, spare_faults
from ..config.job import JobConfig
from ..devices import Device, nccl, select_device
from ..devices.groups import replication_backend
from ..devices.memory import ReplicaMemory
from ..digest import rank_digest
from ..errors import CoordinatorUnreachableError, OutOfRedundancyError
from ..hotswap import rebind, recovery
from ..hotswap.connection import Heartbeat, connect_store
from ..hotswap.injection import inject
from ..hotswap.membership import Membership, Roster
from ..logs import set_context
from ..replication import save_dir
from ..replication import snapshot_set as salvage
from ..replication.placement import Layout, place_replicas
from ..replication.replicator import Replicator
from ..replication.snapshot import RankState, Snapshotter
from . import gpt

log = logging.getLogger("megatron_deadpool.embedded.runtime")


class Runtime:
    """One process of the embedded job."""

    def __init__(self, job: JobConfig, *, pid: str, coordinator: str, token: str) -> None:
        self.job = job
        self.pid = pid
        self.coordinator = coordinator
        self.token = token
        self.cfg = job.deadpool
        self.layout = Layout(
            tp=job.parallel.tp,
            pp=job.parallel.pp,
            dp=job.parallel.dp,
            ranks_per_node=job.ranks_per_node,
        )
        self.placement = (
            place_replicas(self.layout, self.cfg.replicas) if self.cfg.enabled else None
        )
        self.rank: int | None = None
        self.generation = 0
        self.device: Device | None = None
        self.objs: gpt.TrainingObjects | None = None
        self.replicator: Replicator | None = None
        self.repl_group: dist.ProcessGroup | None = None
        self.last_completed = 0
        self.resumed_at = 0
        self.preempted_at: int | None = None
        self.sigterm = threading.Event()

    # ------------------------------------------------------------------ set-up
    def run(self) -> int:
        """The process's life; its exit code (0 done, 3 out of redundancy, 4 coordinator lost)."""
        try:
            return self._run()
        except OutOfRedundancyError as exc:
            log.error("%s", exc)
            return 3
        except (dist.DistStoreError, dist.DistNetworkError) as exc:
            log.error("%s", self._coordinator_lost(str(exc)))
            return 4
        except CoordinatorUnreachableError as exc:
            log.error("%s", exc)
            return 4

    def _run(self) -> int:
        # Slurm's time limit and preemption send SIGTERM: finish the iteration, agree on it
        # with every rank, save (with --save), and exit cleanly.
        signal.signal(signal.SIGTERM, lambda *_: self.sigterm.set())
        store = connect_store(self.coordinator, self.cfg.connect_timeout)
        self.members = Membership(store, self.pid)
        self.members.check_token(self.token)
        set_context(spare=self.pid) if self.pid.startswith("s") else None
        self.members.announce()
        self.heartbeat = Heartbeat(
            self.coordinator, self.pid, self.cfg.heartbeat_interval, self.cfg.connect_timeout
        )
        self.heartbeat.start()
        roster = self._wait_for_slot()
        if roster is None:
            log.info("released: the job ended without needing this spare")
            return 0
        self.device = select_device("auto")
        self._join(roster)
        self.objs = gpt.build(self.job)
        start = 1
        if roster.generation > 0:  # a spare taking a dead rank's slot
            start = self._restore(roster, needy=True) + 1
        elif self.job.train.load:
            start = self._load(self.job.train.load) + 1
        while True:
            try:
                self._train(start=start)
                self._finish()
                return 0
            except (OutOfRedundancyError, CoordinatorUnreachableError):
                raise
            except (dist.DistStoreError, dist.DistNetworkError):
                raise
            except RuntimeError as exc:  # a collective failed: a peer died or hung
                start = self._recover(exc) + 1

    def _coordinator_lost(self, why: str) -> CoordinatorUnreachableError:
        who = f"rank {self.rank}" if self.rank is not None else self.pid
        return CoordinatorUnreachableError(
            f"lost the coordinator {self.coordinator} ({why.splitlines()[0][:160]}); stopping "
            f"{who}: without it no failure could be recovered"
        )

    def _wait_for_slot(self) -> Roster | None:
        """Block until a roster names this process (or the job shuts down)."""
        faults = spare_faults(self.cfg.fail, self.pid)
        while True:
            if self.members.shutdown_requested() or self.sigterm.is_set():
                return None
            for index, iteration, kind in faults:
                store = self.members.store
                last = (
                    int(store.get("progress/last").decode())
                    if store.check(["progress/last"])
                    else 0
                )
                if last >= iteration and store.add(f"fault/fired/{index}/{self.pid}", 1) == 1:
                    log.warning("fault injection: spare %s %s", self.pid, kind)
                    inject(kind)
            g = self.members.generation()
            if g >= 0:
                roster = self.members.roster(g)
                if roster.rank_of(self.pid) is not None:
                    return roster
            time.sleep(0.05 if not self.pid.startswith("s") else 0.2)

    def _stamp(self, what: str) -> None:
        self.members.store.set(f"gen{self.generation}/{what}/{self.rank}", repr(time.time()))

    def _join(self, roster: Roster) -> None:
        """Create the default group of `roster`'s generation and Megatron's groups."""
        self.generation = roster.generation
        self.rank = roster.rank_of(self.pid)
        set_context(rank=self.rank, generation=self.generation)
        timeout = datetime.timedelta(seconds=self.cfg.pg_timeout)
        dist.init_process_group(
            backend=self.device.backend,
            store=dist.PrefixStore(f"gen{self.generation}", self.members.store),
            rank=self.rank,
            world_size=roster.world_size,
            timeout=timeout,
            **nccl.init_kwargs(self.device.backend, self.device.index),
        )
        ps.initialize_model_parallel(
            tensor_model_parallel_size=self.job.parallel.tp,
            pipeline_model_parallel_size=self.job.parallel.pp,
        )
        if self.cfg.enabled and self.generation == 0 and self.rank == 0:
            layout = {
                "tp": self.layout.tp,
                "pp": self.layout.pp,
                "dp": self.layout.dp,
                "ranks_per_node": self.layout.ranks_per_node,
                "replicas": self.cfg.replicas,
            }
            self.members.publish("job/layout", layout)
        if self.cfg.enabled:
            ReplicaMemory(self.cfg.replica_device, self.device)  # refuses 'gpu' without CUDA now
            backend = replication_backend(self.device)
            self.repl_group = dist.new_group(backend=backend, timeout=timeout)
        log.info(
            "joined generation %d as rank %d of %d (tp=%d pp=%d dp=%d)",
            self.generation,
            self.rank,
            roster.world_size,
            self.job.parallel.tp,
            self.job.parallel.pp,
            self.job.parallel.dp,
        )

    def _make_replicator(self) -> Replicator:
        assert self.device and self.placement and self.objs and self.repl_group
        state = RankState(self.objs.optimizer, self.objs.scheduler)
        return Replicator(
            Snapshotter(state, self.rank),
            self.placement,
            self.rank,
            self.repl_group,
            ReplicaMemory(self.cfg.replica_device, self.device),
            previous=self.replicator,
        )

    # ------------------------------------------------------------------ training
    def _train(self, start: int) -> None:
        faults = iteration_faults(self.cfg.fail, self.rank, self.job.ranks_per_node)
        for it in range(start, self.job.train.iters + 1):
            if self.heartbeat.lost:
                raise self._coordinator_lost(self.heartbeat.lost)
            # Each injected fault fires once per job: not again for the process that takes
            # the slot, nor when the iteration is recomputed after a rollback.
            if it in faults and self._fire(faults[it][0]):
                if faults[it][1] == "flip":
                    if self.replicator is not None:  # nothing held before the first round
                        self.replicator.flip_bits_at_rest()
                else:
                    self._fail(faults[it][1], f"at iteration {it}")
            t0 = time.perf_counter()
            repl = self.replicator
            if repl is not None:
                repl.before_step()
            step = gpt.train_step(
                self.job, self.objs, it, self._stop_vote(), repl.settle if repl else None
            )
            compute_s = time.perf_counter() - t0
            committed = None
            if self.cfg.enabled:
                if self.replicator is None:
                    self.replicator = self._make_replicator()
                committed = self.replicator.commit(step.replicas_ok)
                self.replicator.start_round(it)
            self._report(it, step, time.perf_counter() - t0, compute_s, committed)
            interval = self.job.train.save_interval
            if (interval and it % interval == 0) or (step.stop and self.job.train.save):
                self._save(it)
            if step.stop:
                self.preempted_at = it
                log.warning(
                    "preempted: stopping after iteration %d%s",
                    it,
                    " (checkpoint saved)" if self.job.train.save else "",
                )
                return

    def _stop_vote(self) -> bool:
        """This rank votes to stop: it got SIGTERM, or (rank 0) the launcher asked."""
        if self.sigterm.is_set():
            return True
        return self.rank == 0 and self.members.store.check(["preempt"])

    def _fire(self, index: int) -> bool:
        """True once per job for fault spec `index` on this rank."""
        return self.members.store.add(f"fault/fired/{index}/{self.rank}", 1) == 1

    def _fail(self, kind: str, when: str) -> None:
        log.warning("fault injection: %s %s", kind, when)
        self.members.store.set(f"fault/{self.pid}", repr(time.time()))
        inject(kind)

    def _report(
        self,
        it: int,
        step: gpt.StepResult,
        iter_s: float,
        compute_s: float,
        committed: int | None,
    ) -> None:
        self.last_completed = it
        if self.rank != 0:
            return
        if self.generation > 0 and it == self.resumed_at:
            self._stamp("first_iteration")
        record: dict[str, Any] = {
            "iteration": it,
            "time": time.time(),
            "loss": step.loss,
            "grad_norm": step.grad_norm,
            "lr": self.objs.optimizer.param_groups[0]["lr"],
            "iter_time_s": iter_s,
            "replication_s": iter_s - compute_s,
            "generation": self.generation,
            "committed_iteration": committed,
            "replica_bytes_sent": self.replicator.bytes_per_round if self.replicator else 0,
            "replication_parts_s": dict(self.replicator.timings) if self.replicator else {},
        }
        self.members.publish(f"metrics/g{self.generation}/{it}", record)
        self.members.store.set("progress/last", str(it))

    def _finish(self) -> None:
        if self.replicator is not None:
            committed = self.replicator.finish_round()
            if self.rank == 0:
                self.members.publish("replication/final", {"committed_iteration": committed})
        digest = rank_digest(self.objs.model)
        self.members.store.set(f"digest/{self.rank}", digest)
        if self.preempted_at is not None and self.rank == 0:
            self.members.publish(
                "preempted", {"iteration": self.preempted_at, "saved": bool(self.job.train.save)}
            )
        dist.barrier()
        self.members.store.set(f"done/{self.pid}", repr(time.time()))
        self.heartbeat.stopped.set()
        dist.destroy_process_group()
        log.info("done: parameter digest %s", digest[:16])

    def _salvage(self, report: dict[str, Any]) -> str:
        """Write this survivor's part of the snapshot set the coordinator chose; say what."""
        return recovery.salvage(
            self.members,
            self.replicator,
            root=self.job.train.save,
            report=report,
            rank=self.rank,
            world_size=self.layout.world_size,
        )

    # ------------------------------------------------------------------ persistent checkpoints
    def _save(self, iteration: int) -> None:
        from . import checkpoint

        t0 = time.perf_counter()
        path = checkpoint.save(self.objs, iteration, self.job.train.save)
        log.info("saved checkpoint %s in %.2fs", path, time.perf_counter() - t0)

    def _load(self, root: str) -> int:
        from . import checkpoint

        point = save_dir.resume_point(root)
        if point is None:
            log.info("no checkpoint in %s: starting from iteration 1", root)
            return 0
        if point[0] == "snapshots":  # the set survivors saved when memory could not recover
            t = point[1]
            state = RankState(self.objs.optimizer, self.objs.scheduler)
            flat = salvage.read_flat(salvage.rank_file(root, t, self.rank))
            Snapshotter.restore_into(state, flat, owner=self.rank, iteration=t)
            gpt.sync_params_from_main(self.objs)
            log.info("resumed from DeadPool snapshot set of iteration %d", t)
            return t
        t0 = time.perf_counter()
        iteration = checkpoint.load(self.objs, root)
        self.members.store.set(f"load/{self.rank}", repr(time.perf_counter() - t0))
        log.info("loaded checkpoint of iteration %d in %.2fs", iteration, time.perf_counter() - t0)
        return iteration

    # ------------------------------------------------------------------ recovery
    def _recover(self, exc: BaseException) -> int:
        """Survivor side: abort, agree, rebuild groups in place, restore; returns T."""
        t0 = time.time()
        log.warning("collective failed (%s): entering recovery", str(exc).splitlines()[0][:160])
        # The traceback's frames hold the failed collective's group: drop them, or the group
        # (and its connections) outlive the release below.
        traceback.clear_frames(exc.__traceback__)
        roots = [*self._roots(), self.replicator]
        group, self.repl_group = self.repl_group, None  # no reference may outlive the release
        released = recovery.release_groups(self.replicator, roots, group)
        log.info("released %d group handles", released)
        for index, kind in recovery_faults(self.cfg.fail, self.rank):
            if self._fire(index):
                if kind == "flip":
                    if self.replicator is not None:
                        self.replicator.flip_bits_at_rest()
                else:
                    self._fail(kind, "while in recovery")
        roster = self._agree(exc, t0)
        self._join(roster)
        n = rebind.attach(
            [*self._roots(), self.replicator], {"DEADPOOL_REPLICATION": self.repl_group}
        )
        stale = rebind.stale_group_refs([*self._roots(), self.replicator])
        self.members.store.set(f"gen{self.generation}/stale_refs/{self.rank}", str(len(stale)))
        if stale:
            raise RuntimeError(f"objects still reference groups of an old generation: {stale[:3]}")
        log.info("released %d group handles; re-attached %d; none stale", released, n)
        gpt.seed_rng(self.job.train.seed)  # recreate the RNG tracker; restored below
        gpt.mirror_optimizer_build(self.objs)
        log.info("rebuilt Megatron groups; rebound %d process-group references", n)
        return self._restore(roster, needy=False)

    def _roots(self) -> list[Any]:
        assert self.objs is not None
        return [self.objs.model, self.objs.optimizer, self.objs.scheduler, self.objs.config]

    def _agree(self, exc: BaseException, t0: float) -> Roster:
        """Report holdings for the coordinator's plan(s) until a roster includes this process."""
        return recovery.agree(
            self.members,
            generation=self.generation,
            rank=self.rank,
            pid=self.pid,
            replicator=self.replicator,
            report={"last_completed": self.last_completed},
            deadline=t0 + self.cfg.heartbeat_timeout + 30.0,
            cause=exc,
            on_abort=self._salvage,
        )

    def _restore(self, roster: Roster, *, needy: bool) -> int:
        """Bring every rank to the restore iteration T; returns T.

        Holders send the needy ranks their shard of T (verified by its checksum on arrival);
        the others roll back to their local snapshot of T. Then weights are re-derived from
        the main-param shards (DP all-gather) and replication restarts with a round of T, which
        also re-sends the replicas the dead ranks held.
        """
        assert self.objs is not None and self.repl_group is not None
        t_iter = roster.restore_iteration
        from_holder = recovery.exchange_shards(
            self.members,
            roster,
            rank=self.rank,
            state=RankState(self.objs.optimizer, self.objs.scheduler),
            replicator=self.replicator,
            group=self.repl_group,
            needy=needy,
        )
        gpt.sync_params_from_main(self.objs)
        self.replicator = self._make_replicator()
        self.replicator.start_round(t_iter)
        self.replicator.finish_round()
        self._stamp("restored")
        self.resumed_at = t_iter + 1
        self.last_completed = t_iter
        log.info(
            "restored iteration %d (%s)",
            t_iter,
            "from holder" if from_holder else "from local snapshot",
        )
        return t_iter
