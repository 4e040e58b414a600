"""The interface between the driver and a job: what the driver asks of the job (`JobAdapter`),
and what it hands back about each recovery (`RecoveryRecord`).

The embedded GPT job (`embedded.job`) and Megatron-LM's session (`megatron_lm.session`) are the
two implementations. Each subclasses `JobAdapter`, which answers for a job that needs nothing
particular where it can (`after_rejoin`, `after_restore`, `recovery_report`, the start-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ...replication.snapshot import RankState
from ..protocol.messages import Roster


class JobAdapter(Protocol):
    """What the driver needs from a job."""

    def roots(self) -> list[Any]:
        """Every object that holds process-group handles (model chunks, optimizer, scheduler,
        configs, ...): released on a failure, rebound to the new generation's groups."""

    def rank_state(self) -> RankState:
        """This rank's optimizer shard and small state (what a snapshot holds)."""

    def model(self) -> list[Any]:
        """The model chunks (DDP-wrapped): weights re-derived after a restore, digested."""

    def init_model_parallel(self) -> None:
        """Create Megatron's groups in the current default group (the call the job made at
        start-up, repeated in every generation)."""

    def salvage_target(self, iteration: int) -> tuple[str | None, dict[str, Any] | None]:
        """Out of redundancy: the save directory (None: none) and extra manifest fields."""

    # ------------------------------------------------------------------ start-up
    owns_start_up: bool = False
    """Whether the job's own start-up creates the default group, Megatron's groups and its
    objects (Megatron-LM's `pretrain`, through its hooks: `Driver.init_process_group`,
    `Driver.groups_made`, `Driver.bind` at its first step); the driver then exports the slot as
    torch's environment (RANK, WORLD_SIZE, LOCAL_RANK) first. False: the driver creates the
    groups (`init_model_parallel`), then asks for the objects (`build`) and binds them."""

    def slot_taken(self, roster: Roster) -> None:
        """This process holds a slot of `roster` (a newcomer: generation > 0), before any of
        its groups exists. With `owns_start_up` a newcomer's roster may be only planned (its
        restore iteration None): `Driver.agreed_slot` gives the agreed one."""
        return

    def build(self) -> None:
        """Build the job's objects in the groups the driver created (`owns_start_up` False)."""
        return

    def discard(self) -> None:
        """Drop the objects `build` made (a spare's rehearsal: `newcomer_build.rehearse`)."""
        return

    # ------------------------------------------------------------------ recovery
    def after_rejoin(self, roster: Roster) -> None:
        """A survivor joined a new generation and rebound its objects (before the restore)."""
        return

    def after_restore(self, iteration: int, *, newcomer: bool) -> None:
        """This rank holds the state of `iteration` again: reposition what the job keeps
        beside it (data, schedulers, counters); `newcomer`: what its start-up built, not what
        it trained."""
        return

    def recovery_report(self) -> dict[str, Any]:
        """Job fields survivors publish with their holdings (others read them back)."""
        return {}


@dataclass
class RecoveryRecord:
    """One recovery as this process saw it (`phases_s`: abort, agree - the release of the old
    groups included -, join, restore)."""

    generation: int
    dead: list[int]
    restore_iteration: int
    recomputed: int
    total_s: float
    phases_s: dict[str, float]
