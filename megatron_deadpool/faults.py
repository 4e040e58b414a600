"""Fault-injection specs (`--fail RANK@ITER[:kill|hang]`, `--fail node:N@ITER`): parsing only.

A spec names who fails (one rank, or every rank of failure domain N), at which iteration
(the rank fails as it starts that iteration, so its peers are caught in that iteration's
collectives) and how: `kill` (SIGKILL, the default) or `hang` (SIGSTOP: the process stays alive but
silent, as a hung GPU or a stuck NIC would).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from .errors import ConfigError

_SPEC = re.compile(r"^(?:(?P<node>node:)?(?P<who>\d+))@(?P<iter>\d+)(?::(?P<kind>kill|hang))?$")

FaultKind = Literal["kill", "hang"]


@dataclass(frozen=True)
class FaultSpec:
    """One injected failure."""

    iteration: int
    kind: FaultKind
    rank: int | None = None
    node: int | None = None

    def ranks(self, ranks_per_node: int) -> list[int]:
        """The world ranks this fault hits."""
        if self.rank is not None:
            return [self.rank]
        assert self.node is not None
        return list(range(self.node * ranks_per_node, (self.node + 1) * ranks_per_node))

    def __str__(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else f"node {self.node}"
        return f"{who} {self.kind} at iteration {self.iteration}"


def parse_fault(text: str) -> FaultSpec:
    """Parse one `--fail` value; raise `ConfigError` naming the expected form."""
    match = _SPEC.match(text.strip())
    if match is None:
        raise ConfigError(
            f"fail: {text!r} is not RANK@ITER[:kill|hang] or node:N@ITER[:kill|hang] "
            "(e.g. 2@5:kill, node:1@4)"
        )
    iteration = int(match["iter"])
    if iteration < 1:
        raise ConfigError(f"fail: iteration in {text!r} must be >= 1")
    kind: FaultKind = match["kind"] or "kill"  # type: ignore[assignment]
    who = int(match["who"])
    if match["node"]:
        return FaultSpec(iteration=iteration, kind=kind, node=who)
    return FaultSpec(iteration=iteration, kind=kind, rank=who)


def check_faults(faults: list[FaultSpec], world_size: int, ranks_per_node: int, iters: int) -> None:
    """Check that every fault targets existing ranks within the run's iterations."""
    nodes = world_size // ranks_per_node
    for fault in faults:
        if fault.rank is not None and fault.rank >= world_size:
            raise ConfigError(f"fail: rank {fault.rank} does not exist (world size {world_size})")
        if fault.node is not None and fault.node >= nodes:
            raise ConfigError(f"fail: node {fault.node} does not exist ({nodes} nodes)")
        if fault.iteration > iters:
            raise ConfigError(
                f"fail: iteration {fault.iteration} is past the run's last iteration {iters}"
            )
