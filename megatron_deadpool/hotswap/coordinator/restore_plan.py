"""Pure planning of a recovery: the restore iteration T and where each lost shard comes from.

Inputs are what the surviving processes reported ("holdings": the verified iterations of
their own local snapshot and of every replica they hold). A rank whose process has no local
snapshot (a spare taking a dead rank's slot, or a newcomer that had not finished restoring)
is "needy": its shard must come from a holder - or, for a process respawned in place, from its
predecessor's snapshot in the node's segment files, which it reports. T is the newest iteration
that every non-needy rank has locally and that some live holder has for every needy rank.

When memory cannot recover (no spare left, or a shard without a surviving copy), the survivors
save what survives instead: `plan_salvage` picks the iteration and who writes which dead
rank's shard.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from ...replication.placement import Placement

Holdings = Mapping[int, Mapping[str, Sequence[int]]]
"""rank -> what it holds: "local" (its own snapshots) or an owner's rank -> verified
iterations (`messages.HoldingsReport.holds`)."""


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
    placement: Placement,
    holdings: Holdings,
    needy: set[int],
    respawned: Collection[int] = (),
) -> RestorePlan:
    """Choose T and sources; `holdings` maps each live, reporting rank to what it holds.

    `respawned`: needy ranks whose new process reported what its predecessor's segment files
    hold (`replication.segments`): its own snapshot of T restores it (no source), else a
    holder's; the replicas it reports count like a survivor's at the iterations it has its own
    snapshot of (where it restores from a holder, it sends nothing)."""
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
        if rank in respawned:
            options = dict.fromkeys(holdings.get(rank, {}).get("local", []), rank)
        for holder in placement.holders[rank]:
            if holder in needy and holder not in respawned:
                continue
            own = holdings.get(holder, {}).get("local", [])
            for it in holdings.get(holder, {}).get(str(rank), []):
                # A respawned holder sends only where it restores itself (`exchange_shards`:
                # a rank that receives its own shard sends nothing): at its own iterations.
                if holder not in needy or it in own:
                    options.setdefault(it, holder)
        available[rank] = options
        candidates = set(options) if candidates is None else candidates & set(options)
    lost = [r for r, opts in available.items() if not opts]
    if lost:
        order = placement.layout.order
        shards = ", ".join(
            f"rank {r} (holders {list(placement.holders[r])}, its data-parallel peers under "
            f"{order}, dead or without a copy)"
            for r in lost
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
    sources = {r: available[r][t] for r in sorted(needy)}
    return RestorePlan(t, sources={r: h for r, h in sources.items() if h != r})


@dataclass(frozen=True)
class SalvagePlan:
    """What survivors write before an out-of-redundancy exit: the snapshots of `iteration`,
    their own and, for each needy rank in `sources`, the copy its holder keeps."""

    iteration: int
    sources: dict[int, int]
    complete: bool  # every rank's shard of `iteration` will be on disk

    def missing(self, needy: set[int]) -> list[int]:
        """The needy ranks whose shard of `iteration` no survivor has."""
        return sorted(set(needy) - set(self.sources))


def plan_salvage(
    placement: Placement,
    holdings: Holdings,
    needy: set[int],
    restore: RestorePlan | None = None,
) -> SalvagePlan | None:
    """The snapshot set survivors save; None when they share no snapshot iteration.

    Its iteration: a recoverable plan's (`restore.ok`: every shard survives, only no spare is
    left), else the newest iteration every surviving rank has locally. Each needy rank's shard
    is written by a holder that is not needy itself and keeps a copy of that iteration: a
    respawned process never writes (it waits for its slot), so its own segment files - which
    the restore would have used - and what it holds for others do not count; a shard no
    survivor keeps is missing and the set is not complete.
    """
    if restore is not None and restore.iteration is not None:
        t = restore.iteration
    else:
        common: set[int] | None = None
        for rank, held in holdings.items():
            if rank not in needy:
                mine = set(held.get("local", []))
                common = mine if common is None else common & mine
        if not common:
            return None
        t = max(common)
    sources: dict[int, int] = {}
    for rank in sorted(needy):
        for holder in placement.holders[rank]:
            if holder not in needy and t in holdings.get(holder, {}).get(str(rank), []):
                sources[rank] = holder
                break
    return SalvagePlan(t, sources, complete=len(sources) == len(needy))
