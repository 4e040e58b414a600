"""One recovery of one process: the communication steps the driver (`driver.py`) takes through it.

The driver creates one `Recovery` per event - a survivor's peer failure, a newcomer taking its
slot, a failure after training completed, the loss of every coordinator - from what it holds as
the event starts, and calls its steps in order; each returns what happened, and the object
keeps what the next step needs (the roster agreed, whether this rank restores from a holder,
the phases' times). Around the coordinator's decisions (the pure planning of the restore
iteration T and the replica sources is `restore_plan.py`, run by the coordinator):

- `Recovery.abort`: abort every group, keep what already arrived of the in-flight replication
  round; the process-group handles (when groups are rebuilt, not repaired) are swapped for
  placeholders while the coordinator decides (`agree`).
- `Recovery.agree`: report what this process holds under the newest plan's generation until a
  roster includes it, blocked on the store (no polling); out of redundancy, salvage and raise.
- `Recovery.exchange_shards`: bring this rank to T - a needy rank receives its shard from the
  holder the plan names (verified by checksum on arrival), the others roll back to their local
  snapshot and serve the shards they hold for needy ranks.
- `Recovery.record`: the recovery as this process saw it (`RecoveryRecord`).
- `Recovery.salvage`: out of redundancy, write this survivor's part of the snapshot set of one
  common iteration (its own snapshot and those it holds for dead ranks; `snapshot_set.py` is
  the format) and the set's manifest as far as it knows it; returns the sentence saying what was
  saved. `Recovery.after_training`: the same for a peer lost after training completed.
  `Recovery.save_held`: the same without any coordinator, for every iteration held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ...devices.abort import abort_groups
from ...errors import DeadpoolRuntimeError, OutOfRedundancyError
from ...replication import snapshot_set
from ...replication.replicator import Replicator
from ...replication.segments import SegmentHoldings
from ...replication.shard_exchange import start_shard_exchange
from ...replication.snapshot import RankState, Snapshotter, load_snapshot
from ..protocol.messages import EndReport, HoldingsReport, OutOfRedundancy, Roster, Verdict
from ..protocol.worker_view import WorkerView
from . import rebind
from .adapter import RecoveryRecord
from .newcomer_claim import claim_slot

log = logging.getLogger(__name__)

T = TypeVar("T")

DECISION_WAIT_S = 600.0
"""Longest single wait for the coordinator's decision on a plan (it then waits again)."""

DECISION_LIMIT_S = 3 * DECISION_WAIT_S
"""Longest wait for one generation's decision, or its newcomers' claims, in all: a coordinator
(or a standby that took over) decides within its agreement timeout, so past this nothing will
(a stranger's counter, a coordinator that lost its store): the recovery ends with that error."""

SalvageTarget = Callable[[int], tuple[str | None, dict[str, Any] | None]]
"""iteration -> (the save directory, None: none; extra manifest fields): `JobAdapter`'s."""


def abort_keeping_arrivals(replicator: Replicator | None) -> list[list[dist.ProcessGroup]]:
    """Abort every group (`devices.abort_groups`: nothing after this can wait on a dead or hung
    peer) and keep the in-flight round's completed receives (`Replicator.abandon`); returns the
    groups torch knew, boxed for `rebind.release` to free (after the abort torch forgets
    them)."""
    held = rebind.hold_groups()
    abort_groups()
    if replicator is not None:
        kept = replicator.abandon()
        if kept:
            log.info("kept the in-flight round's verified replicas of ranks %s", kept)
    return held


