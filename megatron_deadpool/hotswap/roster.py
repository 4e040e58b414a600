"""A generation's world: which process fills which rank, and how processes are named.

A process id (pid) is `a{r}` for the initial active of rank r and `s{i}` for spare i. A roster is
what the coordinator publishes for each generation (`membership.Membership.publish_roster`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Roster:
    """Generation g's world: which process fills which rank."""

    generation: int
    world_size: int
    slots: dict[int, str]
    restore_iteration: int | None = None

    def rank_of(self, pid: str) -> int | None:
        for rank, p in self.slots.items():
            if p == pid:
                return rank
        return None

    def successor(self, plan: dict[str, Any], restore_iteration: int) -> Roster | None:
        """The roster `plan` (built on this one) leads to, without reading it from the store;
        None when the plan is built on another roster."""
        if plan.get("base") != self.generation:
            return None
        slots = {**self.slots, **{int(r): p for r, p in plan["replaced"].items()}}
        return Roster(plan["generation"], self.world_size, slots, restore_iteration)

    def to_json(self) -> str:
        return json.dumps(
            {
                "generation": self.generation,
                "world_size": self.world_size,
                "slots": {str(r): p for r, p in self.slots.items()},
                "restore_iteration": self.restore_iteration,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Roster:
        d = json.loads(text)
        return cls(
            generation=d["generation"],
            world_size=d["world_size"],
            slots={int(r): p for r, p in d["slots"].items()},
            restore_iteration=d.get("restore_iteration"),
        )


def pid_of(task: int, world_size: int) -> str:
    """The process id of task index `task`: actives first (ranks 0..W-1), then spares."""
    return f"a{task}" if task < world_size else f"s{task - world_size}"
