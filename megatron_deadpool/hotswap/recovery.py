"""The communication steps of a recovery, in the order the driver (`driver.py`) takes them.

Around the coordinator's decisions (the pure planning of the restore iteration T and the
replica sources is `restore_plan.py`, run by the coordinator):

- `release_groups`: abort every group, keep what already arrived of the in-flight replication
  round, then swap every process-group handle for a placeholder.
- `agree`: report what this process holds under the newest plan's generation until a roster
  includes it, blocked on the store (no polling); on the coordinator's abort (out of
  redundancy) save what survives and raise.
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

from ..devices.abort import abort_groups
from ..errors import DeadpoolRuntimeError, OutOfRedundancyError
from ..replication import snapshot_set
from ..replication.replicator import Replicator
from ..replication.shard_exchange import start_shard_exchange
from ..replication.snapshot import RankState, Snapshotter
from . import rebind
from .adapter import JobAdapter
from .membership import Membership
from .roster import Roster

log = logging.getLogger(__name__)

SALVAGE_WAIT_S = 30.0
"""How long the manifest writer waits for the other survivors' snapshot files."""

DECISION_WAIT_S = 600.0
"""Longest single wait for the coordinator's decision on a plan (it then waits again)."""


def abort_and_salvage(replicator: Replicator | None) -> list[list[dist.ProcessGroup]]:
    """Abort every group (`devices.abort_groups`: nothing after this can wait on a dead or hung
    peer) and salvage the in-flight round's completed receives (`Replicator.abandon`); returns
    the groups torch knew, boxed for `rebind.release` to free (after the abort torch forgets
    them)."""
    held = rebind.hold_groups()
    abort_groups()
    if replicator is not None:
        salvaged = replicator.abandon()
        if salvaged:
            log.info("kept the in-flight round's verified replicas of ranks %s", salvaged)
    return held


def release_groups(
    replicator: Replicator | None, roots: list[Any], extra: dict[str, dist.ProcessGroup | None]
) -> int:
    """`abort_and_salvage`, then `rebind.release` every group handle under `roots` and the
    groups in `extra` (by name, e.g. the replication group); returns how many handles were
    swapped.

    `extra` is emptied: the caller hands its groups over in it and keeps no other reference,
    so that reference counting frees them here (a group still referenced from a frame costs a
    full garbage collection, ~0.5-2 s on Megatron's heap, and is not freed even then).
    """
    return rebind.release(roots, extra, abort_and_salvage(replicator))


def agree(
    members: Membership,
    *,
    roster: Roster,
    rank: int | None,
    pid: str,
    replicator: Replicator | None,
    report: dict[str, Any],
    deadline: float,
    cause: BaseException,
    on_abort: Callable[[dict[str, Any]], str],
    meanwhile: Callable[[], object] = lambda: None,
) -> Roster:
    """Report holdings for the coordinator's plan(s) until a roster includes this process.
    `meanwhile()` runs once, after the first report, while the coordinator decides (the
    release of the old groups: it need not delay the report).

    Reports at once, for the generation after `roster`'s (the one this process is in), without
    waiting for the coordinator's plan: at thousands of ranks every request a survivor makes
    before the coordinator can decide delays the decision, and the plan would cost two (a wait,
    a read). Then blocks on the store until the coordinator decides - a roster, an abort, or a
    newer plan that supersedes it (more ranks died), which is then reported for in turn - and
    reads the plan decided. No plan of that generation by the wall-clock `deadline`: this was
    no peer failure. The new roster is `roster` with the plan's replacements (read in full
    only if the plan has another base). It is returned once every newcomer claimed its slot:
    a newcomer that died before that (its slot given up by the coordinator) leads to the next
    plan instead of a rendezvous that would wait for it until the process groups' timeout.

    `report` is published with the holdings (e.g. Megatron's counters): what `replicator`
    holds, or nothing for a process without a slot (the coordinator reads only the reports of
    the ranks that keep theirs). On an abort, `on_abort(the coordinator's report)` saves what
    it can and says what; then `OutOfRedundancyError` is raised.
    """
    holds = replicator.holdings() if replicator is not None else {"local": []}
    g = roster.generation + 1
    first = True
    while True:
        members.report_holdings(
            g, rank, {**report, "holds": holds if rank is not None else {"local": []}, "pid": pid}
        )
        meanwhile()
        meanwhile = lambda: None
        decision = None
        if first:  # planned by the deadline, or it was no peer failure
            decision = members.wait_decision(g, max(0.0, deadline - time.time()))
            if decision is None and not members.planned(g):
                raise DeadpoolRuntimeError(
                    "a collective failed but the coordinator planned no recovery in time: "
                    "not a peer failure"
                ) from cause
            first = False
        while decision is None:  # the coordinator decides within its agree timeout
            decision = members.wait_decision(g, DECISION_WAIT_S)
        if "abort" in decision:
            _out_of_redundancy(members.abort() or {}, on_abort)
        if "roster" in decision:
            plan = members.plan(g)  # published before the decision
            new = roster.successor(plan, decision["roster"]) or members.roster(g)
            if new.rank_of(pid) is None:
                raise DeadpoolRuntimeError(
                    f"the coordinator's roster of generation {g} leaves this process ({pid}) "
                    "out: it was presumed dead"
                )
            ready = None
            while ready is None:  # a newcomer claims its slot, or is given up when it dies
                ready = members.wait_newcomers(g, plan["needy"], DECISION_WAIT_S)
            if ready:
                return new
            log.warning("a newcomer of generation %d was lost before joining", g)
            g += 1  # the coordinator gave its slot up as it planned the next generation
        else:
            g = decision["superseded"]