@dataclass
class Recovery:
    """One recovery of one process, over what it holds as the recovery starts."""

    membership: WorkerView
    member: str
    rank: int | None
    """Its rank (None: a spare that holds none)."""
    roster: Roster
    """The roster it is in (before agreement), or joins (after)."""
    replicator: Replicator | SegmentHoldings | None
    """What it holds: its replicator's slots, or (a respawned process) its predecessor's
    segment files."""
    needy: bool = False
    """Set by `agree`: the roster agreed lists this process's rank as needy (a newcomer: it
    restores from a holder)."""
    started: float = field(default_factory=time.time)
    """When the recovery began (wall clock)."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """Each phase's seconds, as `mark` closes it."""
    released: int = 0
    """How many process-group handles the release swapped (`abort`)."""
    snapshotter: Snapshotter | None = None
    """What captures this process's state when it is not its replicator's: a newcomer's,
    built before the agreement (`Replicas.snapshotter_ahead`)."""
    kept: Snapshotter | None = None
    """Set by `exchange_shards`: the snapshotter that loaded the restore (this process's
    replicator's, or `snapshotter`), if one did: the next replicator keeps it."""
    _release: tuple[list[Any], dict[str, Any] | None, list[list[dist.ProcessGroup]]] | None = field(
        default=None, repr=False
    )
    _marked: float | None = field(default=None, repr=False)

    def abort(self, roots: list[Any], groups: dict[str, dist.ProcessGroup | None] | None) -> None:
        """Abort every group, keeping the in-flight round's arrivals (`abort_keeping_arrivals`).
        `groups`: DeadPool's own groups, by name, handed over (the caller keeps no other
        reference) when the generation's groups are rebuilt, not repaired: then every handle
        under `roots` and in `groups` is released (`rebind.release`) while the coordinator
        decides (`agree`), or at once by `release`."""
        replicator = self.replicator if isinstance(self.replicator, Replicator) else None
        # The boxed groups live as long as this recovery when nothing is released.
        self._release = (roots, groups, abort_keeping_arrivals(replicator))

    def release(self) -> None:
        """Release the handles `abort` was given (once; nothing when groups are repaired).
        `groups` is emptied so that reference counting frees them here (a group still
        referenced from a frame costs a full garbage collection, ~0.5-2 s on Megatron's heap,
        and is not freed even then)."""
        if self._release is not None and self._release[1] is not None:
            roots, groups, held = self._release
            self._release = None
            self.released = rebind.release(roots, groups, held)

    def inherit(self, take: Callable[[int, dict[int, int]], SegmentHoldings | None]) -> None:
        """The roster agreed (its sources published): what restores this process, respawned in
        place, is its predecessor's segment files (`take`: `Inheritance.take`) - unless the
        coordinator named a holder for it, or it holds none (then it is needy)."""
        own = take(self._rank(), self.membership.sources(self.roster.generation).holders)
        if own is not None:
            self.replicator = own
        self.needy = own is None

    def mark(self, phase: str) -> None:
        """`phase` ends now: its seconds since the previous mark (or the start)."""
        now = time.time()
        self.phases_s[phase] = now - (self.started if self._marked is None else self._marked)
        self._marked = now

    def record(self, target: int | None) -> RecoveryRecord:
        """The recovery as this process saw it, once restored; `target`: the step the job
        returns to (recomputing T+1..target-1)."""
        t_iter = self.roster.restore_iteration
        assert t_iter is not None
        plan = self.membership.plan(self.roster.generation)
        return RecoveryRecord(
            generation=self.roster.generation,
            dead=list(plan.dead) if plan else [],
            restore_iteration=t_iter,
            recomputed=max(0, (target or t_iter + 1) - 1 - t_iter),
            total_s=time.time() - self.started,
            phases_s=dict(self.phases_s),
        )

    def agree(
        self,
        job_report: dict[str, Any],
        *,
        last_completed: int,
        deadline: float,
        cause: BaseException,
        salvage_target: SalvageTarget,
        meanwhile: Callable[[], object] = lambda: None,
        before_newcomers: Callable[[Roster, int, frozenset[int]], object] | None = None,
    ) -> Roster:
        """Report holdings for the coordinator's plan(s) until a roster includes this process;
        the roster agreed becomes this recovery's (`roster`, `rank`). After the first report,
        while the coordinator decides, the old groups' handles are released (`release`: it need
        not delay the report), and `meanwhile()` runs once.

        Reports at once, for the generation after the roster's (the one this process is in),
        without waiting for the coordinator's plan: at thousands of ranks every request a
        survivor makes before the coordinator can decide delays the decision, and the plan
        would cost two (a wait, a read). Then blocks on the store until the coordinator decides
        - a roster, out of redundancy, or a newer plan that supersedes it (more ranks died),
        which is then reported for in turn - and reads the plan decided. No plan of that
        generation by the wall-clock `deadline`: this was no peer failure. The new roster is
        the old one with the plan's replacements (read in full only if the plan has another
        base). It is returned once every newcomer claimed its slot: a newcomer that died before
        that (its slot given up by the coordinator) leads to the next plan instead of a
        rendezvous that would wait for it until the process groups' timeout. A process the
        plan counts as a newcomer claims its slot too (`needy`).

        `before_newcomers(roster, rank, newcomers)`: what a survivor that keeps its slot (`rank`
        of the roster) does once a roster is agreed, before it waits for the newcomers' claims
        (the repair of the groups none of them is in, `InPlace.repair_ahead`).

        `job_report` is published with the holdings (e.g. Megatron's counters): what the
        replicator holds, or nothing for a process without a slot (the coordinator reads only
        the reports of the ranks that keep theirs). Out of redundancy, this survivor's part of
        the snapshot set is saved (`salvage`, where `salvage_target` says) and
        `OutOfRedundancyError` says what was saved.
        """
        holds = self.replicator.holdings() if self.replicator is not None else {"local": []}
        report = HoldingsReport(
            member=self.member,
            last_completed=last_completed,
            holds={k: tuple(v) for k, v in holds.items()} if self.rank is not None else {},
            job=job_report,
        )
        m = self.membership
        g = self.roster.generation + 1
        first = True
        while True:
            if self.rank is not None:
                m.report_holdings(g, self.rank, report)
            self.release()
            meanwhile()
            meanwhile = lambda: None  # once
            decision = None
            if first:  # planned by the deadline, or it was no peer failure
                decision = m.wait_decision(g, max(0.0, deadline - time.time()))
                if decision is None and not m.planned(g):
                    raise DeadpoolRuntimeError(
                        "a collective failed but the coordinator planned no recovery in time: "
                        "not a peer failure"
                    ) from cause
                first = False
            decision = decision or _waited(
                partial(m.wait_decision, g, DECISION_WAIT_S), f"decided generation {g}"
            )
            if decision.verdict is Verdict.OUT_OF_REDUNDANCY:
                self._out_of_redundancy(salvage_target)
            plan = None
            if decision.verdict is Verdict.ROSTER and (plan := m.plan(g)) is None:
                # Published before the decision: the coordinator that decided was lost since,
                # and this read went to the standby that took over. Where no process it rebuilt
                # the job from held g's roster, it superseded g before anyone could fail over
                # to it (`Coordinator.adopt`): its verdict replaces the one read.
                decision = m.wait_decision(g, 0.0)
                if decision is None or decision.verdict is not Verdict.SUPERSEDED:
                    raise DeadpoolRuntimeError(f"generation {g} was decided without a plan")
            if decision.verdict is Verdict.SUPERSEDED:
                assert decision.superseded_by is not None
                g = decision.superseded_by
                continue
            assert decision.restore_iteration is not None and plan is not None
            new = self.roster.successor(plan, decision.restore_iteration) or m.roster(g)
            rank = new.rank_of(self.member)
            if rank is None:
                raise DeadpoolRuntimeError(
                    f"the coordinator's roster of generation {g} leaves this process "
                    f"({self.member}) out: it was presumed dead"
                )
            self.needy = rank in plan.needy
            # Needy although it survived: it restored as the previous generation's newcomer
            # after the coordinator planned g (`decide.decide_deaths` counts the restores it saw);
            # it claims its slot as a newcomer would, and restores from a holder.
            if self.needy:
                if not claim_slot(m, g, rank):
                    g += 1  # the coordinator planned again before this claim
                    continue
                log.info(
                    "generation %d restores rank %d from a holder (planned as a newcomer)", g, rank
                )
            elif before_newcomers is not None:
                before_newcomers(new, rank, frozenset(plan.needy))
            ready = _waited(  # a newcomer claims its slot, or is given up when it dies
                partial(m.wait_newcomers, g, plan.needy, DECISION_WAIT_S),
                f"settled the newcomers' slots of generation {g}",
            )
            if ready:
                self.roster, self.rank = new, rank
                return new
            log.warning("generation %d will not be joined (a newcomer was lost first)", g)
            g += 1  # the coordinator settled the unclaimed slots as it planned the next one

    def _out_of_redundancy(self, salvage_target: SalvageTarget) -> None:
        report = self.membership.out_of_redundancy()
        if report is None:
            raise DeadpoolRuntimeError("out of redundancy decided without its report")
        saved = self.salvage(report, salvage_target)
        lost = list(report.lost_ranks)
        raise OutOfRedundancyError(
            f"out of redundancy: {report.reason}; "
            + (f"shards lost: ranks {lost}" if lost else "no shard lost")
            + f"; {saved}"
        )

    def exchange_shards(
        self,
        state: RankState,
        group: dist.ProcessGroup | None,
        *,
        needy: bool,
        host_group: dist.ProcessGroup | None = None,
    ) -> bool:
        """Load the snapshot of the roster's restore iteration into `state`; True when it came
        from a holder. Holders send needy ranks their shard while this rank restores its own.
        `host_group`: where shards in host memory travel, when not on `group` (CUDA)."""
        rank, roster = self._rank(), self.roster
        t_iter = roster.restore_iteration
        if t_iter is None:
            raise DeadpoolRuntimeError(f"roster {roster.generation} names no restore iteration")
        sources = self.membership.sources(roster.generation).holders
        self.membership.stamp(roster.generation, "joined", rank)
        if needy and rank not in sources:
            raise DeadpoolRuntimeError(f"rank {rank} must restore but the plan names no source")
        sends: dict[int, torch.Tensor] = {}
        flat = None
        if rank not in sources:
            if self.replicator is None:
                raise DeadpoolRuntimeError(f"rank {rank} has no snapshot of iteration {t_iter}")
            flat = self.replicator.verified_copy(rank, t_iter)
            for target, holder in sources.items():
                if holder == rank:
                    copy = self.replicator.verified_copy(target, t_iter)
                    if copy is None:
                        raise DeadpoolRuntimeError(
                            f"rank {rank} holds no verified copy of rank {target}'s shard of "
                            f"iteration {t_iter}"
                        )
                    sends[target] = copy
        if group is None:
            raise DeadpoolRuntimeError("no replication group to exchange shards over")
        device = state.state_tensors()[0].device
        pending = start_shard_exchange(
            group,
            rank=rank,
            world_size=roster.world_size,
            sends=sends,
            source=sources.get(rank),
            gpu=device if device.type == "cuda" else None,
            host_group=host_group,
        )
        if rank in sources:
            flat = pending.wait()
        if flat is None:
            raise DeadpoolRuntimeError(f"rank {rank} has no verified snapshot of {t_iter}")
        snap = self.snapshotter
        if snap is None and isinstance(self.replicator, Replicator):
            snap = self.replicator.snap
        self.kept = load_snapshot(snap, state, flat, owner=rank, iteration=t_iter)
        pending.wait()
        return rank in sources

    def after_training(
        self, completed: int | None, where: str, deadline: float, salvage_target: SalvageTarget
    ) -> str:
        """A collective failed in `where` after training completed at `completed` (the groups
        aborted and released: `abort`, `release`): learn from the coordinator who died (until
        the wall-clock `deadline`), save this rank's final state and the dead ranks' copies it
        holds (`salvage`); the sentence saying what was saved."""
        m = self.membership
        report = m.end()
        while report is None and time.time() < deadline:
            time.sleep(0.05)
            report = m.end()
        if report is None:
            return (
                f"training completed at iteration {completed}; a collective failed in "
                f"{where} but the coordinator named no lost process: nothing saved"
            )
        saved = self.salvage(report, salvage_target)
        return (
            f"training completed at iteration {completed}; rank(s) "
            f"{list(report.dead_ranks)} lost afterwards, in {where}: {saved}"
        )

    def salvage(self, report: OutOfRedundancy | EndReport, salvage_target: SalvageTarget) -> str:
        """Write this survivor's part of the snapshot set the report's save order names (its
        own snapshot and the dead ranks' copies it holds), then the manifest from what is on disk,
        with the job's fields (e.g. Megatron's sample counters at T); say what was saved."""
        order = report.save
        if order is None or self.replicator is None or self.rank is None:
            if salvage_target(-1)[0] is None:
                return "nothing saved (no --save directory)"
            return "no snapshot iteration common to the survivors: nothing saved"
        t, rank = order.iteration, self.rank
        root, extra = salvage_target(t)
        if not root:
            return "nothing saved (no --save directory)"
        owners = [rank] + [needy for needy, holder in order.sources.items() if holder == rank]
        written, error = self._write_parts(root, t, owners)
        self.membership.mark_salvaged(rank)  # also when it failed: what it tried is known
        # Every survivor writes the manifest from the rank files on disk, and writes it again
        # until it shows what is there (`publish_manifest`): the one that stays was written
        # after every survivor's files, so no single writer - one that dies, or a claim a
        # stranger's counter takes - can leave a saved set without its manifest.
        try:
            snapshot_set.publish_manifest(
                root, t, self.roster.world_size, {"reason": report.reason, **(extra or {})}
            )
        except OSError as exc:
            error = error or _failed(snapshot_set.set_dir(root, t) / "manifest.json", exc)
        where = snapshot_set.set_dir(root, t)
        if error:
            return _partly_saved(where, written, [o for o in owners if o not in written], error)
        if order.complete:
            return (
                f"saved every rank's state of iteration {t} to {where}: run the same command with "
                "--load to resume"
            )
        return (
            f"saved the surviving snapshots of iteration {t} to {where}; the shards of ranks "
            f"{list(order.missing)} are lost (incomplete: --load resumes from the last complete "
            "checkpoint)"
        )

    def save_held(self, salvage_target: SalvageTarget) -> str:
        """Without any coordinator (the primary's and the standby's nodes both lost), write
        every verified snapshot this rank holds - its own and the replicas it holds, of each
        iteration it has - as its parts of those iterations' snapshot sets; say what was saved.

        Nobody picks an iteration or a writer: survivors that hold the same copy both write it
        (the same bytes), and each set's manifest is rewritten until it shows what is on disk
        (`snapshot_set.publish_manifest`), so an iteration whose every shard survived somewhere
        becomes a complete set that `--load` resumes from.
        """
        if self.replicator is None or self.rank is None:
            return "nothing saved: this process held no training state yet"
        owners: dict[int, list[int]] = {}
        for key, iterations in self.replicator.holdings().items():
            for t in iterations:
                owners.setdefault(t, []).append(self.rank if key == "local" else int(key))
        if not owners:
            return "nothing saved: no verified snapshot held"
        lines, root = [], None
        for t in sorted(owners):
            root, extra = salvage_target(t)
            if not root:
                return "nothing saved (no --save directory)"
            written, error = self._write_parts(root, t, owners[t])
            reason = "no coordinator left: every survivor saved what it held"
            try:
                manifest = snapshot_set.publish_manifest(
                    root, t, self.roster.world_size, {"reason": reason, **(extra or {})}
                )
            except OSError as exc:
                error = error or _failed(snapshot_set.set_dir(root, t) / "manifest.json", exc)
            if error:
                unsaved = [o for o in owners[t] if o not in written]
                lines.append(_partly_saved(snapshot_set.set_dir(root, t), written, unsaved, error))
                continue
            state = "complete" if manifest["complete"] else f"missing {manifest['ranks_missing']}"
            lines.append(f"iteration {t}: ranks {sorted(owners[t])} ({state} so far)")
        assert root is not None
        return (
            f"saved what this rank held to {snapshot_set.set_dir(root, max(owners)).parent}: "
            f"{'; '.join(lines)}. --load resumes from the newest complete set"
        )

    def _write_parts(self, root: str, t: int, owners: list[int]) -> tuple[list[int], str | None]:
        """Write the verified snapshots of iteration `t` this rank holds of `owners` (its own
        included) into the set under `root`: (the owners written, why the others were not -
        None when nothing failed). The first write that fails (a full disk, a read-only
        folder) ends it: it leaves no temporary file (`durable.write_durably`)."""
        assert self.replicator is not None
        written: list[int] = []
        for owner in owners:
            flat = self.replicator.verified_copy(owner, t)
            if flat is None:
                continue
            path = snapshot_set.rank_file(root, t, owner)
            try:
                snapshot_set.write_flat(path, flat)
            except OSError as exc:
                return written, _failed(path, exc)
            written.append(owner)
        return written, None

    def _rank(self) -> int:
        if self.rank is None:
            raise DeadpoolRuntimeError(f"{self.member} holds no rank")
        return self.rank


def _waited(wait: Callable[[], T | None], what: str) -> T:
    """`wait()` again while it answers None (each wait bounded), for `DECISION_LIMIT_S` in
    all; then `DeadpoolRuntimeError` saying the coordinator never `what`."""
    deadline = time.monotonic() + DECISION_LIMIT_S
    while True:
        value = wait()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise DeadpoolRuntimeError(
                f"the coordinator never {what} in {DECISION_LIMIT_S:.0f} s: the recovery ends"
            )


def _failed(path: Path, exc: OSError) -> str:
    """A write that failed, in a few words: the file and the system's reason."""
    return f"writing {path.name} failed: {exc.strerror or exc}"


def _partly_saved(where: Path, written: list[int], unsaved: list[int], error: str) -> str:
    """The sentence for a snapshot set this rank could not write in full."""
    saved = f"saved ranks {written}" if written else "saved nothing"
    lost = f", not ranks {unsaved}" if unsaved else ""
    return (
        f"could not save to {where} ({error}): this rank {saved}{lost}; the set is "
        "incomplete (--load resumes from the newest complete checkpoint before it)"
    )
