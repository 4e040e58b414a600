"""In-place respawn: a failed process replaced on its own node, so that it costs no spare.

Most interruptions of a large run are one process crashing or hanging on a node that is still
fine (a software fault, an NCCL or driver error, a killed process). Replacing that process
with a spare spends a whole spare node, and with S spares the (S+1)-th failure ends the run.
When the node's agent - whoever starts and supervises that node's processes - is alive, the
coordinator instead asks it for a new process on the same node, in the failed process's place
(its GPU, its slot); the newcomer joins exactly as a spare would (its state from its peers'
replicas), the survivors roll back as they do for any failure, and the spare pool is untouched.

A node is not trusted forever: a node whose processes keep failing is probably faulty (a GPU
with memory errors, a flaky NIC), and respawning there again and again would stall the job.
`RespawnBudget` allows `limit` respawns per node within a sliding `window` of seconds; past
that, and whenever the node's agent is lost (the node crashed, froze or was cut off), its
failed ranks take spares as before. `limit` 0 turns in-place respawn off. A standby coordinator
that takes the job over goes on counting from where the lost one was (`recall`: each agent
tells it how long ago it respawned processes), not afresh.

Pure bookkeeping (an injectable clock); who can start a process where is `NodeAgents`, the
coordinator's way to reach the agents (`decide.py` decides, `execute.py` orders, a launcher or
agent acts).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol


class NodeAgents(Protocol):
    """The agents of a job's nodes, as the coordinator sees them."""

    def node_of(self, member: str) -> int:
        """The node `member` runs (or ran) on: where a rank's process is, not the rank's place
        in the layout (a spare that took rank r runs on a spare node)."""

    def alive(self, node: int) -> bool:
        """Whether node `node`'s agent can start a process there now."""

    def respawn(self, rank: int, dead: str, node: int) -> str:
        """Start a new process on node `node` in the place of member `dead`, which held
        `rank`; its member name (it waits for its slot in the next plan, as a spare does)."""


class RespawnBudget:
    """At most `limit` respawns per node within any `window` seconds."""

    def __init__(self, limit: int, window: float) -> None:
        self.limit = limit
        self.window = window
        self._times: dict[int, deque[float]] = {}
        self._recalled: set[int] = set()

    def allows(self, node: int, now: float) -> bool:
        """Whether node `node` may respawn a process at monotonic time `now`."""
        times = self._times.setdefault(node, deque())
        while times and times[0] <= now - self.window:
            times.popleft()
        return len(times) < self.limit

    def recall(self, node: int, ages: Sequence[float], now: float) -> None:
        """Node `node` respawned processes `ages` seconds before `now` for an earlier
        coordinator of the job (a standby that took it over: `messages.RespawnHistory`);
        counted once per node."""
        if node in self._recalled:
            return
        self._recalled.add(node)
        times = self._times.setdefault(node, deque())
        self._times[node] = deque(sorted([*times, *(now - age for age in ages)]))

    def recalled(self, node: int) -> bool:
        """Whether `recall` counted node `node`'s earlier respawns already."""
        return node in self._recalled

    def spend(self, node: int, now: float) -> None:
        """Node `node` respawned a process at `now`."""
        self._times.setdefault(node, deque()).append(now)

    def used(self, node: int) -> int:
        """Respawns of node `node` still inside the window at the last `allows`."""
        return len(self._times.get(node, ()))