def _out_of_redundancy(info: dict[str, Any], on_abort: Callable[[dict[str, Any]], str]) -> None:
    saved = on_abort(info)
    lost = info.get("lost_ranks") or []
    raise OutOfRedundancyError(
        f"out of redundancy: {info.get('reason')}; "
        + (f"shards lost: ranks {lost}" if lost else "no shard lost")
        + f"; {saved}"
    )


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
    sends: dict[int, torch.Tensor] = {}
    if rank not in sources:
        if replicator is None:
            raise DeadpoolRuntimeError(f"rank {rank} has no snapshot of iteration {t_iter}")
        flat = replicator.verified_copy(rank, t_iter)
        sends = {
            target: replicator.verified_copy(target, t_iter)
            for target, holder in sources.items()
            if holder == rank
        }
    device = state.state_tensors()[0].device
    pending = start_shard_exchange(
        group,
        rank=rank,
        world_size=roster.world_size,
        sends=sends,
        source=sources.get(rank),
        gpu=device if device.type == "cuda" else None,
    )
    if rank in sources:
        flat = pending.wait()
    Snapshotter.restore_into(state, flat, owner=rank, iteration=t_iter)
    pending.wait()
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
        snapshot_set.publish_manifest(
            root, t, world_size, {"reason": report.get("reason"), **(extra or {})}
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


def save_held(
    replicator: Replicator | None,
    rank: int | None,
    roster: Roster | None,
    job: JobAdapter | None,
) -> str:
    """Without any coordinator (the primary's and the standby's nodes both lost), write every
    verified snapshot this rank holds - its own and the replicas it holds, of each iteration it
    has - as its parts of those iterations' snapshot sets; say what was saved.

    Nobody picks an iteration or a writer: survivors that hold the same copy both write it (the
    same bytes), and each set's manifest is rewritten until it shows what is on disk
    (`snapshot_set.publish_manifest`), so an iteration whose every shard survived somewhere
    becomes a complete set that `--load` resumes from. The save directory and the job's
    manifest fields come from `job.salvage_target(iteration)`.
    """
    if replicator is None or rank is None or roster is None or job is None:
        return "nothing saved: this process held no training state yet"
    owners: dict[int, list[int]] = {}
    for key, iterations in replicator.holdings().items():
        for t in iterations:
            owners.setdefault(t, []).append(rank if key == "local" else int(key))
    if not owners:
        return "nothing saved: no verified snapshot held"
    lines = []
    for t in sorted(owners):
        root, extra = job.salvage_target(t)
        if not root:
            return "nothing saved (no --save directory)"
        for owner in owners[t]:
            flat = replicator.verified_copy(owner, t)
            if flat is not None:
                snapshot_set.write_flat(snapshot_set.rank_file(root, t, owner), flat)
        reason = "no coordinator left: every survivor saved what it held"
        manifest = snapshot_set.publish_manifest(
            root, t, roster.world_size, {"reason": reason, **(extra or {})}
        )
        state = "complete" if manifest["complete"] else f"missing {manifest['ranks_missing']}"
        lines.append(f"iteration {t}: ranks {sorted(owners[t])} ({state} so far)")
    return (
        f"saved what this rank held to {snapshot_set.set_dir(root, max(owners)).parent}: "
        f"{'; '.join(lines)}. --load resumes from the newest complete set"
    )
