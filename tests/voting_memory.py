"""Shared by the replication tests that build `Replicator`s on the CPU: a stand-in for
`devices.memory.ReplicaMemory` whose vote the test decides.

`VotingMemory(vote)` answers `local_choice` as a rank reading its free GPU memory would: the
choice its predecessor's buffers are in when there is one (`previous`), else `vote` ("gpu" or
"host"; an exception is raised instead). Its buffers are host memory whatever the choice (the
CPU has no GPU memory: the vote is what is tested), and it records what each vote was asked.
"""

from __future__ import annotations

from typing import Any

import torch


class VotingMemory:
    """`ReplicaMemory` as the replicator uses it, voting `vote` (module docstring)."""

    segments = None  # no segment files (`replication/segments.py`)

    def __init__(self, vote: str | Exception) -> None:
        self.vote = vote
        self.asked: list[dict[str, Any]] = []

    def local_choice(self, need: int, *, previous: Any = None, reusable: int = 0) -> str:
        self.asked.append({"previous": previous, "reusable": reusable})
        if previous is not None:
            return previous
        if isinstance(self.vote, Exception):
            raise self.vote
        return self.vote

    def torch_device(self, choice: str) -> torch.device:
        return torch.device("cpu")

    def pinned(self, choice: str) -> bool:
        return False
