"""The communication steps of a recovery, in the order the driver (`driver.py`) takes them.

Around the coordinator's decisions (the pure planning of the restore iteration T and the
replica sources is `restore_plan.py`, run by the coordinator):

- `release_groups`: keep what already arrived of the in-flight replication round, then swap
  every process-group handle for a placeholder and destroy the broken groups.
- `agree`: report what this process holds under the newest plan's generation until a roster
  includes it; on the coordinator's abort (out of redundancy) save what survives and raise.
- `exchange_shards`: bring this rank to T - a needy rank receives its shard from the holder the
  plan names (verified by checksum on arrival), the others roll back to their local snapshot
  and serve the shards they hold for needy ranks.
- `salvage`: out of redundancy, write this survivor's part of the snapshot set of one common
  iteration (its own snapshot and those it holds for dead ranks; `snapshot_set.py` is the
  format)
  and, on one survivor, the set's manifest; returns the sentence saying what was saved.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DeadpoolRuntimeError, OutOfRedundancyError
from ..replication import snapshot_set
from ..replication.replicator import Replicator
from ..replication.snapshot import RankState, Snapshotter
from . import rebind
from .membership import Membership, Roster

log = logging.getLogger(__name__)

SALVAGE_WAIT_S = 30.0
"""How long the manifest writer waits for the other survivors' snapshot files."""


def release_groups(replicator: Replicator | None, roots: list[Any], extra: dict[str, Any]) -> int:
    """Salvage the in-flight round (`Replicator.abandon`), then `rebind.release` every group
    handle under `roots` and those in `extra` (the replication group, by name; the dict is
    emptied, so that no reference keeps a released group alive); returns how many handles
    were swapped."""
    if replicator is not None:
        salvaged = replicator.abandon()
        if salvaged:
            log.info("kept the in-flight round's verified replicas of ranks %s", salvaged)
    return rebind.release(roots, extra)


def agree(
    members: Membership,
    *,
    generation: int,
    rank: int | None,
    pid: str,
    replicator: Replicator | None,
    report: dict[str, Any],
    deadline: float,
    cause: BaseException,
    on_abort: Callable[[dict[str, Any]], str],
) -> Roster:
    """Report holdings for the coordinator's plan(s) until a roster includes this process.

    `report` is published with the holdings (e.g. Megatron's counters); only a process that
    keeps its slot and is not needy reports what `replicator` holds. On an abort,
    `on_abort(the coordinator's report)` saves what it can and says what; then
    `OutOfRedundancyError` is raised.
    """
    holds = replicator.holdings() if replicator is not None else {"local": []}
    reported: set[int] = set()
    while True:
        info = members.abort()
        if info is not None:
            saved = on_abort(info)
            lost = info.get("lost_ranks") or []
            raise OutOfRedundancyError(
                f"out of redundancy: {info.get('reason')}; "
                + (f"shards lost: ranks {lost}" if lost else "no shard lost")
                + f"; {saved}"
            )
        latest = members.latest_plan()
        if latest > generation:
            plan = members.plan(latest)
            if latest not in reported and "slots" in plan:
                mine = pid in plan["slots"].values() and rank not in plan["needy"]
                value = {
                    **report,
                    "holds": holds if mine else {"local": []},
                    "pid": pid,
                }
                members.report_holdings(latest, rank, value)
                reported.add(latest)
            if members.has_roster(latest):
                roster = members.roster(latest)
                if roster.rank_of(pid) is not None:
                    return roster
        elif time.time() > deadline:
            raise DeadpoolRuntimeError(
                "a collective failed but the coordinator planned no recovery in time: "
                "not a peer failure"
            ) from cause
        time.sleep(0.02)


def exchange_shards(
    members: Membership,
    roster: Roster,
    *,
    rank: int,
    state: RankState,
    replicator: Replicator | None,
    group: dist.ProcessGroup,
    needy: bool,
) -> bool:
    """Load the snapshot of `roster.restore_iteration` into `state`; True when it came from a
    holder. Holders send needy ranks their shard while this rank restores its own."""
    t_iter = roster.restore_iteration
    sources = members.sources(roster.generation)
    members.stamp(roster.generation, "joined", rank)
    if needy and rank not in sources:
        raise DeadpoolRuntimeError(f"rank {rank} must restore but the plan names no source")
    works = []
    if rank in sources:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src=sources[rank], group=group)
        flat = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(flat, src=sources[rank], group=group)
    else:
        if replicator is None:
            raise DeadpoolRuntimeError(f"rank {rank} has no snapshot of iteration {t_iter}")
        flat = replicator.verified_copy(rank, t_iter)
        for target, holder in sources.items():
            if holder == rank:
                buf = replicator.verified_copy(target, t_iter)
                works.append(dist.isend(torch.tensor([buf.numel()]), dst=target, group=group))
                works.append(dist.isend(buf, dst=target, group=group))
    Snapshotter.restore_into(state, flat, owner=rank, iteration=t_iter)
    for work in works:
        work.wait()
    return rank in sources


def salvage(
    members: Membership,
    replicator: Replicator | None,
    *,
    root: str | None,
    report: dict[str, Any],
    rank: int | None,
    world_size: int,
    extra: dict[str, Any] | None = None,
) -> str:
    """Write this survivor's part of the snapshot set the coordinator chose; say what.

    `report` is the coordinator's abort report (`save`: iteration, sources, complete; the dead
    and lost ranks). `extra` goes into the manifest (e.g. Megatron's sample counters at T).
    """
    save = report.get("save")
    if not root:
        return "nothing saved (no --save directory)"
    if not save or replicator is None or rank is None:
        return "no snapshot iteration common to the survivors: nothing saved"
    t = save["iteration"]
    own = replicator.verified_copy(rank, t)
    if own is not None:
        snapshot_set.write_flat(snapshot_set.rank_file(root, t, rank), own)
    for needy, holder in save["sources"].items():
        if holder == rank:
            flat = replicator.verified_copy(int(needy), t)
            snapshot_set.write_flat(snapshot_set.rank_file(root, t, int(needy)), flat)
    members.mark_salvaged(rank)
    if members.claim_manifest():  # one survivor writes the manifest
        survivors = [r for r in range(world_size) if r not in report.get("dead_ranks", [])]
        deadline = time.time() + SALVAGE_WAIT_S
        while time.time() < deadline and not members.all_salvaged(survivors):
            time.sleep(0.1)
        present = snapshot_set.ranks_present(root, t)
        snapshot_set.write_manifest(
            root,
            {
                "iteration": t,
                "complete": present == list(range(world_size)),
                "world_size": world_size,
                "ranks_present": present,
                "ranks_missing": sorted(set(range(world_size)) - set(present)),
                "reason": report.get("reason"),
                **(extra or {}),
            },
        )
    where = snapshot_set.set_dir(root, t)
    if save["complete"]:
        return (
            f"saved every rank's state of iteration {t} to {where}: run the same command with "
            "--load to resume"
        )
    missing = save.get("missing", [])
    return (
        f"saved the surviving snapshots of iteration {t} to {where}; the shards of ranks "
        f"{missing} are lost (incomplete: --load resumes from the last complete checkpoint)"
    )
