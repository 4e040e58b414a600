"""The life of one embedded-job process: join a generation, train, replicate, report.

Survivors keep their Python objects for the whole run; a spare builds its own when it is
assigned a slot. The training loop is Megatron's: forward/backward through
`get_forward_backward_func`, the distributed optimizer's step, the LR scheduler; DeadPool adds
`Replicator.finish_round/start_round` after each step (off the critical path) and failure
handling around it.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from . import gpt
from .devices import Device, select_device
from .digest import rank_digest
from .jobspec import JobConfig
from .logs import set_context
from .membership import Membership, Roster
from .replicator import Replicator
from .snapshot import RankState, Snapshotter
from .topology import Layout, place_replicas
from .worker import Heartbeat, connect_store, inject, my_faults

log = logging.getLogger("megatron_deadpool.runtime")


class Runtime:
    """One process of the embedded job."""

    def __init__(self, job: JobConfig, *, pid: str, coordinator: str, token: str) -> None:
        self.job = job
        self.pid = pid
        self.coordinator = coordinator
        self.token = token
        self.cfg = job.deadpool
        self.layout = Layout(
            tp=job.parallel.tp, pp=job.parallel.pp, dp=job.parallel.dp,
            ranks_per_node=job.ranks_per_node,
        )
        self.placement = place_replicas(self.layout, self.cfg.replicas) if self.cfg.enabled else None
        self.rank: int | None = None
        self.generation = 0
        self.device: Device | None = None
        self.objs: gpt.TrainingObjects | None = None
        self.replicator: Replicator | None = None
        self.repl_group: dist.ProcessGroup | None = None

    # ------------------------------------------------------------------ set-up
    def run(self) -> int:
        store = connect_store(self.coordinator, self.cfg.pg_timeout)
        self.members = Membership(store, self.pid)
        self.members.check_token(self.token)
        set_context(spare=self.pid) if self.pid.startswith("s") else None
        self.members.announce()
        self.heartbeat = Heartbeat(
            self.coordinator, self.pid, self.cfg.heartbeat_interval, self.cfg.pg_timeout
        )
        self.heartbeat.start()
        roster = self._wait_for_slot()
        if roster is None:
            log.info("released: the job ended without needing this spare")
            return 0
        self.device = select_device("auto")
        self._join(roster)
        self.objs = gpt.build(self.job)
        self._train(start=1)
        self._finish()
        return 0

    def _wait_for_slot(self) -> Roster | None:
        """Block until a roster names this process (or the job shuts down)."""
        while True:
            if self.members.shutdown_requested():
                return None
            g = self.members.generation()
            if g >= 0:
                roster = self.members.roster(g)
                if roster.rank_of(self.pid) is not None:
                    return roster
            time.sleep(0.05 if not self.pid.startswith("s") else 0.2)

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
        )
        ps.initialize_model_parallel(
            tensor_model_parallel_size=self.job.parallel.tp,
            pipeline_model_parallel_size=self.job.parallel.pp,
        )
        if self.cfg.enabled:
            backend = "gloo" if self.device.replica_device(self.cfg.replica_device).type == "cpu" \
                else "nccl"
            self.repl_group = dist.new_group(backend=backend, timeout=timeout)
        log.info(
            "joined generation %d as rank %d of %d (tp=%d pp=%d dp=%d)",
            self.generation, self.rank, roster.world_size,
            self.job.parallel.tp, self.job.parallel.pp, self.job.parallel.dp,
        )

    def _make_replicator(self) -> Replicator:
        assert self.device and self.placement and self.objs and self.repl_group
        state = RankState(self.objs.optimizer, self.objs.scheduler)
        return Replicator(
            Snapshotter(state, self.rank),
            self.placement,
            self.rank,
            self.repl_group,
            self.device.replica_device(self.cfg.replica_device),
            pin_memory=self.device.pin_memory and self.cfg.replica_device != "gpu",
        )

    # ------------------------------------------------------------------ training
    def _train(self, start: int) -> None:
        faults = my_faults(self.job, self.rank) if self.generation == 0 else {}
        for it in range(start, self.job.train.iters + 1):
            if it in faults:
                log.warning("fault injection: %s at iteration %d", faults[it], it)
                inject(faults[it])
            t0 = time.perf_counter()
            if self.replicator is not None:
                self.replicator.before_step()
            loss, grad_norm = gpt.train_step(self.job, self.objs, it)
            compute_s = time.perf_counter() - t0
            committed = None
            if self.cfg.enabled:
                if self.replicator is None:
                    self.replicator = self._make_replicator()
                committed = self.replicator.finish_round()
                self.replicator.start_round(it)
            self._report(it, loss, grad_norm, time.perf_counter() - t0, compute_s, committed)

    def _report(
        self, it: int, loss: float, grad_norm: float, iter_s: float, compute_s: float,
        committed: int | None,
    ) -> None:
        if self.rank != 0:
            return
        record: dict[str, Any] = {
            "iteration": it,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": self.objs.optimizer.param_groups[0]["lr"],
            "iter_time_s": iter_s,
            "replication_s": iter_s - compute_s,
            "generation": self.generation,
            "committed_iteration": committed,
            "replica_bytes_sent": self.replicator.bytes_per_round if self.replicator else 0,
        }
        self.members.publish(f"metrics/{it}", record)

    def _finish(self) -> None:
        if self.replicator is not None:
            committed = self.replicator.finish_round()
            if self.rank == 0:
                self.members.publish("replication/final", {"committed_iteration": committed})
        digest = rank_digest(self.objs.model)
        self.members.store.set(f"digest/{self.rank}", digest)
        dist.barrier()
        self.heartbeat.stopped.set()
        log.info("done: parameter digest %s", digest[:16])
