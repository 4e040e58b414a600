"""What a worker process may read and write of the job's store (`worker/`, the adapters).

A worker announces itself and beats; waits as a spare for a roster; reports what it holds
after a failure, claims a newcomer's slot and waits for the coordinator's decision, the
sources of its state and the other newcomers; stamps its phases; exchanges the handles of
a repair in place; reports a failure it saw and an error of its own; and publishes what
training produced (metrics, the final replication, digests, preemption, salvage). Every
read everyone makes is `store_view.StoreView`'s; the keys are documented on `messages.Keys`.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from . import retention
from .messages import (
    AGENT_NODE_ENV,
    CLAIMED,
    REPAIR_ABANDONED,
    Announcement,
    CheckpointFailures,
    Decision,
    ErrorReport,
    FailureReport,
    FinalReplication,
    HoldingsReport,
    IterationRecord,
    Keys,
    Preempted,
    Registration,
    Sources,
)
from .sealed_store import FORGED_POLL_S
from .store_view import StoreView


class WorkerView(StoreView):
    """A worker's (an active's or a spare's) view of the job's store."""

    # ------------------------------------------------------------------ this member
    def announce(self) -> None:
        """This member connected: its host, OS pid and agent's node; then its first beat."""
        node = os.environ.get(AGENT_NODE_ENV, "")
        ready = Announcement(socket.gethostname(), os.getpid(), int(node) if node.isdigit() else -1)
        self.core.set(Keys.READY.format(member=self.core.member), ready.encode())
        self.heartbeat()

    def heartbeat(self) -> None:
        """One beat: this member's next beat number, sealed (no clock is sent; one round trip,
        which notices a lost coordinator)."""
        self.core.beat(Keys.HEARTBEAT.format(member=self.core.member))

    def mark_done(self) -> None:
        """This member finished its work."""
        self.restore_done(self.core.member)

    # ------------------------------------------------------------------ waiting as a spare
    def wait_spare_epoch(self, n: int, timeout_s: float) -> bool:
        """Block until wake-up `n` happened; False on timeout."""
        return self.core.wait(Keys.SPARE_EPOCH_N.format(n=n), timeout_s=timeout_s)

    def process_group_store(self, generation: int) -> dist.Store:
        """The store generation g's process groups rendezvous on (for a bounded or failover
        client, `connection.BoundedStore`: its current torch connection)."""
        prefix = Keys.PROCESS_GROUPS.format(g=generation)
        store: Any = getattr(self.store, "client", None) or self.store
        return dist.PrefixStore(prefix, store)

    # ------------------------------------------------------------------ recovery
    def planned(self, generation: int) -> bool:
        """Whether generation g is planned (one round trip)."""
        return self.core.present(Keys.PLAN.format(g=generation))

    def wait_plan(self, generation: int, timeout_s: float) -> bool:
        """Block until generation g is planned (True), or `timeout_s` passed."""
        return self.core.wait_read(Keys.PLAN.format(g=generation), timeout_s) is not None

    def wait_plan_wake(self, generation: int, timeout_s: float) -> bool:
        """Block until this member's wake-up of plan g appears (True), or `timeout_s` passed."""
        key = Keys.PLAN_WAKE.format(g=generation, member=self.core.member)
        return self.core.wait(key, timeout_s=timeout_s)

    def wake_plan_waiter(self, generation: int) -> None:
        """End this member's plan waiter blocked on plan g's wake-up (`wait_plan_wake`)."""
        self.core.set(Keys.PLAN_WAKE.format(g=generation, member=self.core.member), "1")

    def wait_decision(self, generation: int, timeout_s: float) -> Decision | None:
        """Block until plan g is decided; None on timeout."""
        key = Keys.DECIDED.format(g=generation)
        value = self.core.wait_read(key, timeout_s)
        return None if value is None else Decision.decode(key, value)

    def report_holdings(self, generation: int, rank: int, report: HoldingsReport) -> None:
        """Publish a survivor's report for generation g (planned or not yet); the last one the
        coordinator waits for wakes it. From its first report for g on, g counts as seen
        (`plan_seen`), whichever store the report reaches (a failover repeats it on a
        standby's): the survivor then waits for g's decision and newcomers and reports no more
        for g, so a standby that takes over plans above g and settles g (`rebuild`,
        `Coordinator.adopt`)."""
        self.plan_seen = max(self.plan_seen, generation)
        key = Keys.HOLDINGS.format(g=generation, rank=rank)
        if (
            self.core.set_counted(key, report.encode(), Keys.HOLDINGS_COUNT.format(g=generation))
            == 0
        ):
            self.notify_coordinator()

    def claim_slot(self, generation: int, rank: int) -> str:
        """A newcomer about to join generation g as `rank`: `CLAIMED`, unless the coordinator
        settled the slot first - `GIVEN_UP` (it took this process for lost: `give_up_slot`) or
        `MOVED_ON` (the generation will not be joined: `move_slot_on`)."""
        return self.core.claim(Keys.CLAIM.format(g=generation, rank=rank), CLAIMED).decode()

    def wait_newcomers(
        self, generation: int, ranks: Sequence[int], timeout_s: float
    ) -> bool | None:
        """Block until every newcomer of generation g (`ranks`) claimed its slot or was given
        up: True when all claimed, False when one was given up, None on timeout."""
        keys = [Keys.CLAIM.format(g=generation, rank=r) for r in ranks]
        if len(keys) == 1:
            value = self.core.wait_read(keys[0], timeout_s)
            return None if value is None else value == CLAIMED.encode()
        deadline = time.monotonic() + timeout_s
        while keys and self.core.wait(*keys, timeout_s=deadline - time.monotonic()):
            values = [self.core.open(k, v) for k, v in zip(keys, self.core.store.multi_get(keys))]
            if all(v is not None for v in values):
                return all(v == CLAIMED.encode() for v in values)
            if time.monotonic() >= deadline:
                return None
            time.sleep(FORGED_POLL_S)  # a rejected value: until the job's own replaces it
        return None if keys else True

    def sources(self, generation: int) -> Sources:
        """Needy rank -> holder, as the coordinator fixed them for `generation` (published
        before its roster: read it once the roster is known)."""
        key = Keys.SOURCES.format(g=generation)
        return Sources.decode(key, self.core.get(key))

    def stamp(self, generation: int, phase: str, rank: int) -> None:
        """`rank` reached `phase` of generation g now (its wall clock), and is counted."""
        self.core.stamp_counted(
            Keys.STAMP.format(g=generation, phase=phase, rank=rank),
            Keys.STAMP_COUNT.format(g=generation, phase=phase),
        )

    def publish_repair_handles(self, generation: int, rank: int, payload: str) -> bool:
        """`rank`'s reconfigure handles for the repair of generation g (`group_repair`); False
        when the coordinator marked them `REPAIR_ABANDONED` first (it took this rank for lost
        as it planned a later generation: the mark stays, one compare-and-set)."""
        key = Keys.REPAIR_HANDLES.format(g=generation, rank=rank)
        return self.core.claim(key, payload) != REPAIR_ABANDONED.encode()

    def repair_handles(self, g: int, ranks: Sequence[int], wait_s: float) -> list[bytes | None]:
        """The handles `ranks` published for generation g, waited for up to `wait_s` (then the
        store's error); None for a value that is not the job's."""
        keys = [Keys.REPAIR_HANDLES.format(g=g, rank=r) for r in ranks]
        self.core.store.wait(keys, datetime.timedelta(seconds=wait_s))
        return self.core.payloads(keys)

    def report_stale_refs(self, generation: int, rank: int, count: int) -> None:
        """`rank` found `count` old-generation handles left after rebinding into generation g:
        when any, its sealed count, then added to g's total (a hint the coordinator confirms
        with the sealed counts); nothing when none."""
        if count > 0:
            self.core.set(Keys.STALE_REF.format(g=generation, rank=rank), str(count))
            self.core.add(Keys.STALE_REFS.format(g=generation), count)

    # ------------------------------------------------------------------ failures and errors
    def report_failure(self, why: str) -> None:
        """This survivor saw a collective fail (a peer died or hung): counted, its report under
        its name and as the newest report (which confirms the count to the coordinator)."""
        number = self.core.add(Keys.FAILURES, 1)
        report = FailureReport(number=number, time=time.time(), why=why).encode()
        self.core.set(Keys.FAILURE.format(member=self.core.member), report)
        self.core.set(Keys.LATEST_FAILURE, report)

    def report_error(self, report: ErrorReport) -> None:
        """This process ends with `report`'s error: numbered by the store (`errors`), published
        under a number no report holds yet (`SealedStore.append`: a stranger's add to the
        counter cannot make it overwrite one, nor hide it), and the coordinator woken."""
        self.core.append(
            Keys.ERRORS,
            lambda n: Keys.ERROR.format(number=n),
            lambda n: replace(report, number=n).encode(),
        )
        self.notify_coordinator()

    # ------------------------------------------------------------------ injected faults
    def record_fault(self) -> None:
        """An injected fault strikes this member now."""
        self.core.stamp(Keys.FAULT.format(member=self.core.member))

    def record_node_lost(self) -> None:
        """A node fault takes this member's node whole, its agent included (local launchers)."""
        self.core.stamp(Keys.NODE_LOST.format(member=self.core.member))

    def fire_once(self, index: int, who: int | str) -> bool:
        """True the first time fault spec `index` fires for `who` in the whole job."""
        return self.core.add(Keys.FAULT_FIRED.format(index=index, who=who), 1) == 1

    def fault_generation(self, index: int, generation: int) -> int:
        """The generation in which node fault spec `index` first struck: `generation` unless an
        earlier one holds it (`Keys.FAULT_GENERATION`)."""
        return int(self.core.claim(Keys.FAULT_GENERATION.format(index=index), str(generation)))

    def fired(self, index: int, who: int | str) -> bool:
        """Whether fault spec `index` fired for `who` (a benchmark reads it at the end)."""
        return self.core.add(Keys.FAULT_FIRED.format(index=index, who=who), 0) > 0

    # ------------------------------------------------------------------ what training produced
    def publish_metrics(
        self, record: IterationRecord, retain: int | None = retention.RETAINED_ITERATIONS
    ) -> None:
        """Rank 0's record of an iteration; the record `retain` iterations back goes (None:
        every record stays, as before records were pruned - for comparing, `bench store-state`)."""
        key = Keys.METRICS.format(g=record.generation, iteration=record.iteration)
        self.core.set(key, record.encode())
        expired = None if retain is None else retention.expired_iteration(record.iteration, retain)
        if expired is not None:
            self.core.store.delete_key(Keys.METRICS.format(g=record.generation, iteration=expired))

    def publish_checkpoint_failure(self, iteration: int, line: str) -> None:
        """Rank 0: the checkpoint of `iteration` was not written (`line` says why)."""
        known = self.checkpoint_failures()
        lines = retention.retained_failures({**(known.lines if known else {}), iteration: line})
        self.core.set(Keys.CHECKPOINT_FAILURES, CheckpointFailures(lines).encode())

    def checkpoint_failures(self) -> CheckpointFailures | None:
        """The periodic checkpoints that could not be written, each one's line."""
        value = self.core.read(Keys.CHECKPOINT_FAILURES)
        key = Keys.CHECKPOINT_FAILURES
        return None if value is None else CheckpointFailures.decode(key, value)

    def publish_final_replication(self, committed: int | None) -> None:
        """Rank 0: the committed iteration at the end of training."""
        self.core.set(Keys.FINAL_REPLICATION, FinalReplication(committed).encode())

    def publish_digest(self, rank: int, digest: str) -> None:
        """`rank`'s final digest of parameters and buffers."""
        self.core.set(Keys.DIGEST.format(rank=rank), digest)

    def record_load_time(self, rank: int, seconds: float) -> None:
        """Seconds `rank` took to load a persistent checkpoint."""
        self.core.set(Keys.LOAD_TIME.format(rank=rank), repr(seconds))

    # ------------------------------------------------------------------ a standby takes over
    def register(self, record: Registration) -> None:
        """This member's re-registration with a standby coordinator that took over (under its
        own name, or `task{i}` before it knows it)."""
        self.core.set(Keys.REJOIN.format(member=self.core.member), record.encode())

    # ------------------------------------------------------------------ stopping and salvage
    def preempt_requested(self) -> bool:
        """Whether a launcher asked training to stop after this iteration."""
        return self.core.present(Keys.PREEMPT)

    def publish_preempted(self, iteration: int, saved: bool, unsaved: str = "") -> None:
        """Rank 0: training stopped on purpose at `iteration` (saved or not)."""
        self.core.set(Keys.PREEMPTED, Preempted(iteration, saved, unsaved).encode())

    def mark_salvaged(self, rank: int) -> None:
        """`rank` wrote its part of the out-of-redundancy snapshot set."""
        self.core.set(Keys.SALVAGED.format(rank=rank), "1")
