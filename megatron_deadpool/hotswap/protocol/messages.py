"""The job's wire messages: every value DeadPool puts in the coordinator's store, as a type.

Each structured value is a frozen dataclass (a `codec.Message`) with one `encode()` and one
`decode(key, raw)`, which checks every field - its type, then the message's own ranges and
relations (`validate`) - and raises `ProtocolError` naming the key and the value when it
cannot read it: no reader ever guesses a message's kind from which fields a dict has, and no
number from the store is used unchecked. `Keys` holds every key template (NVRx's
`inprocess/store.py` is the model), each documented under its template: who writes it, who
reads it, whether it is sealed, how long it is kept. The role views over `sealed_store` (the
worker's, the coordinator's, an agent's: `store_view.py` and its subclasses) are the only code
that reads or writes the store, and they do so with these types. The words are those of
`docs/glossary.md`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ...replication.placement import Layout, RankOrder
from .codec import Message, ProtocolError, require

__all__ = ["Keys", "ProtocolError"]  # and the messages below


class Keys:
    """Every key template of the job's store (format with `.format(...)`), documented once, here.

    Under each template: what its value is (the message type of a structured value in
    CamelCase, `messages.py`), then one line `KIND | writes: WHO | reads: WHO | kept: HOW LONG`.
    KIND is `sealed` (a value sealed with the job's secret, `seal.py`: a value that is not the
    job's is treated as absent), `counter` (`add`: it cannot carry a MAC, and only ever wakes or
    hurries a reader of sealed values), `queue` or `torch` (torch's own rendezvous keys). A
    member is `a{r}` (the initial active of rank r) or `s{i}` (spare i); g is a generation (0 at
    start, +1 per planned recovery). What "kept" means - which keys are deleted, and when - is
    `retention.py`'s: "its generation" is until generation g + 2 is complete, "its member" as
    long as the generation that planned for the member's death. The role views
    read and write them (`store_view.py`, `worker_view.py`, `coordinator_view.py`,
    `agent_view.py`); docs/reference/store-keys.md is generated from these docstrings.
    """

    TOKEN = "job/token"
    """Proof that the store serves this job: a value sealed with the job's secret (the secret
    itself is never stored); a process whose secret cannot open it is refused.

    sealed | writes: the coordinator (a standby as it takes over) | reads: every process as it
    connects, a standby probing its peers | kept: the job's life (a standby that does not take
    over after all deletes its own)"""
    LAYOUT = "job/layout"
    """LayoutRecord: the parallel layout.

    sealed | writes: rank 0 of generation 0 (a standby's rebuild again) | reads: the coordinator
    | kept: the job's life"""
    COORDINATOR = "coordinator"
    """CoordinatorIdentity: who serves this store - epoch 0 the primary, i the standby at entry
    i of --deadpool-coordinator once it took over. Set before job/token: a store without the
    token serves no job (yet).

    sealed | writes: the coordinator | reads: workers and agents failing over to a standby |
    kept: the job's life"""
    READY = "proc/{member}/ready"
    """Announcement: the member's host, OS pid and agent's node, once it connected.

    sealed | writes: the member | reads: the coordinator (joined spares), the nodes' agents |
    kept: its member"""
    HEARTBEAT = "hb/{member}"
    """The member's newest beat number (0 before the first), set, not added, so that a
    stranger's add cannot beat for a hung process: a value that is not the job's or a number
    below one seen before is no beat (`SealedStore.beat_number`). No clock travels: the
    coordinator times each new number on its own monotonic clock (`heartbeats.py`), so clock
    skew between hosts cannot make a live process look hung.

    sealed | writes: the member's heartbeat thread; the coordinator creates it at 0 | reads:
    the coordinator | kept: its member"""
    INBOX = "coord/inbox"
    """Wake-ups for the coordinator (a report it waits for is complete): it blocks on the
    queue instead of polling.

    queue | writes: a process whose report completes what the coordinator waits for | reads:
    the coordinator | kept: until popped"""
    SPARE_EPOCH = "spares/epoch"
    """The number of events waiting spares must look at (a roster, the shutdown).

    counter | writes: the coordinator (a launcher's shutdown too) | reads: waiting spares, the
    coordinator's pruning | kept: the job's life"""
    SPARE_EPOCH_N = "spares/epoch/{n}"
    """Appears with event n: waiting spares block on the next one instead of polling.

    sealed | writes: whoever counted event n in spares/epoch | reads: waiting spares | kept:
    until the roster after the next one"""
    SPARES_NEXT = "spares/next"
    """The number of the next spare member s{i}, set to the job's initial spares by the
    coordinator; a process that joins a running job (`--deadpool-join`) takes its name from it.
    A joined spare counts once its sealed announcement (proc/{member}/ready) is there, so
    bumping the counter gives a stranger nothing.

    counter | writes: the coordinator and the nodes' agents (numbering from), joining
    processes (taking a name) | reads: the coordinator, the nodes' agents | kept: the job's
    life"""
    GENERATION = "gen"
    """The newest generation with a published roster.

    sealed | writes: the coordinator | reads: every process | kept: the job's life"""
    ROSTER = "gen{g}/roster"
    """Roster: which member fills which rank, the restore iteration.

    sealed | writes: the coordinator | reads: every worker, the nodes' agents, launchers |
    kept: its generation (generation 0's for good)"""
    LATEST_PLAN = "plan/latest"
    """The newest planned generation (a recovery, or the end out of redundancy): a survivor's
    plan watch aborts its groups when it passes the survivor's generation.

    sealed | writes: the coordinator | reads: the workers' plan watch | kept: the job's life"""
    PLAN_WAKE = "gen{g}/wake/{member}"
    """Appears with plan g for each member of the roster the survivors joined: a survivor's
    plan waiter (`worker/plan_waiter.py`) blocks on its own key of the generation after the one
    it joined and so sees the plan within a store round trip (the driver then stops it:
    `plan_waiter.PlanStop`); the member sets it itself to end its waiter. Only its existence is
    read.

    sealed | writes: the coordinator (right after the plan and the spares' wake-up, one batched
    request per `BATCH_KEYS`), the member (ending its waiter) | reads: the member's plan waiter
    | kept: its generation"""
    PLAN = "gen{g}/plan"
    """Plan: dead and needy ranks, the slots that change from roster `base`.

    sealed | writes: the coordinator | reads: survivors and newcomers | kept: its generation"""
    HOLDINGS = "gen{g}/holdings/{rank}"
    """HoldingsReport: a survivor's verified snapshots and replicas, its last completed step,
    the job's own fields.

    sealed | writes: the survivor of `rank` | reads: the coordinator, a newcomer inheriting the
    job's fields | kept: its generation"""
    HOLDINGS_COUNT = "gen{g}/holdings/count"
    """The number of those reports; once the coordinator planned g, less the reports it waits
    for (`expect_reports`): the report that brings it to 0 is the last one, and wakes the
    coordinator.

    counter | writes: survivors (+1), the coordinator (-expected) | reads: the coordinator |
    kept: its generation"""
    DECIDED = "gen{g}/decided"
    """Decision on plan g, which survivors block on: the roster (with its restore iteration),
    out of redundancy, or superseded by a newer plan.

    sealed | writes: the coordinator | reads: survivors | kept: its generation"""
    SOURCES = "gen{g}/sources"
    """Sources: needy rank -> holder, for the restore iteration.

    sealed | writes: the coordinator | reads: newcomers and the holders | kept: its
    generation"""
    CLAIM = "gen{g}/ready/{rank}"
    """`ready`: the newcomer of a needy rank claimed its slot, its objects built, as it joins;
    `lost`: the coordinator gave the slot up first (the newcomer died before claiming it);
    `moved on`: the generation will not be joined (a newer plan came first) and the live
    newcomer takes its slot in the next one. Survivors wait for these before joining, so that
    none waits in a rendezvous for a newcomer that will never come. Set by compare-and-set:
    the first of the newcomer and the coordinator wins.

    sealed | writes: the newcomer, or the coordinator | reads: survivors, the coordinator |
    kept: its generation"""
    STAMP = "gen{g}/{phase}/{rank}"
    """The wall time `rank` reached a phase of generation g: claimed (a newcomer, its objects
    built: its slot), joined, restored, first_iteration (rank 0 only).

    sealed | writes: the rank | reads: the coordinator | kept: its generation"""
    STAMP_COUNT = "gen{g}/{phase}/count"
    """How many ranks stamped the phase.

    counter | writes: the ranks, with their stamps | reads: the coordinator | kept: its
    generation"""
    STALE_REFS = "gen{g}/stale_refs"
    """Old-generation group handles ranks found left after rebinding (must stay 0): a hint
    only, which the ranks' gen{g}/stale_refs/{rank} confirm (a stranger's add to it is
    rejected, and reported, where they do not).

    counter | writes: a rank that found some | reads: the coordinator | kept: its generation"""
    STALE_REF = "gen{g}/stale_refs/{rank}"
    """How many old-generation group handles the rank found left after rebinding into
    generation g (written only when some are: the rank then ends with an error).

    sealed | writes: the rank | reads: the coordinator | kept: its generation"""
    REPAIR_HANDLES = "gen{g}/repair/{rank}"
    """RepairHandles: the rank's reconfigure handles of its groups and the generation they were
    created in (`group_repair.py`); or `REPAIR_ABANDONED`, written by the coordinator for a rank
    lost before it published them, once a later plan superseded generation g. Both by
    compare-and-set: the first value written stays.

    sealed | writes: the rank; the coordinator | reads: the other ranks of the repair | kept: its
    generation"""
    PROCESS_GROUPS = "gen{g}"
    """The prefix of torch's own rendezvous keys of generation g's process groups
    (`process_group_store`).

    torch | writes: torch, in every rank | reads: torch, in every rank | kept: its
    generation"""
    OUT_OF_REDUNDANCY = "out_of_redundancy"
    """OutOfRedundancy: why memory cannot recover, what is lost, what survivors save.

    sealed | writes: the coordinator | reads: every worker, launchers | kept: the job's life"""
    FAILURES = "failures"
    """Survivors that saw a collective fail (the coordinator then suspects silent ranks sooner
    than the heartbeat timeout).

    counter | writes: survivors | reads: the coordinator | kept: the job's life"""
    FAILURE = "failure/{member}"
    """FailureReport: what the survivor saw fail, numbered by `failures`.

    sealed | writes: the survivor | reads: the coordinator | kept: its member"""
    LATEST_FAILURE = "failure_latest"
    """FailureReport: the newest survivor's report, which confirms a move of `failures` when its
    number is within the move (a stranger's add, sealed by nobody, opens no suspicion).

    sealed | writes: survivors | reads: the coordinator | kept: the job's life"""
    ERRORS = "errors"
    """Processes that ended with an error of their own: the numbers of error/{number}. Only
    hands numbers out: a writer takes the first empty one from it (`SealedStore.append`: a
    number below 1 or already written moves it on), and the reader reads past a counter moved
    back or far ahead (`numbered.py`).

    counter | writes: those processes | reads: the coordinator | kept: the job's life"""
    ERROR = "error/{number}"
    """ErrorReport n: who, in which phase, the exception and the end of its traceback (a
    process that dies by a signal reports nothing). Written only where no value is, with its
    own number inside.

    sealed | writes: the process, numbered by `errors` | reads: the coordinator | kept: the
    job's life"""
    JOB_ERROR = "job_error"
    """JobError: the coordinator's verdict that a failure is the job's own error (no spare
    takes the slots; the job ends).

    sealed | writes: the coordinator | reads: workers, launchers | kept: the job's life"""
    FINISHED = "finished/{rank}"
    """The iteration the rank finished training at (replicated).

    sealed | writes: the rank (a standby's rebuild again) | reads: - (the record;
    training/complete is what is read) | kept: the job's life"""
    TRAINING_COMPLETE = "training/complete"
    """The iteration training completed at (every rank's last step done and replicated: a later
    loss needs no recomputation).

    sealed | writes: every rank as it finishes | reads: the coordinator | kept: the job's
    life"""
    END = "end"
    """EndReport: members lost after training completed, who writes their final state.

    sealed | writes: the coordinator | reads: every worker | kept: the job's life"""
    FAULT = "fault/{member}"
    """The wall time an injected fault struck the member.

    sealed | writes: the member | reads: the coordinator, benchmarks | kept: the job's life"""
    FAULT_FIRED = "fault/fired/{index}/{who}"
    """How often fault spec `index` fired for rank or member `who` (it fires once per job).

    counter | writes: the members a fault spec names | reads: those members, benchmarks |
    kept: the job's life"""
    FAULT_GENERATION = "fault/generation/{index}"
    """The generation in which node fault spec `index` first struck: it strikes the ranks of its
    node in that generation only (a spare that took one of them later runs on another node).

    sealed | writes: the first rank of the node to reach the fault | reads: the node's ranks |
    kept: the job's life"""
    NODE_LOST = "node_lost/{member}"
    """A node fault took the node `member` ran on (local launchers).

    sealed | writes: the member | reads: local launchers, the nodes' agents | kept: the job's
    life"""
    PROGRESS = "progress/last"
    """Progress: the newest iteration rank 0 completed, its generation, the committed iteration
    then, the replica bytes per iteration.

    sealed | writes: rank 0 (a standby's rebuild again) | reads: the coordinator, workers'
    fault injection, launchers | kept: the job's life"""
    METRICS = "metrics/g{g}/{iteration}"
    """IterationRecord: rank 0's record of iteration `iteration` in generation g.

    sealed | writes: rank 0 | reads: the local launcher's progress display | kept: the newest
    `RETAINED_ITERATIONS` of its generation, and its generation"""
    FINAL_REPLICATION = "replication/final"
    """FinalReplication: the committed iteration at the end of training.

    sealed | writes: rank 0 | reads: the local launcher | kept: the job's life"""
    DIGEST = "digest/{rank}"
    """The rank's final digest of parameters and buffers.

    sealed | writes: the rank | reads: the coordinator's host, launchers | kept: the job's
    life"""
    DONE = "done/{member}"
    """The wall time the member finished its work.

    sealed | writes: the member (a standby's rebuild again) | reads: the coordinator | kept:
    its member"""
    DONE_COUNT = "done/count"
    """How many members finished their work (a hint: the done/ stamps decide).

    counter | writes: the members, with their stamps | reads: the coordinator | kept: the job's
    life"""
    PREEMPT = "preempt"
    """Stop after the current iteration.

    sealed | writes: a launcher, the coordinator's host | reads: the workers | kept: the job's
    life"""
    PREEMPTED = "preempted"
    """Preempted: where training stopped on purpose.

    sealed | writes: rank 0 | reads: launchers | kept: the job's life"""
    CHECKPOINT_FAILURES = "checkpoint/failures"
    """CheckpointFailures: the embedded job's periodic checkpoints that could not be written (a
    full disk), each one's line.

    sealed | writes: rank 0 | reads: rank 0, the local launcher | kept: the newest
    `RETAINED_CHECKPOINT_FAILURES` lines"""
    JOB_STATUS = "job/status"
    """JobStatus: spares waiting, recoveries, respawns, shards short of replicas, standbys (for
    the ranks' TensorBoard/W&B scalars).

    sealed | writes: the coordinator | reads: the ranks, launchers | kept: the job's life"""
    LOAD_TIME = "load/{rank}"
    """Seconds the rank took to load a persistent checkpoint.

    sealed | writes: the rank | reads: benchmarks | kept: the job's life"""
    SALVAGED = "salvaged/{rank}"
    """The rank wrote its part of the out-of-redundancy snapshot set.

    sealed | writes: the rank | reads: the coordinator | kept: the job's life"""
    SHUTDOWN = "shutdown"
    """Waiting spares leave.

    sealed | writes: a launcher, the coordinator's host | reads: waiting spares, the nodes'
    agents, a standby | kept: the job's life"""
    REJOIN = "rejoin/{member}"
    """Registration: a member's re-registration with a standby that took over; task{i} for a
    process that does not know its member name yet (task i: actives first, then spares).

    sealed | writes: every process that lost the coordinator | reads: the standby | kept: the
    job's life (a standby that does not take over after all deletes those it got)"""
    REBUILT = "rebuilt"
    """The standby rebuilt the job's state from the re-registrations.

    sealed | writes: the standby | reads: the processes re-registering, a standby taking over |
    kept: the job's life"""
    AGENTS_NEXT = "agents/next"
    """The number of the next node whose agent joins the running job, set to the job's initial
    node count by the coordinator.

    counter | writes: the coordinator, joining agents | reads: joining agents | kept: the job's
    life"""
    AGENT_BEAT = "agent/{node}/hb"
    """Node `node`'s agent's newest beat number (`deadpool agent`), as hb/{member} holds a
    process's.

    sealed | writes: the agent | reads: the coordinator | kept: the job's life"""
    AGENT_ORDERS = "agent/{node}/orders"
    """How many orders the coordinator gave that node's agent: the numbers of its orders, handed
    out as errors hands out the error reports' (`SealedStore.append`, `numbered.py`).

    counter | writes: the coordinator | reads: the agent | kept: the job's life"""
    AGENT_ORDER = "agent/{node}/order/{n}"
    """RespawnOrder n: start a process there in a failed one's place (written only where no
    value is).

    sealed | writes: the coordinator | reads: the agent | kept: the job's life"""
    AGENT_RESPAWNS = "agent/{node}/respawns"
    """RespawnHistory: the node's respawns so far, for a coordinator that took the job over.

    sealed | writes: the agent | reads: the coordinator | kept: the job's life"""
    AGENT_EXITS = "agents/exits"
    """How many exits the agents saw: the numbers of their reports, handed out as errors hands
    out the error reports' (`SealedStore.append`, `numbered.py`).

    counter | writes: the agents | reads: the coordinator | kept: the job's life"""
    AGENT_EXIT = "agents/exit/{n}"
    """ProcessExit n: a process an agent started ended, with its code (written only where no
    value is).

    sealed | writes: the agents | reads: the coordinator | kept: the job's life"""

    UNSEALED = (
        INBOX,
        SPARE_EPOCH,
        SPARES_NEXT,
        HOLDINGS_COUNT,
        STAMP_COUNT,
        STALE_REFS,
        FAILURES,
        ERRORS,
        DONE_COUNT,
        FAULT_FIRED,
        PROCESS_GROUPS,
        AGENTS_NEXT,
        AGENT_ORDERS,
        AGENT_EXITS,
    )
    """What holds no sealed value (`seal.py`): the counters (`add` cannot carry a MAC), the
    coordinator's wake-up queue, and torch's rendezvous keys under `gen{g}/`."""


_FIELD = {"member": r"[a-z]+\d+", "phase": r"[a-z_]+", "who": r"[^/]+"}
"""What a template's field matches (any other field: a number)."""


def _pattern(template: str) -> str:
    parts = re.split(r"\{(\w+)\}", template)  # text, field, text, field, ..., text
    return "".join(
        re.escape(p) if i % 2 == 0 else _FIELD.get(p, r"\d+") for i, p in enumerate(parts)
    )


_SEALED = re.compile(
    "|".join(
        _pattern(t)
        for name, t in vars(Keys).items()
        if name.isupper() and isinstance(t, str) and t not in Keys.UNSEALED
    )
)


def holds_sealed(key: str) -> bool:
    """Whether `key` is one of the job's keys that hold a sealed value (a torch rendezvous key
    that happens to look like one may match too)."""
    return _SEALED.fullmatch(key) is not None


CLAIMED = "ready"
"""`gen{g}/ready/{rank}`: the newcomer claimed its slot."""
GIVEN_UP = "lost"
"""`gen{g}/ready/{rank}`: the coordinator gave the slot up (the newcomer was lost first)."""
MOVED_ON = "moved on"
"""`gen{g}/ready/{rank}`: generation g will not be joined (a newer plan came first)
before this live newcomer claimed its slot: it takes its slot in the next generation instead."""
WAKE = "wake"
"""What a process pushes into the coordinator's inbox (the content is never read)."""
REPAIR_ABANDONED = "abandoned"
"""`gen{g}/repair/{rank}`: rank lost before it published its reconfigure handles, and a later
plan superseded generation g: whoever waits for them there stops waiting (its repair fails)."""


# ---------------------------------------------------------------------- reading fields


def is_member(name: object) -> bool:
    """Whether `name` names a member: `a{r}` or `s{i}`."""
    return isinstance(name, str) and len(name) > 1 and name[0] in "as" and name[1:].isdigit()


def member_of(task: int, world_size: int) -> str:
    """The member name of task index `task`: actives first (ranks 0..W-1), then spares."""
    return f"a{task}" if task < world_size else f"s{task - world_size}"


def task_of(member: str, world_size: int) -> int:
    """The task index of member `member` (`member_of`'s inverse)."""
    return int(member[1:]) + (world_size if member.startswith("s") else 0)


def _ranks(values: Any, what: str) -> None:
    require(all(r >= 0 for r in values), f"{what}: a rank below 0")


def _slots(slots: dict[int, str], what: str = "slots") -> None:
    _ranks(slots, what)
    require(all(is_member(m) for m in slots.values()), f"{what}: a value is not a member name")


# ---------------------------------------------------------------------- the job
@dataclass(frozen=True)
class LayoutRecord(Message):
    """`job/layout`: the parallel layout rank 0 publishes, as the coordinator learns it."""

    tp: int
    pp: int
    dp: int
    ranks_per_node: int
    replicas: int
    order: RankOrder = RankOrder.TP_DP_PP
    """Megatron's rank order (absent in a record of a release before it: the default)."""
    ep: int = 1
    """Expert-model-parallel size (absent before expert parallelism was supported: 1)."""
    etp: int | None = None
    """Expert-tensor-parallel size; None: tp."""
    cp: int = 1
    """Context-parallel size (absent before context parallelism was supported: 1)."""

    def validate(self) -> None:
        require(
            min(self.tp, self.pp, self.dp, self.ranks_per_node, self.replicas, self.ep, self.cp)
            >= 1,
            "sizes >= 1",
        )
        require(self.etp is None or self.etp >= 1, "etp >= 1")

    @classmethod
    def of(cls, layout: Layout, replicas: int) -> LayoutRecord:
        """The record of `layout` with k = `replicas`."""
        return cls(
            layout.tp,
            layout.pp,
            layout.dp,
            layout.ranks_per_node,
            replicas,
            layout.order,
            layout.ep,
            layout.etp,
            layout.cp,
        )

    def layout(self) -> Layout:
        return Layout(
            self.tp, self.pp, self.dp, self.ranks_per_node, self.order, self.ep, self.etp, self.cp
        )


@dataclass(frozen=True)
class CoordinatorIdentity(Message):
    """`coordinator`: who serves this store - epoch 0 the primary, i the standby at entry i of
    `--deadpool-coordinator` once it took over - and an id, one per coordinator process."""

    epoch: int
    id: str

    def validate(self) -> None:
        require(self.epoch >= 0, "epoch below 0")


@dataclass(frozen=True)
class Announcement(Message):
    """`proc/{member}/ready`: a member connected, from this host and OS process, on the node
    whose agent started it (`AGENT_NODE_ENV`; -1: started by no agent)."""

    host: str
    os_pid: int
    node: int = -1


AGENT_NODE_ENV = "DEADPOOL_NODE"
"""The job's number of the node whose agent (`deadpool agent`) started this process."""


# ---------------------------------------------------------------------- generations
@dataclass(frozen=True)
class Roster(Message):
    """`gen{g}/roster`: generation g's world - which member fills which rank - and, after a
    recovery, the iteration every rank restores."""

    generation: int
    world_size: int
    slots: dict[int, str]
    restore_iteration: int | None = None

    def validate(self) -> None:
        require(self.generation >= 0 and self.world_size >= 1, "generation or world size too small")
        require(all(r < self.world_size for r in self.slots), "a slot beyond the world size")
        _slots(self.slots)

    def rank_of(self, member: str) -> int | None:
        for rank, m in self.slots.items():
            if m == member:
                return rank
        return None

    def successor(self, plan: Plan, restore_iteration: int | None) -> Roster | None:
        """The roster `plan` (built on this one) leads to, without reading it from the store;
        None when the plan is built on another roster."""
        if plan.base != self.generation:
            return None
        slots = {**self.slots, **plan.replaced}
        return Roster(plan.generation, self.world_size, slots, restore_iteration)


@dataclass(frozen=True)
class Plan(Message):
    """`gen{g}/plan`: a recovery the coordinator planned - the ranks that died, the needy ranks
    (whose state must come from a holder) and the slots that change from roster `base`."""

    generation: int
    base: int
    world_size: int
    dead: tuple[int, ...]
    needy: tuple[int, ...]
    replaced: dict[int, str]

    def validate(self) -> None:
        require(self.generation > self.base >= 0, "a plan's generation follows its base")
        _ranks(self.dead + self.needy, "dead or needy")
        _slots(self.replaced, "replaced")


class Verdict(str, Enum):
    """What the coordinator decided on a plan."""

    ROSTER = "roster"
    """Agreed: the plan's roster, restoring `Decision.restore_iteration`."""
    OUT_OF_REDUNDANCY = "out_of_redundancy"
    """Memory cannot recover: read `out_of_redundancy`, save what survives, stop."""
    SUPERSEDED = "superseded"
    """More ranks died: the plan of generation `Decision.superseded_by` replaces this one."""


@dataclass(frozen=True)
class Decision(Message):
    """`gen{g}/decided`: the coordinator's decision on plan g, which survivors block on."""

    verdict: Verdict
    restore_iteration: int | None = None
    superseded_by: int | None = None

    def validate(self) -> None:
        if self.verdict is Verdict.ROSTER:
            t = self.restore_iteration
            require(t is not None and t >= 0, "a roster decision needs its restore iteration")
        if self.verdict is Verdict.SUPERSEDED:
            g = self.superseded_by
            require(g is not None and g >= 1, "superseded needs the generation that supersedes")

    @classmethod
    def roster(cls, restore_iteration: int) -> Decision:
        return cls(Verdict.ROSTER, restore_iteration=restore_iteration)

    @classmethod
    def superseded(cls, generation: int) -> Decision:
        return cls(Verdict.SUPERSEDED, superseded_by=generation)

    @classmethod
    def out_of_redundancy(cls) -> Decision:
        return cls(Verdict.OUT_OF_REDUNDANCY)


@dataclass(frozen=True)
class HoldingsReport(Message):
    """`gen{g}/holdings/{rank}`: a survivor's report for a recovery - the verified iterations
    it holds ("local": its own snapshots; "{owner}": replicas it holds), the last step it
    completed, and the job's own fields (`JobAdapter.recovery_report`, opaque here)."""

    member: str
    last_completed: int
    holds: dict[str, tuple[int, ...]]
    job: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        require(is_member(self.member), f"{self.member!r} is not a member name")
        require(self.last_completed >= 0, "last_completed below 0")
        owners = [k for k in self.holds if k != "local"]
        require(all(k.isdigit() for k in owners), "holds: an owner is neither 'local' nor a rank")


def decode_holdings(keys: list[str], raws: list[bytes]) -> list[HoldingsReport]:
    """Many reports at once: one JSON parse of them all (half the CPU of one parse each,
    measured at 16,384 reports: 31 ms against 68 ms); a bad one is named by its key."""
    try:
        parsed = json.loads(b"[" + b",".join(raws) + b"]")
    except ValueError:  # find the culprit, and name it
        return [HoldingsReport.decode(k, r) for k, r in zip(keys, raws)]
    return [HoldingsReport.from_data(k, r, d) for k, r, d in zip(keys, raws, parsed)]


@dataclass(frozen=True)
class Sources(Message):
    """`gen{g}/sources`: needy rank -> the holder that sends it its shard of the restore
    iteration (published before the roster)."""

    holders: dict[int, int]

    def validate(self) -> None:
        _ranks([*self.holders, *self.holders.values()], "holders")


# ---------------------------------------------------------------------- the end of a job
@dataclass(frozen=True)
class SaveOrder(Message):
    """What survivors write when memory cannot go on (out of redundancy, or a loss after
    training completed): the snapshot set of one iteration, and who writes the dead ranks'
    shards (needy rank -> holder)."""

    iteration: int
    sources: dict[int, int]
    complete: bool
    missing: tuple[int, ...]

    def validate(self) -> None:
        require(self.iteration >= 0, "iteration below 0")
        _ranks([*self.sources, *self.sources.values(), *self.missing], "sources or missing")


@dataclass(frozen=True)
class OutOfRedundancy(Message):
    """`out_of_redundancy`: memory cannot recover a failure (no spare left, or an owner and
    every holder of its shard lost): the dead and lost ranks, the holders of each lost shard,
    and what survivors salvage before they stop."""

    reason: str
    dead_ranks: tuple[int, ...]
    lost_ranks: tuple[int, ...]
    lost_shards_holders: dict[int, tuple[int, ...]]
    save: SaveOrder | None

    def validate(self) -> None:
        _ranks(self.dead_ranks + self.lost_ranks, "dead or lost ranks")


@dataclass(frozen=True)
class EndReport(Message):
    """`end`: members lost after training completed - nothing to recompute; the dead ranks,
    the ranks whose final state is gone with them, and who writes the others' final state."""

    reason: str
    completed_iteration: int
    dead_ranks: tuple[int, ...]
    lost_ranks: tuple[int, ...]
    save: SaveOrder

    def validate(self) -> None:
        require(self.completed_iteration >= 0, "completed_iteration below 0")
        _ranks(self.dead_ranks + self.lost_ranks, "dead or lost ranks")


@dataclass(frozen=True)
class FailureReport(Message):
    """`failure/{member}`: a survivor saw a collective fail - the report's number (reports are
    numbered in the order they reach the store), its wall time and the error's first line."""

    number: int
    time: float
    why: str

    def validate(self) -> None:
        require(self.number >= 1, "number below 1")


class Phase(str, Enum):
    """Where in its life a process was when it ended with an error (`ErrorReport`)."""

    WAITING = "waiting"
    """A spare without a slot."""
    START_UP = "start-up"
    """It holds a slot, and no iteration of its own was replicated yet: arguments, imports,
    data, initialisation, the first steps (a newcomer: its build, before it took the slot)."""
    TRAINING = "training"
    RECOVERY = "recovery"
    """Between a failed collective and its restore."""
    AFTER_TRAINING = "after training"
    """Training completed (its last step done and replicated): the final save, evaluation."""


@dataclass(frozen=True)
class ErrorReport(Message):
    """`error/{number}`: a process ends with an exception no recovery accounts for (not a
    peer's failure, not one of DeadPool's own verdicts): who, where in its life, the exception's
    type and first line, and the last lines of its traceback. Numbered in the order reports
    reach the store (`errors` counts them; the number is the store's, set as it is reported).
    A process that dies by a signal reports nothing: its death stays a failure to hot-swap."""

    number: int
    member: str
    rank: int | None
    """The rank it held (None: a spare without a slot)."""
    generation: int
    """The generation of that rank's roster (-1: none)."""
    phase: Phase
    error: str
    """The exception's type, e.g. `FileNotFoundError`."""
    message: str
    """Its first line (empty when it says nothing)."""
    time: float
    tail: tuple[str, ...] = ()
    """The last lines of its traceback."""

    def validate(self) -> None:
        require(self.number >= 1, "number below 1")
        require(is_member(self.member), f"{self.member!r} is not a member name")
        require(self.rank is None or self.rank >= 0, "rank below 0")
        require(self.generation >= -1, "generation below -1")

    def signature(self) -> tuple[Phase, str, str]:
        """What makes two errors the same error: phase, type and first line."""
        return self.phase, self.error, self.message

    def cause(self) -> str:
        """One line: `rank 2 start-up: FileNotFoundError: ...` (a spare: its member name)."""
        who = f"rank {self.rank}" if self.rank is not None else f"spare {self.member}"
        what = f"{self.error}: {self.message}" if self.message else self.error
        return f"{who} {self.phase.value}: {what}"


@dataclass(frozen=True)
class JobError(Message):
    """`job_error`: the coordinator's verdict that a failure is the job's own error, not a lost
    process - a rank failed before replication started, or a newcomer failed as the member it
    replaced did: the report that names the error, why it is the job's, and the ranks that
    died with it. No spare takes their slots; the job ends (exit code 9)."""

    reason: str
    report: ErrorReport
    dead_ranks: tuple[int, ...]

    def validate(self) -> None:
        _ranks(self.dead_ranks, "dead ranks")


@dataclass(frozen=True)
class IterationRecord(Message):
    """`metrics/g{g}/{iteration}`: rank 0's record of one iteration of the embedded job (the
    launcher's progress line and JSON log)."""

    iteration: int
    time: float
    loss: float
    grad_norm: float | None
    lr: float
    iter_time_s: float
    replication_s: float
    generation: int
    committed_iteration: int | None
    replica_bytes_sent: int
    replication_parts_s: dict[str, float]

    def validate(self) -> None:
        require(self.iteration >= 1 and self.generation >= 0, "iteration or generation too small")


@dataclass(frozen=True)
class Progress(Message):
    """`progress/last`: the newest iteration rank 0 completed (any job: the driver writes it
    after every step), in which generation, the globally committed iteration then and the bytes
    of replicas rank 0 sends per iteration - what a metrics file reports when the job publishes
    no `IterationRecord` (Megatron-LM)."""

    iteration: int
    generation: int = 0
    committed_iteration: int | None = None
    replica_bytes: int = 0

    def validate(self) -> None:
        require(min(self.iteration, self.generation, self.replica_bytes) >= 0, "a count below 0")


@dataclass(frozen=True)
class FinalReplication(Message):
    """`replication/final`: the globally committed iteration at the end of training."""

    committed_iteration: int | None


@dataclass(frozen=True)
class Preempted(Message):
    """`preempted`: where training stopped on purpose (SIGTERM, the launcher's request), and
    whether a checkpoint was saved there."""

    iteration: int
    saved: bool
    unsaved: str = ""
    """Why a checkpoint was to be saved there and was not (a full disk): the one line."""


@dataclass(frozen=True)
class JobStatus(Message):
    """`job/status`: what the coordinator knows of the job's redundancy, for the ranks' scalars
    (Megatron's TensorBoard/W&B writers): spares waiting, recoveries and in-place respawns so
    far, standby coordinators configured and reachable, the shards short of replicas. Rewritten at each event that changes
    it (`job_status.py`)."""

    spares_available: int
    recoveries: int
    respawns: int
    standbys: int
    standbys_reachable: int
    under_replicated: int = 0
    """Shards fewer than deadpool-replicas ranks hold a copy of (`report/replica_deficit.py`),
    from the recovery agreed in `agreed_generation` until a round after its
    `restore_iteration` commits - which the ranks see first: they count 0 from then on."""
    agreed_generation: int = 0
    restore_iteration: int | None = None

    def validate(self) -> None:
        counts = (self.spares_available, self.recoveries, self.respawns, self.standbys_reachable)
        require(
            min(*counts, self.under_replicated, self.agreed_generation) >= 0
            and self.standbys_reachable <= self.standbys,
            "a count below 0, or more standbys reachable than configured",
        )


@dataclass(frozen=True)
class CheckpointFailures(Message):
    """`checkpoint/failures`: the periodic checkpoints of the embedded job or of Megatron-LM that
    could not be written (a full disk, a read-only folder), each iteration's one line."""

    lines: dict[int, str]


# ---------------------------------------------------------------------- nodes' agents
@dataclass(frozen=True)
class RespawnOrder(Message):
    """`agent/{node}/order/{n}`: the coordinator's n-th order to node `node`'s agent - start
    member `member` on that node in the place of `replaces`, which held `rank` (on its GPU,
    with its memory; it waits for its slot in the next plan, as a spare does)."""

    member: str
    replaces: str
    rank: int

    def validate(self) -> None:
        require(is_member(self.member) and is_member(self.replaces), "not a member name")
        require(self.rank >= 0, "a rank below 0")


@dataclass(frozen=True)
class ProcessExit(Message):
    """`agents/exit/{n}`: the n-th exit the nodes' agents saw - `member`, started by node
    `node`'s agent, ended with `code` (-N: killed by signal N)."""

    member: str
    code: int
    node: int

    def validate(self) -> None:
        require(is_member(self.member), "not a member name")
        require(self.node >= 0, "a node below 0")


@dataclass(frozen=True)
class RespawnHistory(Message):
    """`agent/{node}/respawns`: how long ago (seconds, as its agent wrote this) node `node`'s
    agent carried out each respawn order of the job so far - written to a standby coordinator
    that took the job over, whose respawn budget (`respawn.py`) then counts them. Ages, not
    times: no clock travels between hosts."""

    ages: tuple[float, ...]

    def validate(self) -> None:
        require(all(age >= 0 for age in self.ages), "an age below 0")


# ---------------------------------------------------------------------- a standby takes over
@dataclass(frozen=True)
class Registration(Message):
    """`rejoin/{member}`: what one member knows of the job when it re-registers with a standby
    coordinator that took over (`rebuild.py` rebuilds the job's state from these)."""

    member: str
    host: str = ""
    """hostname:OS pid of the process."""
    rank: int | None = None
    """Its rank in the newest roster it joined (None: a spare still waiting)."""
    generation: int = -1
    """The generation of that roster (-1: none)."""
    world_size: int | None = None
    slots: dict[int, str] | None = None
    """That roster's slots, rank -> member."""
    restore_iteration: int | None = None
    last_completed: int = 0
    """The last training step it completed."""
    completed: int | None = None
    """The iteration training completed at, once its last step was done and replicated."""
    done: bool = False
    """It finished its work (digest published)."""
    layout: LayoutRecord | None = None
    """The layout, once it placed replicas."""
    plan_seen: int = 0
    """The newest generation it saw planned, or reported its holdings for (a recovery whose
    decision, or newcomers' claims, it may still wait on)."""
    recovering: bool = False
    """It was inside a recovery (between a failed collective and its restore)."""

    def validate(self) -> None:
        require(is_member(self.member), f"{self.member!r} is not a member name")
        require(self.generation >= -1 and self.last_completed >= 0, "generation or step too small")
        if self.slots is not None:
            _slots(self.slots)
