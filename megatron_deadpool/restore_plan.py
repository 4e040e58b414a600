"""Pure planning of a recovery: the restore iteration T and where each lost shard comes from.

Inputs are what the surviving processes reported ("holdings": the verified iterations of
their own local snapshot and of every replica they hold). A rank whose process has no local
snapshot (a spare taking a dead rank's slot, or a newcomer that had not finished restoring)
is "needy": its shard must come from a holder. T is the newest iteration that every
non-needy rank has locally and that some live holder has for every needy rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .topology import Placement


@dataclass(frozen=True)
class RestorePlan:
    """The outcome of agreement: restore iteration and replica sources (needy -> holder)."""

    iteration: int | None
    sources: dict[int, int] = field(default_factory=dict)
    lost_ranks: list[int] = field(default_factory=list)
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.iteration is not None


def plan_restore(
    placement: Placement, holdings: dict[int, dict[str, list[int]]], needy: set[int]
) -> RestorePlan:
    """Choose T and sources; `holdings` maps each live, reporting rank to what it holds."""
    world = placement.layout.world_size
    candidates: set[int] | None = None
    for rank in range(world):
        if rank in needy:
            continue
        mine = set(holdings.get(rank, {}).get("local", []))
        candidates = mine if candidates is None else candidates & mine
    available: dict[int, dict[int, int]] = {}  # needy -> iteration -> first holder
    for rank in sorted(needy):
        options: dict[int, int] = {}
        for holder in placement.holders[rank]:
            if holder in needy:
                continue
            for it in holdings.get(holder, {}).get(str(rank), []):
                options.setdefault(it, holder)
        available[rank] = options
        candidates = set(options) if candidates is None else candidates & set(options)
    lost = [r for r, opts in available.items() if not opts]
    if lost:
        shards = ", ".join(
            f"rank {r} (holders {list(placement.holders[r])} dead or without a copy)" for r in lost
        )
        return RestorePlan(
            None, lost_ranks=lost, reason=f"no surviving copy of the shard of {shards}"
        )
    if not candidates:
        return RestorePlan(
            None,
            lost_ranks=sorted(needy),
            reason="no iteration is held by every rank that must restore (no committed snapshot "
            "yet, or copies from different iterations)",
        )
    t = max(candidates)
    return RestorePlan(t, sources={r: available[r][t] for r in sorted(needy)})
