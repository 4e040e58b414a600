"""The coordinator's deletes of finished generations' keys (old wake-ups and dead members' keys
too), a batch per tick.

What may go and when is `retention.py`'s; this keeps the list of keys still to delete, so that no
tick of the coordinator makes more than `BATCH_KEYS` delete requests: at 16,384 ranks a
generation leaves some tens of thousands of keys (torch's rendezvous keys of its process groups
alone are one per rank and group).
"""

from __future__ import annotations

from ..protocol.coordinator_view import CoordinatorView
from ..protocol.numbered import WINDOW
from ..protocol.retention import member_keys, prunable_below, prunable_wake_ups, wake_up_keys
from ..protocol.sealed_store import BATCH_KEYS


class Pruner:
    """Generations whose keys are deleted once a later generation is complete."""

    def __init__(self, membership: CoordinatorView, first: int = 0) -> None:
        """`first`: the oldest generation whose keys may be in the store."""
        self.membership = membership
        self.first = first
        self.first_wake_up = 1
        self.backlog: list[str] = []
        self.dead: list[tuple[int, str]] = []  # (generation planned for its death, member)

    def died(self, generation: int, members: list[str]) -> None:
        """`members` died; the plan for `generation` (the next one) accounts for them."""
        self.dead += [(generation, m) for m in members]

    def completed(self, generation: int) -> None:
        """Generation `generation` is complete: the keys of the generations it makes prunable
        are listed (one request) and deleted over the next `step`s."""
        below = prunable_below(generation)
        if below > self.first:
            self.backlog += self.membership.generation_keys(self.first, below)
            self.first = below
        gone = [m for g, m in self.dead if g < below]
        if gone:
            self.dead = [(g, m) for g, m in self.dead if g >= below]
            self.backlog += [key for m in gone for key in member_keys(m)]
        wake_ups = prunable_wake_ups(self.membership.spare_epoch())
        # (a stranger's add moves the counter far ahead: only the newest few keys can exist)
        self.first_wake_up = max(self.first_wake_up, wake_ups - WINDOW)
        if wake_ups > self.first_wake_up:
            self.backlog += wake_up_keys(self.first_wake_up, wake_ups)
            self.first_wake_up = wake_ups

    def step(self) -> int:
        """Delete up to `BATCH_KEYS` of the keys listed; how many."""
        if not self.backlog:
            return 0
        batch = self.backlog[-BATCH_KEYS:]
        del self.backlog[-BATCH_KEYS:]
        self.membership.forget(batch)
        return len(batch)
