"""What the coordinator may read and write of the job's store (`coordinator/`).

The coordinator serves the store (its token, its identity, its inbox); watches heartbeats,
failure and error reports and who finished; publishes rosters, plans, decisions, sources and
verdicts; settles newcomers' slots; reads the phases' stamps; deletes what retention
lets go (`pruning`); reads a standby's re-registrations; and gives the nodes' agents their
orders. Every read everyone makes is `store_view.StoreView`'s; the keys are documented on
`messages.Keys`.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import retention
from .codec import ProtocolError, read_float, read_int, read_text
from .messages import (
    CLAIMED,
    GIVEN_UP,
    MOVED_ON,
    REPAIR_ABANDONED,
    CoordinatorIdentity,
    Decision,
    EndReport,
    ErrorReport,
    FailureReport,
    HoldingsReport,
    JobError,
    JobStatus,
    Keys,
    OutOfRedundancy,
    Plan,
    ProcessExit,
    Registration,
    RespawnHistory,
    RespawnOrder,
    Roster,
    Sources,
    decode_holdings,
    holds_sealed,
)
from .sealed_store import BATCH_KEYS
from .store_protocol import ServingStore
from .store_view import SERVES_JOB, StoreView


class CoordinatorView(StoreView):
    """The coordinator's (primary or standby) view of the job's store."""

    # ------------------------------------------------------------------ serving the store
    def next_message(self) -> None:
        """Block until a member notifies the coordinator (up to the store's timeout)."""
        self.core.serving().queue_pop(Keys.INBOX)

    def serving(self) -> ServingStore:
        """This store as the coordinator serves it (not a member's client of it)."""
        if not isinstance(self.store, ServingStore):
            raise TypeError(f"{type(self.store).__name__} is a client, not the serving store")
        return self.store

    def set_token(self) -> None:
        """This store serves the job now (`job/token`: the job's seal, not its secret)."""
        self.core.set(Keys.TOKEN, SERVES_JOB)

    def set_identity(self, identity: CoordinatorIdentity) -> None:
        """Say which coordinator serves this store (before `set_token`)."""
        self.core.set(Keys.COORDINATOR, identity.encode())

    def withdraw(self, members: list[str]) -> None:
        """A standby that did not take over after all: the store serves no job again, and the
        re-registrations of `members` it got are forgotten."""
        rejoins = (Keys.REJOIN.format(member=m) for m in members)
        for key in [Keys.TOKEN, Keys.COORDINATOR, *rejoins]:
            self.core.serving().delete_key(key)

    # ------------------------------------------------------------------ members
    def watch_heartbeats(self, members: Sequence[str]) -> None:
        """Create the beat keys of `members` with beat 0 where missing (an existing beat is
        kept), so that `heartbeat_counts` never waits for a key."""
        for member in members:
            self.core.start_beats(Keys.HEARTBEAT.format(member=member))

    def heartbeat_counts(self, members: Sequence[str]) -> list[int]:
        """The newest beat number of each of `members` (watched first), in batched requests: a
        value that is not the job's, or a beat number below one seen before, is no beat (and
        is reported once, `SealedStore.beat_number`)."""
        return self.core.beat_numbers([Keys.HEARTBEAT.format(member=m) for m in members])

    def is_done(self, member: str) -> bool:
        """Whether `member` finished its work."""
        return self.core.present(Keys.DONE.format(member=member))

    def done_count(self) -> int:
        """How many members finished their work (one store round trip)."""
        return self.core.count(Keys.DONE_COUNT)

    def all_done(self, members: list[str]) -> bool:
        """Whether every one of `members` finished its work (batched requests)."""
        return self.core.all_present([Keys.DONE.format(member=m) for m in members])

    # ------------------------------------------------------ rosters, plans and decisions
    def publish_roster(self, roster: Roster) -> None:
        """Generation g's roster, then the newest generation; waiting spares woken."""
        self.core.set(Keys.ROSTER.format(g=roster.generation), roster.encode())
        self.core.set(Keys.GENERATION, str(roster.generation))
        self.wake_spares()

    def publish_plan(self, plan: Plan) -> None:
        """Generation g's plan, then the latest planned generation."""
        self.core.set(Keys.PLAN.format(g=plan.generation), plan.encode())
        self.core.set(Keys.LATEST_PLAN, str(plan.generation))

    def abandon_repair_handles(self, generation: int, ranks: Sequence[int]) -> None:
        """Generation g superseded: each of `ranks` (lost) that has not published its handles
        for g's repair in place gets `REPAIR_ABANDONED` there, so that its peers stop waiting for
        them (one compare-and-set per rank: handles published first stay, and a rank that
        publishes after it finds the mark, `WorkerView.publish_repair_handles`)."""
        for rank in ranks:
            self.core.claim(Keys.REPAIR_HANDLES.format(g=generation, rank=rank), REPAIR_ABANDONED)

    def decide(self, generation: int, decision: Decision) -> None:
        """The coordinator's decision on plan g."""
        self.core.set(Keys.DECIDED.format(g=generation), decision.encode())

    def publish_out_of_redundancy(self, report: OutOfRedundancy, generations: list[int]) -> None:
        """Memory cannot recover: the report, the decision on each of `generations` (survivors
        waiting on their plans see it), and the newest of them as the latest plan (survivors
        blocked in a collective are released by their plan watch)."""
        self.core.set(Keys.OUT_OF_REDUNDANCY, report.encode())
        for g in generations:
            self.decide(g, Decision.out_of_redundancy())
        self.core.set(Keys.LATEST_PLAN, str(max(generations)))

    def wake_plan_waiters(self, generations: Sequence[int], members: Sequence[str]) -> None:
        """The plan waiters of `members` woken: their wake-up keys of `generations`
        (`Keys.PLAN_WAKE`), in batched requests."""
        keys = [Keys.PLAN_WAKE.format(g=g, member=m) for g in generations for m in members]
        self.core.set_many(keys, "1")

    def expect_reports(self, generation: int, count: int) -> None:
        """The coordinator planned g and waits for `count` reports (some may be in already:
        `reports_missing` counts down from here)."""
        self.core.add(Keys.HOLDINGS_COUNT.format(g=generation), -count)

    def reports_missing(self, generation: int) -> int:
        """How many of the reports `expect_reports` waits for have not arrived (one round
        trip)."""
        return -self.core.count(Keys.HOLDINGS_COUNT.format(g=generation))

    def reject_holdings_count(self, generation: int, count: int) -> None:
        """Report generation g's report counter holding `count`, out of its range: a stranger's
        `add` (once per value, as a rejected value is; the reports themselves decide)."""
        key = Keys.HOLDINGS_COUNT.format(g=generation)
        self.core.reject(key, str(count).encode(), f"store key {key}: rejected count {count}")

    def holdings_count(self, generation: int) -> int:
        """The report counter of generation g: how many reports arrived, until the coordinator
        planned g (`expect_reports`)."""
        return self.core.count(Keys.HOLDINGS_COUNT.format(g=generation))

    def all_holdings(
        self, generation: int, ranks: Sequence[int]
    ) -> dict[int, HoldingsReport] | None:
        """Every report of `ranks` for plan g, in batched requests; None while one is missing
        (or rejected)."""
        keys = [Keys.HOLDINGS.format(g=generation, rank=r) for r in ranks]
        if not self.core.all_exist(keys):
            return None
        payloads = self.core.payloads(keys)
        if any(p is None for p in payloads):
            return None
        return dict(zip(ranks, decode_holdings(keys, payloads)))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ newcomers' slots
    def claimed(self, generation: int, rank: int) -> bool:
        """Whether generation g's newcomer for `rank` claimed its slot (one request)."""
        return self.core.read(Keys.CLAIM.format(g=generation, rank=rank)) == CLAIMED.encode()

    def give_up_slot(self, generation: int, rank: int) -> None:
        """The coordinator: generation g's newcomer for `rank` was lost before it claimed its
        slot (a claim that came first stands)."""
        self.core.claim(Keys.CLAIM.format(g=generation, rank=rank), GIVEN_UP)

    def move_slot_on(self, generation: int, rank: int) -> None:
        """The coordinator: generation g will not be joined (a newer plan came first);
        its live newcomer for `rank` has not claimed the slot yet (a claim that came first
        stands)."""
        self.core.claim(Keys.CLAIM.format(g=generation, rank=rank), MOVED_ON)

    def publish_sources(self, generation: int, sources: Sources) -> None:
        """Needy rank -> holder for `generation` (before its roster)."""
        self.core.set(Keys.SOURCES.format(g=generation), sources.encode())

    # ------------------------------------------------------------------ phases
    def stamp_count(self, generation: int, phase: str) -> int:
        """How many ranks stamped `phase` of generation g (one store round trip)."""
        return self.core.count(Keys.STAMP_COUNT.format(g=generation, phase=phase))

    def stamp_time(self, generation: int, phase: str, rank: int) -> float | None:
        """When `rank` reached `phase` of generation g (its wall clock; None: not yet)."""
        return self.core.seconds(Keys.STAMP.format(g=generation, phase=phase, rank=rank))

    def stamp_times(self, generation: int, phase: str, ranks: Sequence[int]) -> list[float] | None:
        """The stamps of `ranks`, in batched requests; None while one is missing or rejected
        (the count said they are all in: it is only a hint)."""
        keys = [Keys.STAMP.format(g=generation, phase=phase, rank=r) for r in ranks]
        payloads = self.core.payloads(keys) if self.core.all_exist(keys) else [None]
        if any(v is None for v in payloads):
            return None
        return [read_float(k, v) for k, v in zip(keys, payloads) if v is not None]

    def stale_refs(self, generation: int) -> int:
        """Old-generation handles all ranks found after rebinding into generation g: the sum
        of the ranks' sealed counts, read only when the total's counter (a hint: one request)
        says there are some; a counter the sealed counts do not confirm is rejected and
        reported, as a forged value is."""
        counter = Keys.STALE_REFS.format(g=generation)
        hint = self.core.count(counter)
        if hint == 0:
            return 0
        prefix = Keys.STALE_REF.format(g=generation, rank="")
        keys = [k for k in self.core.serving().list_keys() if k.startswith(prefix)]
        total = 0
        for key in keys:
            value = self.core.read(key)
            if value is None:
                continue
            try:
                count = read_int(key, value, minimum=1)
            except ProtocolError as exc:
                self.core.reject(key, value, str(exc))
                continue
            total += count
        if total != hint:
            self.core.reject(counter, str(hint).encode(), f"store key {counter}: rejected {hint}")
        return total

    # ------------------------------------------------------ failures, errors and verdicts
    def failure_number(self, member: str) -> int:
        """The number of `member`'s latest failure report (0: none): reports are numbered in
        the order they reach the store."""
        key = Keys.FAILURE.format(member=member)
        value = self.core.read(key)
        return 0 if value is None else FailureReport.decode(key, value).number

    def failure_count(self) -> int:
        """How many failure reports survivors made so far (a hint: `latest_failure` confirms)."""
        return self.core.count(Keys.FAILURES)

    def latest_failure(self) -> FailureReport | None:
        """The newest survivor's failure report (None: none, or not the job's)."""
        value = self.core.read(Keys.LATEST_FAILURE)
        return None if value is None else FailureReport.decode(Keys.LATEST_FAILURE, value)

    def error_count(self) -> int:
        """How many processes reported an error of their own (one round trip)."""
        return self.core.count(Keys.ERRORS)

    def error_report(self, number: int) -> ErrorReport | None:
        """Report `number` (None: counted, not published yet, or not the job's). A report whose
        own number is not the one it is read under is rejected, as a forged value is."""
        key = Keys.ERROR.format(number=number)
        value = self.core.read(key)
        if value is None:
            return None
        report = ErrorReport.decode(key, value)
        if report.number != number:
            self.core.reject(key, value, f"store key {key}: rejected report {report.number}")
            return None
        return report

    def publish_job_error(self, verdict: JobError) -> None:
        """The verdict that a failure is the job's own error: the job ends."""
        self.core.set(Keys.JOB_ERROR, verdict.encode())

    def training_complete(self) -> int | None:
        """The iteration training completed at, once any rank finished (None before)."""
        return self.core.number(Keys.TRAINING_COMPLETE)

    def publish_end(self, report: EndReport) -> None:
        """Members lost after training completed, and who writes their final state."""
        self.core.set(Keys.END, report.encode())

    def fault_time(self, member: str) -> float | None:
        """When an injected fault struck `member` (its wall clock; None: none did)."""
        return self.core.seconds(Keys.FAULT.format(member=member))

    def publish_job_status(self, status: JobStatus) -> None:
        """The coordinator: the job's redundancy now (`job_status.py`)."""
        self.core.set(Keys.JOB_STATUS, status.encode())

    # ------------------------------------------------------------------ pruning
    def generation_keys(self, first: int, below: int) -> list[str]:
        """The keys of generations `first` .. `below - 1` that may be deleted (`retention.py`),
        in one request (the coordinator's store)."""
        return retention.generation_keys(self.core.serving().list_keys(), first, below)

    def forget(self, keys: Sequence[str]) -> None:
        """Delete `keys` (one request each: torch's store has no batched delete)."""
        store = self.core.serving()
        for key in keys:
            store.delete_key(key)

    def audit(self) -> list[str]:
        """The keys of the job that hold a value it did not write (each reported once, as any
        rejected value is): what a stranger wrote that no reader came to reject (the
        coordinator's store; batched requests)."""
        keys = [k for k in self.core.serving().list_keys() if holds_sealed(k)]
        rejected = []
        for i in range(0, len(keys), BATCH_KEYS):
            batch = keys[i : i + BATCH_KEYS]
            if self.core.store.check(batch):  # (rank 0 may delete an old metrics record meanwhile)
                raws: list[bytes | None] = list(self.core.store.multi_get(batch))
            else:
                raws = [self.core.peek(k) for k in batch]
            rejected += [
                k for k, r in zip(batch, raws) if r is not None and self.core.open(k, r) is None
            ]
        return rejected

    # ------------------------------------------------------------------ a standby takes over
    def registered_names(self) -> list[str]:
        """Every name a re-registration is published under (one listing of the store's keys:
        a standby finds spares that joined the job after it started this way)."""
        prefix = Keys.REJOIN.format(member="")
        return [k[len(prefix) :] for k in self.core.serving().list_keys() if k.startswith(prefix)]

    def registration(self, name: str) -> Registration | None:
        """The re-registration published under `name` (a member, or `task{i}`)."""
        key = Keys.REJOIN.format(member=name)
        value = self.core.read(key)
        return None if value is None else Registration.decode(key, value)

    def publish_rebuilt(self, epoch: int) -> None:
        """A standby that took over (`epoch`) rebuilt the job's state."""
        self.core.set(Keys.REBUILT, str(epoch))

    # ------------------------------------------------------------------ nodes' agents
    def number_agent_nodes_from(self, first: int) -> None:
        """Agents that join the running job number their nodes from `first` (once)."""
        if self.core.add(Keys.AGENTS_NEXT, 0) == 0:
            self.core.add(Keys.AGENTS_NEXT, first)

    def agent_beat_count(self, node: int) -> int:
        """Node `node`'s agent's newest beat number (0: never beat), in one request (as
        `heartbeat_counts` reads a process's)."""
        key = Keys.AGENT_BEAT.format(node=node)
        return self.core.beat_number(key, self.core.peek(key))

    def order_respawn(self, node: int, order: RespawnOrder) -> None:
        """Give node `node`'s agent its next order (under a number no order holds yet:
        `SealedStore.append`)."""
        self.core.append(
            Keys.AGENT_ORDERS.format(node=node),
            lambda n: Keys.AGENT_ORDER.format(node=node, n=n),
            lambda n: order.encode(),
        )

    def respawn_history(self, node: int) -> RespawnHistory | None:
        """Node `node`'s respawns under earlier coordinators, if its agent wrote them here."""
        key = Keys.AGENT_RESPAWNS.format(node=node)
        value = self.core.read(key)
        return None if value is None else RespawnHistory.decode(key, value)

    def process_exits(self, seen: int) -> tuple[int, list[ProcessExit]]:
        """The exits the agents reported after the first `seen` (`_numbered`)."""
        count, values = self.core.numbered(
            Keys.AGENT_EXITS, lambda n: Keys.AGENT_EXIT.format(n=n), seen
        )
        return count, [ProcessExit.decode(key, value) for key, value in values]

    # ------------------------------------------------------------------ out of redundancy
    def all_salvaged(self, ranks: list[int]) -> bool:
        """Whether every one of `ranks` wrote its part of the salvaged snapshot set."""
        return self.core.all_present([Keys.SALVAGED.format(rank=r) for r in ranks])

    # ------------------------------------------------------------------ the job's stops and end
    def request_preempt(self) -> None:
        """The coordinator's host or a launcher: stop after the current iteration (`preempt`)."""
        self.core.set(Keys.PREEMPT, "1")

    def request_shutdown(self) -> None:
        """The coordinator's host or a launcher: waiting spares leave (`shutdown`)."""
        self.core.set(Keys.SHUTDOWN, "1")
        self.wake_spares()

    def digest(self, rank: int) -> str | None:
        """`rank`'s final digest of parameters and buffers (the host's `finished` event)."""
        value = self.core.read(Keys.DIGEST.format(rank=rank))
        return None if value is None else read_text(value)
