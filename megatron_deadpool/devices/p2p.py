"""Posting one round of point-to-point transfers: one batched call where the backend needs it.

A round (every send and receive of a replication round, or of a recovery's shard exchange) is
posted with one `post` call.

NCCL needs the batch (`dist.batch_isend_irecv`, torch 2.13 `distributed_c10d.py`): sends and
receives posted as separate calls queue on one NCCL stream each, so mutual pairs (dp=8 with 4
ranks per node pairs 0<->4) each wait in their send for a receive the other has not reached;
and a single send/recv uses a lazily created 2-rank communicator per pair
(`ProcessGroupNCCL::pointToPoint`, "For single P2P, preserve the old two-rank behavior"),
whose set-up across 3+ failure domains can form a cycle. Inside `batch_isend_irecv` the ops
run between ``ncclGroupStart/End`` on the group's own communicator ("For batch P2P, we need
to treat it like a collective when selecting communicator"). The batch returns one `Work`
for all its ops (`_coalescing_manager`), shared here by every transfer of the round. torch's
note: if the batch is the group's first collective, every rank of the group must take part;
the replicator's size exchange (an all-reduce) always comes first.

gloo keeps the cheaper direct posting (`ProcessGroup.send/recv`): gloo has no coalescing
(`supports_coalescing` is False, so `batch_isend_irecv` itself just loops over
`isend`/`irecv`), its sends are buffered by its event-loop thread and never wait for the
matching receive, and every pair of a gloo group is connected when the group is created, so
neither hazard above exists; the batch would only add `dist.isend`'s Python checks. Measured
here (2 gloo processes, 1 send + 1 receive of 64 B per round, 2000 rounds, two shared
cores): 353-385 us per round posted directly, 507-670 us through `dist.isend/irecv`,
493-617 us through `batch_isend_irecv`.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

GLOO_SETTLE_S = 1.0
"""Bound on `arrived` for a gloo transfer whose connection was not shut down."""


@dataclass(frozen=True)
class Transfer:
    """One send or receive of a round; `peer` is a global rank."""

    kind: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int


def batched(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether a round on `device` tensors must be one batch: torch's own criterion in
    `batch_isend_irecv` (the backend for that device supports coalescing, i.e. NCCL)."""
    return bool(group._get_backend(device).supports_coalescing)


def post(
    transfers: Sequence[Transfer],
    group: dist.ProcessGroup,
    *,
    tag: int = 0,
    batch: bool | None = None,
) -> list[dist.Work]:
    """Post every transfer of one round at once; returns one `Work` per transfer (the same
    object for all transfers of a batch). All tensors must live on one device. `batch`
    overrides the backend's choice (tests run the batched form on gloo)."""
    if not transfers:
        return []
    device = transfers[0].tensor.device
    if any(t.tensor.device != device for t in transfers):
        raise ValueError("one round's transfers must all use tensors on one device")
    peers = {t.peer: dist.get_group_rank(group, t.peer) for t in transfers}
    if batched(group, device) if batch is None else batch:
        ops = [
            dist.P2POp(
                dist.isend if t.kind == "send" else dist.irecv,
                t.tensor,
                group=group,
                tag=tag,
                group_peer=peers[t.peer],
            )
            for t in transfers
        ]
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(transfers):
            return list(works)
        (work,) = works  # coalesced: one work completes the whole batch
        return [work] * len(transfers)
    return [
        (group.send if t.kind == "send" else group.recv)([t.tensor], peers[t.peer], tag)
        for t in transfers
    ]


def arrived(work: dist.Work, group: dist.ProcessGroup, device: torch.device) -> bool:
    """After `abort_groups`: whether a posted transfer finished without error; never waits on
    a peer.

    NCCL: `Work.is_completed()` (its end event passed; after an abort an aborted kernel passes
    too, so callers verify the bytes). gloo: a send/recv work reports `is_completed()` only
    once `wait()` ran (verified on torch 2.13), so this waits - which returns at once for data
    that arrived and raises at once for a pair whose connection `abort_groups` shut down; the
    short timeout bounds a connection that was never recorded.
    """
    try:
        if batched(group, device):
            if not work.is_completed():
                return False
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=GLOO_SETTLE_S))
    except Exception:  # noqa: BLE001 - failed, aborted or timed out: the bytes are not usable
        return False
    return True
