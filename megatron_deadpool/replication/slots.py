"""A replicator's buffers: double-buffered slots, and the pool that hands them out.

Every owner a rank keeps copies of (itself included) gets a `SlotPair`: two flat buffers and the
iteration each holds verified. A round overwrites one slot and never the other, so a failure
mid-round always leaves a complete, verified copy (`Replicator`). A replicator built after a
recovery takes over its predecessor's buffers (`Pool`) instead of allocating a second set next
to them; new buffers come from `devices.pinned` (host buffers of exactly the size asked for,
page-locked when a GPU copies into them), or map the node's segment files (`segments.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..devices.pinned import buffer


@dataclass
class SlotPair:
    """Two flat buffers and the iteration each holds verified (None: nothing valid)."""

    buffers: tuple[torch.Tensor, torch.Tensor]
    verified: list[int | None] = field(default_factory=lambda: [None, None])

    def free_slot(self) -> int:
        """The slot to overwrite: never the one holding the newest verified iteration."""
        latest = self.latest()
        if latest is None:
            return 0
        return 1 - next(i for i, it in enumerate(self.verified) if it == latest[0])

    def latest(self) -> tuple[int, torch.Tensor] | None:
        """(iteration, buffer) of the newest verified content."""
        best = None
        for slot, it in enumerate(self.verified):
            if it is not None and (best is None or it > best[0]):
                best = (it, self.buffers[slot])
        return best

    def find(self, iteration: int) -> torch.Tensor | None:
        """The buffer holding verified `iteration`, if any."""
        for slot, it in enumerate(self.verified):
            if it == iteration:
                return self.buffers[slot]
        return None

    def iterations(self) -> list[int]:
        return sorted(it for it in self.verified if it is not None)


class Pool:
    """Buffers to hand out: `reusable` ones (a predecessor's), taken when size and place match,
    else new ones of exactly the size asked for."""

    def __init__(
        self,
        reusable: Iterable[torch.Tensor],
        device: torch.device,
        pin: bool,
        mapped: dict[Path, torch.Tensor] | None = None,
    ) -> None:
        """`mapped`: a predecessor's buffers that map segment files, by file."""
        self.device = device
        self.pin = pin
        self.free = [b for b in reusable if b.device == device and b.is_pinned() == pin]
        self.mapped = {
            p: b for p, b in (mapped or {}).items() if b.device == device and b.is_pinned() == pin
        }

    def take(self, nbytes: int, path: Path | None = None) -> torch.Tensor:
        """A buffer of `nbytes`; with `path` (host memory), the mapping of that file - the
        predecessor's (no second mapping, no second page-locking), or a new one (`buffer`)."""
        if path is not None:
            kept = self.mapped.pop(path, None)
            if kept is not None and kept.numel() == nbytes:
                return kept
            return buffer(nbytes, self.device, pinned=self.pin, path=path)
        for i, buf in enumerate(self.free):
            if buf.numel() == nbytes:
                return self.free.pop(i)
        return buffer(nbytes, self.device, pinned=self.pin)

    def pair(self, nbytes: int, paths: tuple[Path, Path] | None = None) -> SlotPair:
        """Two buffers of `nbytes`: `paths`, the files of the two slots (`segments`)."""
        first, second = paths or (None, None)
        return SlotPair((self.take(nbytes, first), self.take(nbytes, second)))


def gpu_bytes(buffers: Iterable[torch.Tensor]) -> int:
    """Bytes of the GPU buffers among `buffers` (what a successor could take over)."""
    return sum(b.numel() * b.element_size() for b in buffers if b.device.type == "cuda")
