"""The job's wire protocol: every key on the coordinator's store, one named method per access.

Nothing else in the package reads or writes the store directly. Structured values are the
typed messages of `messages.py` (JSON, every field checked when read), key templates its
`Keys`; nothing is ever unpickled. A read is one request (`_peek`); a process that waits for a
key blocks on the server (a WAIT) and then reads it: two requests, where torch's `get` after a
wait would make three. A member is `a{r}` (the initial active of rank r) or `s{i}` (spare i);
g is a generation (0 at start, +1 per planned recovery). The words: `docs/glossary.md`.

Every value written here is sealed with the job's secret (`seal.py`: an HMAC-SHA256 of the key
and the payload) and opened when read: a value that is not this job's - forged, altered, or
copied from another key or generation - is treated as absent, reported once (a warning, and
the coordinator's event `rejected_value`), and never acted on; a reader that waits for such a
key polls until the job's own value replaces it. Counters (`add`) cannot carry a MAC: they are
the heartbeats and counts below, which only ever wake or hurry a reader of sealed values.

Keys (the message type of each structured value in CamelCase):
  job/token                   proof that the store serves this job: a value sealed with the
                              job's secret (the secret itself is never stored); a process whose
                              secret cannot open it is refused
  job/layout                  LayoutRecord: the parallel layout (rank 0 of generation 0)
  coordinator                 CoordinatorIdentity: who serves this store - epoch 0 the primary,
                              i the standby at entry i of --deadpool-coordinator once it took
                              over. Set before job/token: a store without the token serves no
                              job (yet)
  proc/{member}/ready         Announcement: host and OS pid, once a member connected
  hb/{member}                 heartbeat counter: +1 per beat, 0 before the first (created by the
                              coordinator). No clock travels: the coordinator times each change
                              on its own monotonic clock (`heartbeats.py`), so clock skew
                              between hosts cannot make a live process look hung.
  coord/inbox                 queue of wake-ups for the coordinator (a report it waits for is
                              complete); it blocks on the queue instead of polling
  spares/epoch                counter of events waiting spares must look at (a roster, the
                              shutdown); spares/epoch/{n} appears with event n: spares block on
                              the next one instead of polling
  spares/next                 counter: the number of the next spare member s{i}, set to the
                              job's initial spares by the coordinator; a process that joins a
                              running job (`--deadpool-join`) takes its name from it. A joined
                              spare counts once its sealed announcement (proc/{member}/ready)
                              is there, so bumping the counter gives a stranger nothing
  gen                         the newest generation with a published roster
  gen{g}/roster               Roster: which member fills which rank, the restore iteration
  plan/latest                 the newest planned generation (a recovery, or the end out of
                              redundancy): a survivor's plan watch aborts its groups when it
                              passes the survivor's generation
  gen{g}/plan                 Plan: dead and needy ranks, the slots that change from roster
                              `base`
  gen{g}/holdings/{rank}      HoldingsReport: a survivor's verified snapshots and replicas,
                              its last completed step, the job's own fields
  gen{g}/holdings/count       counter of those reports; once the coordinator planned g, less the
                              reports it waits for (`expect_reports`): the report that brings
                              it to 0 is the last one, and wakes the coordinator
  gen{g}/decided              Decision on plan g, which survivors block on: the roster (with
                              its restore iteration), out of redundancy, or superseded by a
                              newer plan
  gen{g}/sources              Sources: needy rank -> holder, for the restore iteration
  gen{g}/ready/{rank}         "ready": the newcomer of a needy rank claimed its slot, its
                              objects built, as it joins; "lost": the coordinator gave the slot
                              up first (the newcomer died before claiming it); "moved on": the
                              generation will not be joined (a newer plan came first) and
                              the live newcomer takes its slot in the next one. Survivors wait
                              for these before joining, so that none waits in a rendezvous for
                              a newcomer that will never come
  gen{g}/{phase}/{rank}       wall time a rank reached a phase: joined, restored,
                              first_iteration (rank 0 only); gen{g}/{phase}/count counts them
  gen{g}/repair/{rank}        RepairHandles: the rank's reconfigure handles of its groups and the
                              generation they were created in (`group_repair.py`)
  gen{g}/stale_refs           counter: old-generation group handles ranks found left after
                              rebinding (must stay 0)
  gen{g}/...                  torch's own rendezvous keys of generation g's process groups
                              (`process_group_store`)
  out_of_redundancy           OutOfRedundancy: why memory cannot recover, what is lost, what
                              survivors save
  failures                    counter: survivors that saw a collective fail (the coordinator
                              then suspects silent ranks sooner than the heartbeat timeout)
  failure/{member}            FailureReport: what the survivor saw fail, numbered by `failures`
  errors                      counter: processes that ended with an error of their own
  error/{n}                   ErrorReport n: who, in which phase, the exception and the end of
                              its traceback (a process that dies by a signal reports nothing)
  job_error                   JobError: the coordinator's verdict that a failure is the job's
                              own error (no spare takes the slots; the job ends)
  finished/{rank}             the iteration the rank finished training at (replicated)
  training/complete           the iteration training completed at (every rank's last step done
                              and replicated: a later loss needs no recomputation)
  end                         EndReport: members lost after training completed, who writes
                              their final state
  fault/{member}              wall time an injected fault struck the member
  fault/fired/{index}/{who}   counter: fault spec `index` fired for rank or member `who`
  node_lost/{member}          a node fault took the node `member` ran on (local launchers)
  progress/last               the newest iteration rank 0 completed
  metrics/g{g}/{it}           IterationRecord: rank 0's record of iteration `it` in generation g
  replication/final           FinalReplication: the committed iteration at the end of training
  digest/{rank}               the rank's final digest of parameters and buffers
  done/{member}               wall time the member finished its work (done/count: how many)
  preempt                     set by a launcher: stop after the current iteration
  preempted                   Preempted: where training stopped on purpose
  checkpoint/failures         CheckpointFailures: the embedded job's periodic checkpoints that
                              could not be written (a full disk), each one's line
  job/status                  JobStatus: spares waiting, recoveries, respawns, standbys (the
                              coordinator's, for the ranks' TensorBoard/W&B scalars)
  load/{rank}                 seconds the rank took to load a persistent checkpoint
  salvaged/{rank}             the rank wrote its part of the out-of-redundancy snapshot set
  shutdown                    set by a launcher or the coordinator: waiting spares leave
  rejoin/{member}             Registration: a member's re-registration with a standby that took
                              over; task{i} for a process that does not know its member name
                              yet (task i: actives first, then spares)
  rebuilt                     the standby rebuilt the job's state from the re-registrations
  agents/next                 counter: the number of the next node whose agent joins the running
                              job, set to the job's initial node count by the coordinator
  agent/{node}/hb             counter: node `node`'s agent's beats (`deadpool agent`), as hb/
                              counts a process's
  agent/{node}/orders         counter of the coordinator's orders to that agent
  agent/{node}/order/{n}      RespawnOrder n: start a process there in a failed one's place
  agents/exits                counter of the exits the agents saw
  agents/exit/{n}             ProcessExit n: a process an agent started ended, with its code

What is deleted, and when (`retention.py`): rank 0 keeps the last `RETAINED_ITERATIONS` of its
`metrics/g{g}/{it}` records (publishing one deletes the one that many iterations back), and once
generation g is complete the coordinator deletes every key of the generations before g - 1 -
`gen{h}/...` (torch's rendezvous keys included) and `metrics/g{h}/...` - but generation 0's
roster - and the keys of the members whose death was planned for in those generations (hb/,
proc/.../ready, failure/, done/). Everything else lives as long as the job.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from ...errors import JobTokenError
from . import retention
from .codec import read_float, read_int, read_text
from .messages import (
    AGENT_NODE_ENV,
    CLAIMED,
    GIVEN_UP,
    MOVED_ON,
    WAKE,
    Announcement,
    CheckpointFailures,
    CoordinatorIdentity,
    Decision,
    EndReport,
    ErrorReport,
    FailureReport,
    FinalReplication,
    HoldingsReport,
    IterationRecord,
    JobError,
    JobStatus,
    Keys,
    LayoutRecord,
    OutOfRedundancy,
    Plan,
    Preempted,
    ProcessExit,
    Registration,
    RespawnHistory,
    RespawnOrder,
    Roster,
    Sources,
    decode_holdings,
    holds_sealed,
)
from .numbered import numbers_to_read
from .seal import ForgedValue, JobSeal
from .store_files import keep_alive
from .store_protocol import ConfirmedSets, ServingStore, StoreLike

log = logging.getLogger("megatron_deadpool.membership")

ABSENT = "\0absent\0"
"""What `_peek` compares with: no value of ours (text, JSON, numbers) is ever equal to it."""

BATCH_KEYS = 1024
"""Keys per batched store request. torch's store server handles a request's keys in time that
grows faster than linearly with their number (measured with torch 2.13 on loopback: 16,384 keys
in one `multi_get` 0.75-0.94 s, in 16 requests of 1,024 keys 0.04-0.05 s)."""


SERVES_JOB = "job"
"""The payload of `job/token`: sealed, it proves the store serves the job of this secret."""

FORGED_POLL_S = 0.05
"""How often a reader waiting for a key polls while the key holds a rejected value."""

FORGED_WAIT_S = 300.0
"""How long a read that must return a value (`roster`, `sources`) waits for the job's own value
to replace a rejected one before it gives up (`ForgedValue`)."""

REJECTIONS_REMEMBERED = 4096
"""Rejected (key, value) pairs remembered so that each is reported once."""


class Membership:
    """One member's (or the coordinator's) access to the job's store, sealed with `seal`."""

    def __init__(self, store: StoreLike, member: str, seal: JobSeal) -> None:
        self.store = store
        self.member = member
        self.seal = seal
        self._set_then_add = store.set_then_add if isinstance(store, ConfirmedSets) else None
        self.plan_seen = 0  # the newest planned generation this process read
        self.on_rejected: Callable[[str, str], None] | None = None  # (key, why): e.g. an event
        self._rejected: set[tuple[str, bytes]] = set()

    def sibling(self, store: StoreLike, member: str | None = None) -> Membership:
        """Another access to a store of the same job (another connection, or as `member`), which
        reports its rejections the same way."""
        other = Membership(store, self.member if member is None else member, self.seal)
        other.on_rejected = self.on_rejected
        return other

    # ------------------------------------------------------------------ plumbing
    def _set(self, key: str, value: str) -> None:
        self.store.set(key, self.seal.seal(key, value))

    def _set_counted(self, key: str, value: str, counter: str) -> int:
        """Set `key`, then add one to `counter` (after the value is in: a reader that sees the
        count finds it); the counter's new value. One request less on a client whose sets
        confirm themselves (`ConfirmedSets`)."""
        sealed = self.seal.seal(key, value)
        if self._set_then_add is not None:
            return self._set_then_add(key, sealed, counter, 1)
        self.store.set(key, sealed)
        return int(self.store.add(counter, 1))

    def _open(self, key: str, raw: bytes) -> bytes | None:
        """The payload of `raw`, read from `key`; None (reported once) if it is not the job's."""
        try:
            return self.seal.open(key, raw)
        except ForgedValue as exc:
            self._reject(key, raw, str(exc))
            return None

    def _reject(self, key: str, raw: bytes, why: str) -> None:
        if (key, raw) in self._rejected:
            return
        if len(self._rejected) >= REJECTIONS_REMEMBERED:
            self._rejected.clear()
        self._rejected.add((key, raw))
        log.warning("%s: %s", self.member, why)
        if self.on_rejected is not None:
            self.on_rejected(key, why)

    def _read(self, key: str) -> bytes | None:
        """`key`'s payload, or None when it is missing or not the job's (one request)."""
        raw = self._peek(key)
        return None if raw is None else self._open(key, raw)

    def _present(self, key: str) -> bool:
        """Whether `key` holds a value of the job's (one request)."""
        return self._read(key) is not None

    def _get(self, key: str) -> bytes:
        """`key`'s payload, blocking until the key exists (up to the store's timeout) and
        holds a value of the job's (up to `FORGED_WAIT_S` more)."""
        deadline = time.monotonic() + FORGED_WAIT_S
        while True:
            raw = self.store.get(key)
            value = self._open(key, raw)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                self.seal.open(key, raw)  # raises ForgedValue, naming key and value
            time.sleep(FORGED_POLL_S)

    def _claim(self, key: str, payload: str) -> bytes:
        """Put `payload` in `key` unless it holds a value of the job's already (a rejected one
        counts as none, and is replaced); the payload the key holds afterwards. `ForgedValue`
        when rejected values keep replacing ours for `FORGED_WAIT_S`."""
        expected: str | bytes = ""
        desired = self.seal.seal(key, payload)
        deadline = time.monotonic() + FORGED_WAIT_S  # a stranger racing us delays, never wins
        while True:  # each round replaces the rejected value it saw
            raw = self.store.compare_set(key, expected, desired)  # type: ignore[arg-type]
            value = self._open(key, raw)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                self.seal.open(key, raw)  # raises ForgedValue, naming key and value
            expected = raw

    def _peek(self, key: str) -> bytes | None:
        """`key`'s value, or None if it does not exist, in one request that neither waits nor
        creates the key: a compare-and-set whose expected value no key holds answers the
        current value, or that expected value for a missing key (torch's TCP, file and hash
        stores alike). torch's own `get` waits for the key first (two requests: WAIT, GET)."""
        value = self.store.compare_set(key, ABSENT, ABSENT)
        return None if value == ABSENT.encode() else value

    def _int(self, key: str) -> int | None:
        value = self._read(key)
        return None if value is None else read_int(key, value)

    def _wait_read(self, key: str, timeout_s: float) -> bytes | None:
        """Block until `key` exists, then its payload (None on timeout): two requests. While
        it holds a rejected value, poll until the job's own replaces it."""
        deadline = time.monotonic() + timeout_s
        while self._wait(key, timeout_s=deadline - time.monotonic()):
            raw = self._peek(key)
            if raw is None:  # deleted in between: only `withdraw` deletes, and not these keys
                raise dist.DistStoreError(f"{key} vanished from the store")
            value = self._open(key, raw)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                break
            time.sleep(FORGED_POLL_S)
        return None

    def _stamp(self, key: str) -> None:
        self._set(key, repr(time.time()))

    def _stamp_counted(self, key: str, counter: str) -> None:
        """`_stamp`, counted in `counter` (`_set_counted`)."""
        self._set_counted(key, repr(time.time()), counter)

    def _time(self, key: str) -> float | None:
        value = self._read(key)
        return None if value is None else read_float(key, value)

    def _payloads(self, keys: Sequence[str]) -> list[bytes | None]:
        """The payloads of `keys` (which must all exist), in batches; None for a rejected one."""
        return [self._open(k, raw) for k, raw in zip(keys, self._multi_get(keys))]

    def _all_present(self, keys: Sequence[str]) -> bool:
        """Whether every key of `keys` holds a value of the job's (batched requests)."""
        return self._all_exist(keys) and all(v is not None for v in self._payloads(keys))

    def _multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Values of `keys` (which must all exist: a missing one blocks), in batches."""
        out: list[bytes] = []
        for i in range(0, len(keys), BATCH_KEYS):
            out += self.store.multi_get(list(keys[i : i + BATCH_KEYS]))
        return out

    def _all_exist(self, keys: Sequence[str]) -> bool:
        return all(
            self.store.check(list(keys[i : i + BATCH_KEYS]))
            for i in range(0, len(keys), BATCH_KEYS)
        )

    def _wait(self, *keys: str, timeout_s: float) -> bool:
        """Block until every key exists (the server answers when they are set); False on
        timeout."""
        try:
            self.store.wait(list(keys), datetime.timedelta(seconds=max(timeout_s, 0.001)))
        except dist.DistStoreError:
            return self.store.check(list(keys))  # they may have been set as the wait timed out
        return True

    def _count(self, key: str) -> int:
        """A counter's value (0, and created, if it did not exist)."""
        return int(self.store.add(key, 0))

    # ------------------------------------------------------------------ waking the coordinator
    def notify_coordinator(self) -> None:
        """Wake the coordinator (`next_message` returns)."""
        self.store.queue_push(Keys.INBOX, WAKE)

    def next_message(self) -> None:
        """Block until a member notifies the coordinator (up to the store's timeout)."""
        self.serving().queue_pop(Keys.INBOX)

    def serving(self) -> ServingStore:
        """This store as the coordinator serves it (not a member's client of it)."""
        if not isinstance(self.store, ServingStore):
            raise TypeError(f"{type(self.store).__name__} is a client, not the serving store")
        return self.store

    # ------------------------------------------------------------------ the job
    def set_token(self) -> None:
        """This store serves the job now (`job/token`: the job's seal, not its secret)."""
        self._set(Keys.TOKEN, SERVES_JOB)

    def check_token(self) -> None:
        """Refuse to join a store that serves no job of this secret (another job's
        coordinator, or a store whose token someone else wrote)."""
        if not self.serves_job():
            raise JobTokenError(
                f"deadpool-job-token: this process's secret or run id (DEADPOOL_JOB_ID="
                f"{self.seal.job!r}) does not match the coordinator's job; give it the job's "
                f"DEADPOOL_JOB_TOKEN or DEADPOOL_JOB_TOKEN_FILE and DEADPOOL_JOB_ID "
                f"(member {self.member})"
            )

    def serves_job(self) -> bool | None:
        """Whether this store serves the job of this secret: None when it serves no job (a
        standby that has not taken over), False when its token is not this job's."""
        raw = self._peek(Keys.TOKEN)
        if raw is None:
            return None
        try:  # another job's token is no forgery to report: a probe finds it
            return self.seal.open(Keys.TOKEN, raw) == SERVES_JOB.encode()
        except ForgedValue:
            return False

    def set_identity(self, identity: CoordinatorIdentity) -> None:
        """Say which coordinator serves this store (before `set_token`)."""
        self._set(Keys.COORDINATOR, identity.encode())

    def identity(self) -> CoordinatorIdentity | None:
        """The coordinator serving this store; None: none has taken it yet."""
        value = self._read(Keys.COORDINATOR)
        return None if value is None else CoordinatorIdentity.decode(Keys.COORDINATOR, value)

    def withdraw(self, members: list[str]) -> None:
        """A standby that did not take over after all: the store serves no job again, and the
        re-registrations of `members` it got are forgotten."""
        rejoins = (Keys.REJOIN.format(member=m) for m in members)
        for key in [Keys.TOKEN, Keys.COORDINATOR, *rejoins]:
            self.serving().delete_key(key)

    def publish_layout(self, layout: LayoutRecord) -> None:
        self._set(Keys.LAYOUT, layout.encode())

    def layout(self) -> LayoutRecord | None:
        value = self._read(Keys.LAYOUT)
        return None if value is None else LayoutRecord.decode(Keys.LAYOUT, value)

    # ------------------------------------------------------------------ members
    def announce(self) -> None:
        node = os.environ.get(AGENT_NODE_ENV, "")
        ready = Announcement(socket.gethostname(), os.getpid(), int(node) if node.isdigit() else -1)
        self._set(Keys.READY.format(member=self.member), ready.encode())
        self.heartbeat()

    def heartbeat(self) -> None:
        """One beat: this member's counter + 1 (no clock is sent)."""
        self.store.add(Keys.HEARTBEAT.format(member=self.member), 1)

    def watch_heartbeats(self, members: Sequence[str]) -> None:
        """Create the counters of `members` at 0 where missing (an existing count is kept), so
        that `heartbeat_counts` never waits for a key."""
        for member in members:
            self.store.add(Keys.HEARTBEAT.format(member=member), 0)

    def heartbeat_counts(self, members: Sequence[str]) -> list[int]:
        """The beat counters of `members` (watched first), in batched requests."""
        keys = [Keys.HEARTBEAT.format(member=m) for m in members]
        return [read_int(k, v) for k, v in zip(keys, self._multi_get(keys))]

    def announced(self, member: str) -> bool:
        """Whether `member` announced itself to this store (`announce`)."""
        return self._present(Keys.READY.format(member=member))

    def mark_done(self) -> None:
        self.restore_done(self.member)

    def restore_done(self, member: str) -> None:
        """`member` finished its work (itself, or - a standby's rebuild - as it said when it
        re-registered)."""
        # (`done_count` only screens: `all_done` decides)
        self._stamp_counted(Keys.DONE.format(member=member), Keys.DONE_COUNT)

    def is_done(self, member: str) -> bool:
        return self._present(Keys.DONE.format(member=member))

    def done_count(self) -> int:
        """How many members finished their work (one store round trip)."""
        return self._count(Keys.DONE_COUNT)

    def all_done(self, members: list[str]) -> bool:
        return self._all_present([Keys.DONE.format(member=m) for m in members])

    # ------------------------------------------------------------------ generations
    def generation(self) -> int:
        """The newest generation with a roster (-1 before the first)."""
        g = self._int(Keys.GENERATION)
        return -1 if g is None else g

    def roster(self, generation: int) -> Roster:
        key = Keys.ROSTER.format(g=generation)
        return Roster.decode(key, self._get(key))

    def wait_newest_roster(self, timeout_s: float) -> Roster:
        """The newest roster, once there is one: what a starting process reads the job's world
        size from (generation 0's is not in a standby's store that took the job over later)."""
        self.store.wait([Keys.GENERATION], datetime.timedelta(seconds=timeout_s))
        return self.roster(self.generation())

    def publish_roster(self, roster: Roster) -> None:
        self._set(Keys.ROSTER.format(g=roster.generation), roster.encode())
        self._set(Keys.GENERATION, str(roster.generation))
        self.wake_spares()

    # ------------------------------------------------------------------ waiting spares
    def spare_epoch(self) -> int:
        """How many events waiting spares were woken for so far."""
        return self._count(Keys.SPARE_EPOCH)

    def wake_spares(self) -> None:
        """Wake every spare blocked in `wait_spare_epoch` (a roster, or the shutdown)."""
        n = self.store.add(Keys.SPARE_EPOCH, 1)
        self._set(Keys.SPARE_EPOCH_N.format(n=n), "1")

    def number_spares_from(self, first: int) -> None:
        """The coordinator: spare names handed to joining processes start at s{first} (or
        after every name handed out already, when a standby takes over a job)."""
        current = self._count(Keys.SPARES_NEXT)
        if current < first:
            self.store.add(Keys.SPARES_NEXT, first - current)

    def claim_spare_name(self) -> str:
        """A process joining a running job: its spare member name, unique in the job."""
        return f"s{self.store.add(Keys.SPARES_NEXT, 1) - 1}"

    def spare_names_claimed(self) -> int:
        """How many spare names were handed out (s0 .. s{n-1}), the initial spares' included."""
        return self._count(Keys.SPARES_NEXT)

    def wait_spare_epoch(self, n: int, timeout_s: float) -> bool:
        """Block until wake-up `n` happened; False on timeout."""
        return self._wait(Keys.SPARE_EPOCH_N.format(n=n), timeout_s=timeout_s)

    def process_group_store(self, generation: int) -> dist.Store:
        """The store generation g's process groups rendezvous on (for a bounded or failover
        client, `connection.BoundedStore`: its current torch connection)."""
        prefix = Keys.PROCESS_GROUPS.format(g=generation)
        store: Any = getattr(self.store, "client", None) or self.store
        return dist.PrefixStore(prefix, store)

    # ------------------------------------------------------------------ recovery
    def latest_plan(self) -> int:
        """The newest planned generation (0: none planned yet)."""
        latest = self._int(Keys.LATEST_PLAN) or 0
        self.plan_seen = max(self.plan_seen, latest)
        return latest

    def publish_plan(self, plan: Plan) -> None:
        self._set(Keys.PLAN.format(g=plan.generation), plan.encode())
        self._set(Keys.LATEST_PLAN, str(plan.generation))

    def planned(self, generation: int) -> bool:
        """Whether generation g is planned (one round trip)."""
        return self._present(Keys.PLAN.format(g=generation))

    def wait_plan(self, generation: int, timeout_s: float) -> bool:
        """Block until generation g is planned (True), or `timeout_s` passed."""
        return self._wait_read(Keys.PLAN.format(g=generation), timeout_s) is not None

    def plan(self, generation: int) -> Plan | None:
        key = Keys.PLAN.format(g=generation)
        value = self._read(key)
        return None if value is None else Plan.decode(key, value)

    def decide(self, generation: int, decision: Decision) -> None:
        """The coordinator's decision on plan g."""
        self._set(Keys.DECIDED.format(g=generation), decision.encode())

    def wait_decision(self, generation: int, timeout_s: float) -> Decision | None:
        """Block until plan g is decided; None on timeout."""
        key = Keys.DECIDED.format(g=generation)
        value = self._wait_read(key, timeout_s)
        return None if value is None else Decision.decode(key, value)

    def publish_out_of_redundancy(self, report: OutOfRedundancy, generations: list[int]) -> None:
        """Memory cannot recover: the report, the decision on each of `generations` (survivors
        waiting on their plans see it), and the newest of them as the latest plan (survivors
        blocked in a collective are released by their plan watch)."""
        self._set(Keys.OUT_OF_REDUNDANCY, report.encode())
        for g in generations:
            self.decide(g, Decision.out_of_redundancy())
        self._set(Keys.LATEST_PLAN, str(max(generations)))

    def out_of_redundancy(self) -> OutOfRedundancy | None:
        value = self._read(Keys.OUT_OF_REDUNDANCY)
        return None if value is None else OutOfRedundancy.decode(Keys.OUT_OF_REDUNDANCY, value)

    def report_holdings(self, generation: int, rank: int, report: HoldingsReport) -> None:
        """Publish a survivor's report for generation g (planned or not yet); the last one the
        coordinator waits for wakes it."""
        key = Keys.HOLDINGS.format(g=generation, rank=rank)
        if self._set_counted(key, report.encode(), Keys.HOLDINGS_COUNT.format(g=generation)) == 0:
            self.notify_coordinator()

    def expect_reports(self, generation: int, count: int) -> None:
        """The coordinator planned g and waits for `count` reports (some may be in already:
        `reports_missing` counts down from here)."""
        self.store.add(Keys.HOLDINGS_COUNT.format(g=generation), -count)

    def reports_missing(self, generation: int) -> int:
        """How many of the reports `expect_reports` waits for have not arrived (one round
        trip)."""
        return -self._count(Keys.HOLDINGS_COUNT.format(g=generation))

    def reject_holdings_count(self, generation: int, count: int) -> None:
        """Report generation g's report counter holding `count`, out of its range: a stranger's
        `add` (once per value, as a rejected value is; the reports themselves decide)."""
        key = Keys.HOLDINGS_COUNT.format(g=generation)
        self._reject(key, str(count).encode(), f"store key {key}: rejected count {count}")

    def holdings_count(self, generation: int) -> int:
        """The report counter of generation g: how many reports arrived, until the coordinator
        planned g (`expect_reports`)."""
        return self._count(Keys.HOLDINGS_COUNT.format(g=generation))

    def holdings(self, generation: int, rank: int) -> HoldingsReport | None:
        key = Keys.HOLDINGS.format(g=generation, rank=rank)
        value = self._read(key)
        return None if value is None else HoldingsReport.decode(key, value)

    def all_holdings(
        self, generation: int, ranks: Sequence[int]
    ) -> dict[int, HoldingsReport] | None:
        """Every report of `ranks` for plan g, in batched requests; None while one is missing
        (or rejected)."""
        keys = [Keys.HOLDINGS.format(g=generation, rank=r) for r in ranks]
        if not self._all_exist(keys):
            return None
        payloads = self._payloads(keys)
        if any(p is None for p in payloads):
            return None
        return dict(zip(ranks, decode_holdings(keys, payloads)))  # type: ignore[arg-type]

    def claim_slot(self, generation: int, rank: int) -> str:
        """A newcomer about to join generation g as `rank`: `CLAIMED`, unless the coordinator
        settled the slot first - `GIVEN_UP` (it took this process for lost: `give_up_slot`) or
        `MOVED_ON` (the generation will not be joined: `move_slot_on`)."""
        return self._claim(Keys.CLAIM.format(g=generation, rank=rank), CLAIMED).decode()

    def claimed(self, generation: int, rank: int) -> bool:
        """Whether generation g's newcomer for `rank` claimed its slot (one request)."""
        return self._read(Keys.CLAIM.format(g=generation, rank=rank)) == CLAIMED.encode()

    def give_up_slot(self, generation: int, rank: int) -> None:
        """The coordinator: generation g's newcomer for `rank` was lost before it claimed its
        slot (a claim that came first stands)."""
        self._claim(Keys.CLAIM.format(g=generation, rank=rank), GIVEN_UP)

    def move_slot_on(self, generation: int, rank: int) -> None:
        """The coordinator: generation g will not be joined (a newer plan came first);
        its live newcomer for `rank` has not claimed the slot yet (a claim that came first
        stands)."""
        self._claim(Keys.CLAIM.format(g=generation, rank=rank), MOVED_ON)

    def wait_newcomers(
        self, generation: int, ranks: Sequence[int], timeout_s: float
    ) -> bool | None:
        """Block until every newcomer of generation g (`ranks`) claimed its slot or was given
        up: True when all claimed, False when one was given up, None on timeout."""
        keys = [Keys.CLAIM.format(g=generation, rank=r) for r in ranks]
        if len(keys) == 1:
            value = self._wait_read(keys[0], timeout_s)
            return None if value is None else value == CLAIMED.encode()
        deadline = time.monotonic() + timeout_s
        while keys and self._wait(*keys, timeout_s=deadline - time.monotonic()):
            values = [self._open(k, v) for k, v in zip(keys, self.store.multi_get(keys))]
            if all(v is not None for v in values):
                return all(v == CLAIMED.encode() for v in values)
            if time.monotonic() >= deadline:
                return None
            time.sleep(FORGED_POLL_S)  # a rejected value: until the job's own replaces it
        return None if keys else True

    def publish_sources(self, generation: int, sources: Sources) -> None:
        self._set(Keys.SOURCES.format(g=generation), sources.encode())

    def sources(self, generation: int) -> Sources:
        """Needy rank -> holder, as the coordinator fixed them for `generation` (published
        before its roster: read it once the roster is known)."""
        key = Keys.SOURCES.format(g=generation)
        return Sources.decode(key, self._get(key))

    def stamp(self, generation: int, phase: str, rank: int) -> None:
        """`rank` reached `phase` of generation g now (its wall clock), and is counted."""
        self._stamp_counted(
            Keys.STAMP.format(g=generation, phase=phase, rank=rank),
            Keys.STAMP_COUNT.format(g=generation, phase=phase),
        )

    def stamp_count(self, generation: int, phase: str) -> int:
        """How many ranks stamped `phase` of generation g (one store round trip)."""
        return self._count(Keys.STAMP_COUNT.format(g=generation, phase=phase))

    def stamp_time(self, generation: int, phase: str, rank: int) -> float | None:
        return self._time(Keys.STAMP.format(g=generation, phase=phase, rank=rank))

    def stamp_times(self, generation: int, phase: str, ranks: Sequence[int]) -> list[float] | None:
        """The stamps of `ranks`, in batched requests; None while one is missing or rejected
        (the count said they are all in: it is only a hint)."""
        keys = [Keys.STAMP.format(g=generation, phase=phase, rank=r) for r in ranks]
        payloads = self._payloads(keys) if self._all_exist(keys) else [None]
        if any(v is None for v in payloads):
            return None
        return [read_float(k, v) for k, v in zip(keys, payloads) if v is not None]

    def publish_repair_handles(self, generation: int, rank: int, payload: str) -> None:
        """`rank`'s reconfigure handles for the repair of generation g (`group_repair`)."""
        self._set(Keys.REPAIR_HANDLES.format(g=generation, rank=rank), payload)

    def repair_handles(self, g: int, ranks: Sequence[int], wait_s: float) -> list[bytes | None]:
        """The handles `ranks` published for generation g, waited for up to `wait_s` (then the
        store's error); None for a value that is not the job's."""
        keys = [Keys.REPAIR_HANDLES.format(g=g, rank=r) for r in ranks]
        self.store.wait(keys, datetime.timedelta(seconds=wait_s))
        return self._payloads(keys)

    def report_stale_refs(self, generation: int, count: int) -> None:
        """Add a rank's count of old-generation handles left after rebinding to g's total."""
        self.store.add(Keys.STALE_REFS.format(g=generation), count)

    def stale_refs(self, generation: int) -> int:
        """Old-generation handles all ranks found after rebinding into generation g."""
        return self._count(Keys.STALE_REFS.format(g=generation))

    def report_failure(self, why: str) -> None:
        """This survivor saw a collective fail (a peer died or hung)."""
        number = self.store.add(Keys.FAILURES, 1)
        report = FailureReport(number=number, time=time.time(), why=why)
        self._set(Keys.FAILURE.format(member=self.member), report.encode())

    def failure_number(self, member: str) -> int:
        """The number of `member`'s latest failure report (0: none): reports are numbered in
        the order they reach the store."""
        key = Keys.FAILURE.format(member=member)
        value = self._read(key)
        return 0 if value is None else FailureReport.decode(key, value).number

    def failure_count(self) -> int:
        """How many failure reports survivors made so far."""
        return self._count(Keys.FAILURES)

    # ------------------------------------------------------------------ a process's own error
    def report_error(self, report: ErrorReport) -> None:
        """This process ends with `report`'s error: numbered by the store (`errors`), then
        published under its number, and the coordinator woken."""
        number = self.store.add(Keys.ERRORS, 1)
        self._set(Keys.ERROR.format(number=number), replace(report, number=number).encode())
        self.notify_coordinator()

    def error_count(self) -> int:
        """How many processes reported an error of their own (one round trip)."""
        return self._count(Keys.ERRORS)

    def error_report(self, number: int) -> ErrorReport | None:
        """Report `number` (None: counted, not published yet)."""
        key = Keys.ERROR.format(number=number)
        value = self._read(key)
        return None if value is None else ErrorReport.decode(key, value)

    def publish_job_error(self, verdict: JobError) -> None:
        self._set(Keys.JOB_ERROR, verdict.encode())

    def job_error(self) -> JobError | None:
        value = self._read(Keys.JOB_ERROR)
        return None if value is None else JobError.decode(Keys.JOB_ERROR, value)

    # ------------------------------------------------------------------ the end of training
    def report_finished(self, rank: int, iteration: int) -> None:
        """`rank` finished training at `iteration`, its final state replicated."""
        self._set(Keys.FINISHED.format(rank=rank), str(iteration))
        self._set(Keys.TRAINING_COMPLETE, str(iteration))

    def training_complete(self) -> int | None:
        """The iteration training completed at, once any rank finished (None before)."""
        return self._int(Keys.TRAINING_COMPLETE)

    def publish_end(self, report: EndReport) -> None:
        self._set(Keys.END, report.encode())

    def end(self) -> EndReport | None:
        value = self._read(Keys.END)
        return None if value is None else EndReport.decode(Keys.END, value)

    # ------------------------------------------------------------------ faults
    def record_fault(self) -> None:
        """An injected fault strikes this member now."""
        self._stamp(Keys.FAULT.format(member=self.member))

    def fault_time(self, member: str) -> float | None:
        return self._time(Keys.FAULT.format(member=member))

    def record_node_lost(self) -> None:
        """A node fault takes this member's node whole, its agent included (local launchers)."""
        self._stamp(Keys.NODE_LOST.format(member=self.member))

    def node_lost(self, member: str) -> bool:
        """Whether a node fault took the node `member` ran on."""
        return self._time(Keys.NODE_LOST.format(member=member)) is not None

    def fire_once(self, index: int, who: int | str) -> bool:
        """True the first time fault spec `index` fires for `who` in the whole job."""
        return self.store.add(Keys.FAULT_FIRED.format(index=index, who=who), 1) == 1

    def fired(self, index: int, who: int | str) -> bool:
        """Whether fault spec `index` fired for `who` (a benchmark reads it at the end)."""
        return self.store.add(Keys.FAULT_FIRED.format(index=index, who=who), 0) > 0

    # ------------------------------------------------------------------ progress and results
    def set_progress(self, iteration: int) -> None:
        self._set(Keys.PROGRESS, str(iteration))

    def progress(self) -> int:
        return self._int(Keys.PROGRESS) or 0

    def publish_metrics(
        self, record: IterationRecord, retain: int | None = retention.RETAINED_ITERATIONS
    ) -> None:
        """Rank 0's record of an iteration; the record `retain` iterations back goes (None:
        every record stays, as before records were pruned - for comparing, `bench store-state`)."""
        key = Keys.METRICS.format(g=record.generation, iteration=record.iteration)
        self._set(key, record.encode())
        expired = None if retain is None else retention.expired_iteration(record.iteration, retain)
        if expired is not None:
            self.store.delete_key(Keys.METRICS.format(g=record.generation, iteration=expired))

    def metrics(self, generation: int, iteration: int) -> IterationRecord | None:
        key = Keys.METRICS.format(g=generation, iteration=iteration)
        value = self._read(key)
        return None if value is None else IterationRecord.decode(key, value)

    def publish_checkpoint_failure(self, iteration: int, line: str) -> None:
        """Rank 0: the checkpoint of `iteration` was not written (`line` says why)."""
        known = self.checkpoint_failures()
        lines = retention.retained_failures({**(known.lines if known else {}), iteration: line})
        self._set(Keys.CHECKPOINT_FAILURES, CheckpointFailures(lines).encode())

    def checkpoint_failures(self) -> CheckpointFailures | None:
        value = self._read(Keys.CHECKPOINT_FAILURES)
        key = Keys.CHECKPOINT_FAILURES
        return None if value is None else CheckpointFailures.decode(key, value)

    def publish_job_status(self, status: JobStatus) -> None:
        """The coordinator: the job's redundancy now (`job_status.py`)."""
        self._set(Keys.JOB_STATUS, status.encode())

    def job_status(self) -> JobStatus | None:
        value = self._read(Keys.JOB_STATUS)
        return None if value is None else JobStatus.decode(Keys.JOB_STATUS, value)

    # ------------------------------------------------------------------ pruning
    def generation_keys(self, first: int, below: int) -> list[str]:
        """The keys of generations `first` .. `below - 1` that may be deleted (`retention.py`),
        in one request (the coordinator's store)."""
        return retention.generation_keys(self.serving().list_keys(), first, below)

    def forget(self, keys: Sequence[str]) -> None:
        """Delete `keys` (one request each: torch's store has no batched delete)."""
        store = self.serving()
        for key in keys:
            store.delete_key(key)

    def audit(self) -> list[str]:
        """The keys of the job that hold a value it did not write (each reported once, as any
        rejected value is): what a stranger wrote that no reader came to reject (the
        coordinator's store; batched requests)."""
        keys = [k for k in self.serving().list_keys() if holds_sealed(k)]
        rejected = []
        for i in range(0, len(keys), BATCH_KEYS):
            batch = keys[i : i + BATCH_KEYS]
            if self.store.check(batch):  # (rank 0 may delete an old metrics record meanwhile)
                raws: list[bytes | None] = list(self.store.multi_get(batch))
            else:
                raws = [self._peek(k) for k in batch]
            rejected += [
                k for k, r in zip(batch, raws) if r is not None and self._open(k, r) is None
            ]
        return rejected

    def publish_final_replication(self, committed: int | None) -> None:
        self._set(Keys.FINAL_REPLICATION, FinalReplication(committed).encode())

    def final_replication(self) -> FinalReplication | None:
        value = self._read(Keys.FINAL_REPLICATION)
        return None if value is None else FinalReplication.decode(Keys.FINAL_REPLICATION, value)

    def publish_digest(self, rank: int, digest: str) -> None:
        self._set(Keys.DIGEST.format(rank=rank), digest)

    def digest(self, rank: int) -> str | None:
        value = self._read(Keys.DIGEST.format(rank=rank))
        return None if value is None else read_text(value)

    def record_load_time(self, rank: int, seconds: float) -> None:
        self._set(Keys.LOAD_TIME.format(rank=rank), repr(seconds))

    def load_time(self, rank: int) -> float | None:
        return self._time(Keys.LOAD_TIME.format(rank=rank))

    # ------------------------------------------------------------------ a standby takes over
    def register(self, record: Registration) -> None:
        """This member's re-registration with a standby coordinator that took over (under its
        own name, or `task{i}` before it knows it)."""
        self._set(Keys.REJOIN.format(member=self.member), record.encode())

    def registered_names(self) -> list[str]:
        """Every name a re-registration is published under (one listing of the store's keys:
        a standby finds spares that joined the job after it started this way)."""
        prefix = Keys.REJOIN.format(member="")
        return [k[len(prefix) :] for k in self.serving().list_keys() if k.startswith(prefix)]

    def registration(self, name: str) -> Registration | None:
        """The re-registration published under `name` (a member, or `task{i}`)."""
        key = Keys.REJOIN.format(member=name)
        value = self._read(key)
        return None if value is None else Registration.decode(key, value)

    def publish_rebuilt(self, epoch: int) -> None:
        self._set(Keys.REBUILT, str(epoch))

    def rebuilt(self) -> bool:
        return self._present(Keys.REBUILT)

    # ------------------------------------------------------------------ stopping
    def request_preempt(self) -> None:
        self._set(Keys.PREEMPT, "1")

    def preempt_requested(self) -> bool:
        return self._present(Keys.PREEMPT)

    def publish_preempted(self, iteration: int, saved: bool, unsaved: str = "") -> None:
        self._set(Keys.PREEMPTED, Preempted(iteration, saved, unsaved).encode())

    def preempted(self) -> Preempted | None:
        value = self._read(Keys.PREEMPTED)
        return None if value is None else Preempted.decode(Keys.PREEMPTED, value)

    def request_shutdown(self) -> None:
        self._set(Keys.SHUTDOWN, "1")
        self.wake_spares()

    def shutdown_requested(self) -> bool:
        return self._present(Keys.SHUTDOWN)

    # ------------------------------------------------------------------ nodes' agents
    def announcement(self, member: str) -> Announcement | None:
        """Where `member` runs: its host and OS pid (`announce`)."""
        key = Keys.READY.format(member=member)
        value = self._read(key)
        return None if value is None else Announcement.decode(key, value)

    def number_agent_nodes_from(self, first: int) -> None:
        """Agents that join the running job number their nodes from `first` (once)."""
        if self.store.add(Keys.AGENTS_NEXT, 0) == 0:
            self.store.add(Keys.AGENTS_NEXT, first)

    def claim_agent_node(self) -> int:
        """A node number of its own for an agent that joins the running job."""
        return self.store.add(Keys.AGENTS_NEXT, 1) - 1

    def agent_beat(self, node: int) -> None:
        """One beat of node `node`'s agent."""
        self.store.add(Keys.AGENT_BEAT.format(node=node), 1)

    def agent_beat_count(self, node: int) -> int:
        """Node `node`'s agent's beat counter (0: never beat), in one request."""
        return self.store.add(Keys.AGENT_BEAT.format(node=node), 0)

    def order_respawn(self, node: int, order: RespawnOrder) -> None:
        """Give node `node`'s agent its next order."""
        n = self.store.add(Keys.AGENT_ORDERS.format(node=node), 1)
        self._set(Keys.AGENT_ORDER.format(node=node, n=n), order.encode())

    def respawn_orders(self, node: int, seen: int) -> tuple[int, list[RespawnOrder]]:
        """Node `node`'s orders after the first `seen`: how many were read now, and those that
        arrived (`_numbered`)."""
        count, values = self._numbered(
            Keys.AGENT_ORDERS.format(node=node),
            lambda n: Keys.AGENT_ORDER.format(node=node, n=n),
            seen,
        )
        return count, [RespawnOrder.decode(key, value) for key, value in values]

    def set_respawn_history(self, node: int, history: RespawnHistory) -> None:
        """Node `node`'s respawns so far, for a coordinator that took the job over."""
        key = Keys.AGENT_RESPAWNS.format(node=node)
        self._set(key, history.encode())

    def respawn_history(self, node: int) -> RespawnHistory | None:
        """Node `node`'s respawns under earlier coordinators, if its agent wrote them here."""
        key = Keys.AGENT_RESPAWNS.format(node=node)
        value = self._read(key)
        return None if value is None else RespawnHistory.decode(key, value)

    def report_exit(self, exit: ProcessExit) -> None:
        """An agent saw a process it started exit (the coordinator need not wait for its
        silence)."""
        n = self.store.add(Keys.AGENT_EXITS, 1)
        self._set(Keys.AGENT_EXIT.format(n=n), exit.encode())

    def process_exits(self, seen: int) -> tuple[int, list[ProcessExit]]:
        """The exits the agents reported after the first `seen` (`_numbered`)."""
        count, values = self._numbered(
            Keys.AGENT_EXITS, lambda n: Keys.AGENT_EXIT.format(n=n), seen
        )
        return count, [ProcessExit.decode(key, value) for key, value in values]

    def _numbered(
        self, counter: str, key_of: Callable[[int], str], seen: int
    ) -> tuple[int, list[tuple[str, bytes]]]:
        """The values numbered by `counter` after the first `seen`: how many were read now,
        and (key, opened value) of those that arrived. A number given out and not written yet
        is read the next time, unless a later one is written (a stranger's bump of the counter
        holds nothing up); a forged value is dropped, and logged."""
        numbers = numbers_to_read(seen, self.store.add(counter, 0), set())  # `numbered.py`
        raws = [(n, self._peek(key_of(n))) for n in numbers]
        while raws and raws[-1][1] is None:  # not written yet
            raws.pop()
        opened = [(key_of(n), None if r is None else self._open(key_of(n), r)) for n, r in raws]
        return (raws[-1][0] if raws else seen), [(k, v) for k, v in opened if v is not None]

    # ------------------------------------------------------------------ out of redundancy
    def mark_salvaged(self, rank: int) -> None:
        self._set(Keys.SALVAGED.format(rank=rank), "1")

    def all_salvaged(self, ranks: list[int]) -> bool:
        return self._all_present([Keys.SALVAGED.format(rank=r) for r in ranks])


def host_store(
    host: str,
    port: int,
    timeout_s: float = 300.0,
    keepalive_s: float | None = None,
    on_listen: Callable[[int], None] = lambda port: None,
) -> dist.TCPStore:
    """Host the job's store listening on `host` only (torch's own server binds every interface).

    Port 0 picks a free port (`store.port`). `keepalive_s`: a connection whose host has not
    answered for that long is dropped (`store_files.keep_alive`; None: never). `on_listen`:
    called with the port as soon as it listens, before torch's server and the store's own
    client start (`SilentConnections.watch`: from that moment anyone may connect). The listening
    socket is handed to torch, which closes it when the store goes: Python's socket object is
    detached, so that its own close cannot hit the same descriptor number a second time - by then
    possibly another socket's (a race seen as EBADF on an unrelated socket's close).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if keepalive_s is not None:
            keep_alive(sock, keepalive_s)
        sock.bind((host, port))
        sock.listen(1024)
        listening = sock.getsockname()[1]
        on_listen(listening)
        store = dist.TCPStore(
            host,
            listening,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # torch's server owns the descriptor now
    return store
