"""This process's replication: where its replicas go (the layout of Megatron's groups and the
placement), the groups they travel on, the replicator and its rounds. `Replicas` is a part of
`Driver` (`driver.py`), kept apart for its size; the replicator itself is
`replication/replicator.py`.
"""

from __future__ import annotations

import datetime
import logging

import torch.distributed as dist

from ...config.deadpool import DeadpoolConfig
from ...devices import Device, nccl
from ...devices.groups import (
    host_transfer_group,
    new_host_group,
    replication_backend,
    verdict_ahead,
)
from ...devices.memory import ReplicaMemory
from ...errors import DeadpoolRuntimeError
from ...replication import segments
from ...replication.placement import Layout, Placement, RankOrder, place_replicas
from ...replication.replicator import Replicator
from ...replication.snapshot import Snapshotter
from ..protocol.messages import LayoutRecord
from ..protocol.worker_view import WorkerView
from .adapter import JobAdapter
from .layout_check import check_megatron_groups, megatron_layout

log = logging.getLogger("megatron_deadpool.driver")


class Replicas:
    """The driver's replication (a part of `Driver`)."""

    cfg: DeadpoolConfig
    device: Device
    generation: int
    rank: int | None
    layout: Layout | None
    placement: Placement | None
    replicator: Replicator | None
    repl_group: dist.ProcessGroup | None
    host_repl_group: dist.ProcessGroup | None
    pg_timeout: datetime.timedelta
    committed: int | None

    @property
    def membership(self) -> WorkerView:
        """This process's store access (`Driver.membership`)."""
        raise NotImplementedError

    @property
    def job(self) -> JobAdapter:
        """The job's objects (`Driver.job`)."""
        raise NotImplementedError

    def _rank(self) -> int:
        raise NotImplementedError

    def _layout(self) -> Layout:
        raise NotImplementedError

    def place_replicas(
        self, ranks_per_node: int | None = None, order: RankOrder = RankOrder.TP_DP_PP
    ) -> Layout:
        """Megatron's groups exist: the first time, work out the layout from them and `order`
        (Megatron's rank order, which the job's adapter knows), check that it names the groups
        Megatron made, and place the replicas (rank 0 of generation 0 publishes the layout for
        the coordinator). Later calls (each generation's `join`) keep the first layout."""
        if self.layout is None:
            layout = megatron_layout(ranks_per_node or self.cfg.ranks_per_node, order)
            check_megatron_groups(layout, dist.get_rank())
            self.layout = layout
            if not self.cfg.enabled:
                return self.layout
            self.placement = place_replicas(self.layout, self.cfg.replicas)
            record = self._layout_record()
            if self.generation == 0 and self.rank == 0 and record is not None:
                self.membership.publish_layout(record)
                log.info("replicas placed: %s", self.placement.describe())
        return self.layout

    def _layout_record(self) -> LayoutRecord | None:
        """The layout as the coordinator learns it (None before replicas are placed)."""
        if self.layout is None or self.placement is None:
            return None
        return LayoutRecord.of(self.layout, self.cfg.replicas)

    def new_replication_group(self) -> None:
        """Create this generation's replication group(s) (every rank, after Megatron's
        groups; `devices.groups`): the world-wide one, and on CUDA, where replicas may live in
        host memory, the data-parallel peers' gloo group. Then, with
        ``DEADPOOL_NCCL_INIT=warm``, set up this rank's communicators (`nccl.warm_groups`)."""
        self._replica_memory()  # refuses 'gpu' without CUDA before any step
        backend = replication_backend(self.device)
        self.repl_group = dist.new_group(backend=backend, timeout=self.pg_timeout)
        self.host_repl_group = None
        if host_transfer_group(self.device, self.cfg.replica_device):
            peers = self._layout().peer_group_of[self._rank()]
            self.host_repl_group = new_host_group(peers, self.pg_timeout)
        nccl.warm_groups()

    def replicate(self, n: int, verdict: bool | None = None) -> int | None:
        """After optimizer step n: end the previous round (committed by `verdict`, every
        rank's agreement carried by the step; None: agree here) and start round n. Returns the
        globally committed iteration."""
        if self.replicator is None:
            self.replicator = self._make_replicator()
        if verdict is None:  # no step collective carries it: on CUDA agree before the next step
            self.replicator.verdict_ahead = verdict_ahead(self.device)
            self.committed = self.replicator.finish_round()
        else:
            self.committed = self.replicator.commit(verdict)
        self.replicator.start_round(n)
        return self.committed

    def drain(self) -> int | None:
        """Settle and commit the round in flight (end of training); the committed iteration."""
        if self.replicator is not None and self.repl_group is not None:
            self.committed = self.replicator.finish_round()
        return self.committed

    def _replica_memory(self) -> ReplicaMemory:
        return ReplicaMemory(self.cfg.replica_device, self.device, segments.folder())

    def snapshotter_ahead(self) -> Snapshotter | None:
        """A newcomer's snapshotter, built before its restore (`lazy_state` creates what the
        optimizer's first step would: the layout of the shard it restores, predicted): the
        restore then loads through it and the first replicator keeps it
        (`snapshot.load_snapshot`; another layout is left to `restore_into`). None with
        DeadPool's replication off."""
        if not self.cfg.enabled:
            return None
        return Snapshotter(self.job.rank_state(), self._rank())

    def _make_replicator(self, snapshotter: Snapshotter | None = None) -> Replicator:
        """A new replicator (after a restore: it takes over its predecessor's buffers, and the
        `snapshotter` that loaded the restore, if any)."""
        if self.placement is None or self.repl_group is None:
            raise DeadpoolRuntimeError("no replication group yet (`join`)")
        return Replicator(
            snapshotter or Snapshotter(self.job.rank_state(), self._rank()),
            self.placement,
            self._rank(),
            self.repl_group,
            self._replica_memory(),
            previous=self.replicator,
            host_group=self.host_repl_group,
        )
