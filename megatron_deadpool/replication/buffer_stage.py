"""A staging copy of the model buffers, taken on the training's own stream before a capture.

The optimizer step is the only writer of a rank's optimizer shard, and the next step waits for
the capture (`Replicator.before_step`, through the step guard). Model buffers have other
writers: Megatron's MoE router fills ``local_tokens_per_expert`` (and its peers) in the
forward pass, which on the Megatron-LM path runs right after `start_round` with nothing
ordering it after the side-stream capture. On an H200 a 4 MiB buffer packed behind a 1.5 GB
shard was read after the next forward had overwritten it in 12 of 12 rounds.

So the capture never reads a live buffer. `BufferStage.take` copies every buffer into one
staging area on the stream that is current when the capture starts (the training's stream):
the copy is ordered after everything the training issued before it - the step whose state is
captured - and before everything it issues after it - the next forward pass - by the stream's
own order, whatever the side stream does. The capture then packs the staging area instead of
the buffers, with the same packed layout (each buffer's view has its dtype, shape and byte
size), so a replica and a restore into the live buffers are unchanged. The copy is a few MB
of device-to-device bytes and no host wait.

The staging area is reused by the next capture; its reuse is ordered by the caller
(`Snapshotter.capture`): the training's stream waits for the previous capture's completion
event before `take` writes the area again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import pack


class BufferStage:
    """One staging area holding a copy of each of `buffers` (device tensors, in order)."""

    def __init__(self, buffers: Sequence[torch.Tensor], device: torch.device) -> None:
        self.sources = list(buffers)
        offsets = pack.packed_offsets(self.sources)
        self.area = torch.zeros(pack.packed_nbytes(self.sources), dtype=torch.uint8, device=device)
        self.views: list[torch.Tensor] = []
        for buf, at in zip(self.sources, offsets):
            nbytes = buf.numel() * buf.element_size()
            # 16-aligned offsets: a byte slice can be viewed as any dtype.
            view = self.area[at : at + nbytes].view(buf.dtype).view(buf.shape)
            self.views.append(view)

    @property
    def nbytes(self) -> int:
        """Bytes of the staging area."""
        return self.area.numel()

    def take(self) -> None:
        """Copy every buffer into its view, enqueued on the current stream (one fused copy
        where torch has it)."""
        if not self.sources:
            return
        with torch.no_grad():
            torch._foreach_copy_(self.views, self.sources)
