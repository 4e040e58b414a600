"""A round's verdict agreed without a collective on the critical path (CUDA).

A round is committed once every rank verified what it received: the ranks agree by summing
their failures. A job whose step has a world all-reduce anyway carries the verdicts on it (the
embedded job); otherwise `Replicator.finish_round` needs one collective of its own per step. On
the CPU that is a blocking gloo all-reduce (as before). On CUDA (`devices.groups.verdict_ahead`)
an `AheadVerdict` posts it as soon as the round is settled - before the next optimizer step,
from the optimizer-step guard - as an asynchronous one-element NCCL all-reduce on the side
stream, followed by a copy of the sum into pinned host memory and an event; the replicator
reads it after that step, when the next round begins. By then the sum has long arrived: the
host waits for an 8-byte copy, never for the step's kernels or for a ring of TCP hops.

Every rank posts it at the same point of the same step (the optimizer step is collective), so
the all-reduces pair up in order on every rank; a rank that reaches `finish_round` without
having posted one (no optimizer step ran) posts the same one-element all-reduce there, which
pairs with the others' as well. A verdict whose group was aborted while it was in flight is
never read as a verdict (`devices.abort.abort_count`): reading it raises `DistBackendError`,
which the driver takes for the failure it recovers from.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from ..devices.abort import abort_count
from ..devices.groups import tensor_device


class AheadVerdict:
    """One replicator's verdict tensor and the verdict in flight, if any."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.device = tensor_device(group)
        self.flag = torch.zeros(1, dtype=torch.int64, device=self.device)
        on_gpu = self.device.type == "cuda"
        self.host = torch.zeros(1, dtype=torch.int64, pin_memory=on_gpu) if on_gpu else self.flag
        self._pending: tuple[dist.Work, Any, int] | None = None  # (work, event, abort count)

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def post(self, ok: bool, stream: Any = None) -> None:
        """Post this rank's verdict (`ok`: every replica it received verified); `stream`: the
        CUDA stream to run on (the replicator's side stream)."""
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            self.flag.fill_(0 if ok else 1)
            count = abort_count()
            work = dist.all_reduce(self.flag, group=self.group, async_op=True)
            event = None
            if self.device.type == "cuda":
                work.wait()  # the stream waits for NCCL's; the host does not
                self.host.copy_(self.flag, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
        self._pending = (work, event, count)

    def read(self) -> bool:
        """Whether every rank verified the round (waits for the posted verdict)."""
        assert self._pending is not None, "no verdict posted"
        work, event, count = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        else:
            work.wait()
        failed = int(self.host.item())
        if abort_count() != count:
            raise dist.DistBackendError(
                "the replication group was aborted while a round's verdict was in flight"
            )
        return failed == 0

    def drop(self) -> None:
        """Forget a verdict in flight (its group is aborted: never read it)."""
        self._pending = None
