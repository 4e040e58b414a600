"""The job's wire messages: every value DeadPool puts in the coordinator's store, as a type.

Each structured value is a frozen dataclass with one `encode()` (JSON text) and one
`decode(key, raw)` that checks every field it reads - its type, that a number is finite and in
range - and raises `ProtocolError` naming the key and the value when it cannot read it; no
reader ever guesses a message's kind from which fields a dict has. Scalar values (a counter, an
iteration, a wall time, a digest) are read by `read_int`, `read_float` and `read_text`, with the
same error. `Keys` holds every key template (NVRx's `inprocess/store.py` is the model);
`membership.Membership` is the only code that reads or writes the store, and it does so with
these types. The words are those of `docs/glossary.md`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, TypeVar

from ..errors import DeadpoolRuntimeError
from ..replication.placement import Layout


class ProtocolError(DeadpoolRuntimeError):
    """A store value that is not the message its key holds (the message names key and value)."""


class Keys:
    """Every key template of the job's store (format with `.format(...)`); what each holds is
    in `membership.py`'s docstring."""

    TOKEN = "job/token"
    LAYOUT = "job/layout"
    COORDINATOR = "coordinator"
    READY = "proc/{member}/ready"
    HEARTBEAT = "hb/{member}"
    INBOX = "coord/inbox"
    SPARE_EPOCH = "spares/epoch"
    SPARE_EPOCH_N = "spares/epoch/{n}"
    GENERATION = "gen"
    ROSTER = "gen{g}/roster"
    LATEST_PLAN = "plan/latest"
    PLAN = "gen{g}/plan"
    HOLDINGS = "gen{g}/holdings/{rank}"
    HOLDINGS_COUNT = "gen{g}/holdings/count"
    DECIDED = "gen{g}/decided"
    SOURCES = "gen{g}/sources"
    CLAIM = "gen{g}/ready/{rank}"
    STAMP = "gen{g}/{phase}/{rank}"
    STAMP_COUNT = "gen{g}/{phase}/count"
    STALE_REFS = "gen{g}/stale_refs"
    PROCESS_GROUPS = "gen{g}"
    OUT_OF_REDUNDANCY = "out_of_redundancy"
    FAILURES = "failures"
    FAILURE = "failure/{member}"
    FINISHED = "finished/{rank}"
    TRAINING_COMPLETE = "training/complete"
    END = "end"
    FAULT = "fault/{member}"
    FAULT_FIRED = "fault/fired/{index}/{who}"
    PROGRESS = "progress/last"
    METRICS = "metrics/g{g}/{iteration}"
    FINAL_REPLICATION = "replication/final"
    DIGEST = "digest/{rank}"
    DONE = "done/{member}"
    DONE_COUNT = "done/count"
    PREEMPT = "preempt"
    PREEMPTED = "preempted"
    LOAD_TIME = "load/{rank}"
    SALVAGED = "salvaged/{rank}"
    SALVAGE_MANIFEST = "salvage/manifest"
    SHUTDOWN = "shutdown"
    REJOIN = "rejoin/{member}"
    REBUILT = "rebuilt"


CLAIMED = "ready"
"""`gen{g}/ready/{rank}`: the newcomer claimed its slot."""
GIVEN_UP = "lost"
"""`gen{g}/ready/{rank}`: the coordinator gave the slot up (the newcomer was lost first)."""
WAKE = "wake"
"""What a process pushes into the coordinator's inbox (the content is never read)."""


# ---------------------------------------------------------------------- reading fields
def _text(raw: str | bytes) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def _fail(key: str, raw: str | bytes, what: str, why: str) -> ProtocolError:
    shown = _text(raw)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    return ProtocolError(f"store key {key}: cannot read {what} from {shown!r}: {why}")


class _Fields:
    """One JSON object's fields, each checked as it is read (errors name the key)."""

    def __init__(self, key: str, raw: str | bytes, what: str, data: Any) -> None:
        self.key, self.raw, self.what = key, raw, what
        if not isinstance(data, dict):
            raise self._error(f"expected a JSON object, got {type(data).__name__}")
        self.data: dict[str, Any] = data

    def _error(self, why: str) -> ProtocolError:
        return _fail(self.key, self.raw, self.what, why)

    def _get(self, name: str) -> Any:
        if name not in self.data:
            raise self._error(f"field {name!r} missing")
        return self.data[name]

    def integer(self, name: str, *, minimum: int | None = None) -> int:
        return self._int(name, self._get(name), minimum)

    def opt_integer(self, name: str, *, minimum: int | None = None) -> int | None:
        value = self.data.get(name)
        return None if value is None else self._int(name, value, minimum)

    def _int(self, name: str, value: Any, minimum: int | None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._error(f"field {name!r}: expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self._error(f"field {name!r}: {value} is below {minimum}")
        return value

    def number(self, name: str) -> float:
        return self._float(name, self._get(name))

    def opt_number(self, name: str) -> float | None:
        value = self.data.get(name)
        return None if value is None else self._float(name, value)

    def _float(self, name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._error(f"field {name!r}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise self._error(f"field {name!r}: {value} is not finite")
        return float(value)

    def text(self, name: str) -> str:
        value = self._get(name)
        if not isinstance(value, str):
            raise self._error(f"field {name!r}: expected text, got {value!r}")
        return value

    def boolean(self, name: str) -> bool:
        value = self._get(name)
        if not isinstance(value, bool):
            raise self._error(f"field {name!r}: expected true or false, got {value!r}")
        return value

    def ints(self, name: str, *, minimum: int | None = 0) -> tuple[int, ...]:
        value = self._get(name)
        if not isinstance(value, list):
            raise self._error(f"field {name!r}: expected a list, got {value!r}")
        return tuple(self._int(name, v, minimum) for v in value)

    def mapping(self, name: str) -> dict[str, Any]:
        value = self._get(name)
        if not isinstance(value, dict):
            raise self._error(f"field {name!r}: expected an object, got {value!r}")
        return value

    def rank_map(self, name: str, values: Callable[[str, Any], Any]) -> dict[int, Any]:
        """An object keyed by rank ("0", "1", ...): rank -> `values(name, value)`."""
        out = {}
        for k, v in self.mapping(name).items():
            if not k.isdigit():
                raise self._error(f"field {name!r}: {k!r} is not a rank")
            out[int(k)] = values(name, v)
        return out

    def rank(self, name: str, value: Any) -> int:
        return self._int(name, value, 0)

    def member(self, name: str, value: Any) -> str:
        if not isinstance(value, str) or not is_member(value):
            raise self._error(f"field {name!r}: {value!r} is not a member (a{{r}} or s{{i}})")
        return value

    def rank_list(self, name: str, value: Any) -> tuple[int, ...]:
        if not isinstance(value, list):
            raise self._error(f"field {name!r}: expected a list of ranks, got {value!r}")
        return tuple(self._int(name, v, 0) for v in value)


M = TypeVar("M")


def _decode(cls: type[M], key: str, raw: str | bytes, read: Callable[[_Fields], M]) -> M:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _fail(key, raw, cls.__name__, f"not JSON ({exc})") from None
    return read(_Fields(key, raw, cls.__name__, data))


def _ranks_json(mapping: Mapping[int, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in mapping.items()}


def read_int(key: str, raw: str | bytes, *, minimum: int | None = None) -> int:
    """A scalar integer value (an iteration, a generation, a counter's text)."""
    text = _text(raw).strip()
    try:
        value = int(text)
    except ValueError:
        raise _fail(key, raw, "an integer", "not an integer") from None
    if minimum is not None and value < minimum:
        raise _fail(key, raw, "an integer", f"below {minimum}")
    return value


def read_float(key: str, raw: str | bytes) -> float:
    """A scalar number (a wall time, seconds)."""
    try:
        value = float(_text(raw))
    except ValueError:
        raise _fail(key, raw, "a number", "not a number") from None
    if not math.isfinite(value):
        raise _fail(key, raw, "a number", "not finite")
    return value


def read_text(raw: str | bytes) -> str:
    return _text(raw)


def is_member(name: str) -> bool:
    """Whether `name` names a member: `a{r}` or `s{i}`."""
    return len(name) > 1 and name[0] in "as" and name[1:].isdigit()


# ---------------------------------------------------------------------- the job
@dataclass(frozen=True)
class LayoutRecord:
    """`job/layout`: the parallel layout rank 0 publishes, as the coordinator learns it."""

    tp: int
    pp: int
    dp: int
    ranks_per_node: int
    replicas: int

    def layout(self) -> Layout:
        return Layout(self.tp, self.pp, self.dp, self.ranks_per_node)

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> LayoutRecord:
        def read(f: _Fields) -> LayoutRecord:
            sizes = [
                f.integer(n, minimum=1) for n in ("tp", "pp", "dp", "ranks_per_node", "replicas")
            ]
            return cls(*sizes)

        return _decode(cls, key, raw, read)


@dataclass(frozen=True)
class CoordinatorIdentity:
    """`coordinator`: who serves this store - epoch 0 the primary, i the standby at entry i of
    `--deadpool-coordinator` once it took over - and an id, one per coordinator process."""

    epoch: int
    id: str

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> CoordinatorIdentity:
        return _decode(cls, key, raw, lambda f: cls(f.integer("epoch", minimum=0), f.text("id")))


@dataclass(frozen=True)
class Announcement:
    """`proc/{member}/ready`: a member connected, from this host and OS process."""

    host: str
    os_pid: int

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> Announcement:
        return _decode(cls, key, raw, lambda f: cls(f.text("host"), f.integer("os_pid", minimum=1)))


# ---------------------------------------------------------------------- generations
@dataclass(frozen=True)
class Roster:
    """`gen{g}/roster`: generation g's world - which member fills which rank - and, after a
    recovery, the iteration every rank restores."""

    generation: int
    world_size: int
    slots: dict[int, str]
    restore_iteration: int | None = None

    def rank_of(self, member: str) -> int | None:
        for rank, m in self.slots.items():
            if m == member:
                return rank
        return None

    def successor(self, plan: Plan, restore_iteration: int) -> Roster | None:
        """The roster `plan` (built on this one) leads to, without reading it from the store;
        None when the plan is built on another roster."""
        if plan.base != self.generation:
            return None
        return Roster(
            plan.generation, self.world_size, {**self.slots, **plan.replaced}, restore_iteration
        )

    def encode(self) -> str:
        return json.dumps(
            {
                "generation": self.generation,
                "world_size": self.world_size,
                "slots": _ranks_json(self.slots),
                "restore_iteration": self.restore_iteration,
            }
        )

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> Roster:
        def read(f: _Fields) -> Roster:
            return cls(
                generation=f.integer("generation", minimum=0),
                world_size=f.integer("world_size", minimum=1),
                slots=f.rank_map("slots", f.member),
                restore_iteration=f.opt_integer("restore_iteration", minimum=0),
            )

        return _decode(cls, key, raw, read)


@dataclass(frozen=True)
class Plan:
    """`gen{g}/plan`: a recovery the coordinator planned - the ranks that died, the needy ranks
    (whose state must come from a holder) and the slots that change from roster `base`."""

    generation: int
    base: int
    world_size: int
    dead: tuple[int, ...]
    needy: tuple[int, ...]
    replaced: dict[int, str]

    def encode(self) -> str:
        return json.dumps({**asdict(self), "replaced": _ranks_json(self.replaced)})

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> Plan:
        def read(f: _Fields) -> Plan:
            return cls(
                generation=f.integer("generation", minimum=1),
                base=f.integer("base", minimum=0),
                world_size=f.integer("world_size", minimum=1),
                dead=f.ints("dead"),
                needy=f.ints("needy"),
                replaced=f.rank_map("replaced", f.member),
            )

        return _decode(cls, key, raw, read)


class Verdict(str, Enum):
    """What the coordinator decided on a plan."""

    ROSTER = "roster"
    """Agreed: the plan's roster, restoring `Decision.restore_iteration`."""
    OUT_OF_REDUNDANCY = "out_of_redundancy"
    """Memory cannot recover: read `out_of_redundancy`, save what survives, stop."""
    SUPERSEDED = "superseded"
    """More ranks died: the plan of generation `Decision.superseded_by` replaces this one."""


@dataclass(frozen=True)
class Decision:
    """`gen{g}/decided`: the coordinator's decision on plan g, which survivors block on."""

    verdict: Verdict
    restore_iteration: int | None = None
    superseded_by: int | None = None

    @classmethod
    def roster(cls, restore_iteration: int) -> Decision:
        return cls(Verdict.ROSTER, restore_iteration=restore_iteration)

    @classmethod
    def superseded(cls, generation: int) -> Decision:
        return cls(Verdict.SUPERSEDED, superseded_by=generation)

    @classmethod
    def out_of_redundancy(cls) -> Decision:
        return cls(Verdict.OUT_OF_REDUNDANCY)

    def encode(self) -> str:
        return json.dumps({**asdict(self), "verdict": self.verdict.value})

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> Decision:
        def read(f: _Fields) -> Decision:
            try:
                verdict = Verdict(f.text("verdict"))
            except ValueError:
                raise f._error(f"unknown verdict {f.data['verdict']!r}") from None
            decision = cls(
                verdict,
                restore_iteration=f.opt_integer("restore_iteration", minimum=0),
                superseded_by=f.opt_integer("superseded_by", minimum=1),
            )
            if verdict is Verdict.ROSTER and decision.restore_iteration is None:
                raise f._error("a roster decision without its restore iteration")
            if verdict is Verdict.SUPERSEDED and decision.superseded_by is None:
                raise f._error("a superseded decision without the generation that supersedes")
            return decision

        return _decode(cls, key, raw, read)


@dataclass(frozen=True)
class HoldingsReport:
    """`gen{g}/holdings/{rank}`: a survivor's report for a recovery - the verified iterations
    it holds ("local": its own snapshots; "{owner}": replicas it holds), the last step it
    completed, and the job's own fields (`JobAdapter.recovery_report`, opaque here)."""

    member: str
    last_completed: int
    holds: dict[str, tuple[int, ...]]
    job: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> HoldingsReport:
        return _decode(cls, key, raw, _read_holdings)


def _read_holdings(f: _Fields) -> HoldingsReport:
    holds = {}
    for owner, iterations in f.mapping("holds").items():
        if owner != "local" and not owner.isdigit():
            raise f._error(f"field 'holds': {owner!r} is neither 'local' nor a rank")
        holds[owner] = f.rank_list("holds", iterations)
    return HoldingsReport(
        member=f.member("member", f.data.get("member")),
        last_completed=f.integer("last_completed", minimum=0),
        holds=holds,
        job=f.mapping("job"),
    )


def decode_holdings(keys: list[str], raws: list[bytes]) -> list[HoldingsReport]:
    """Many reports at once: one JSON parse of them all (half the CPU of one parse each,
    measured at 16,384 reports: 31 ms against 68 ms); a bad one is named by its key."""
    try:
        parsed = json.loads(b"[" + b",".join(raws) + b"]")
    except ValueError:  # find the culprit, and name it
        return [HoldingsReport.decode(k, r) for k, r in zip(keys, raws)]
    return [
        _read_holdings(_Fields(k, r, "HoldingsReport", d)) for k, r, d in zip(keys, raws, parsed)
    ]


@dataclass(frozen=True)
class Sources:
    """`gen{g}/sources`: needy rank -> the holder that sends it its shard of the restore
    iteration (published before the roster)."""

    holders: dict[int, int]

    def encode(self) -> str:
        return json.dumps(_ranks_json(self.holders))

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> Sources:
        def read(f: _Fields) -> Sources:
            return cls({int(k): f.rank(k, v) for k, v in f.data.items() if _is_rank(f, k)})

        return _decode(cls, key, raw, read)


def _is_rank(f: _Fields, name: str) -> bool:
    if not name.isdigit():
        raise f._error(f"{name!r} is not a rank")
    return True


# ---------------------------------------------------------------------- the end of a job
@dataclass(frozen=True)
class SaveOrder:
    """What survivors write when memory cannot go on (out of redundancy, or a loss after
    training completed): the snapshot set of one iteration, and who writes the dead ranks'
    shards (needy rank -> holder)."""

    iteration: int
    sources: dict[int, int]
    complete: bool
    missing: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "sources": _ranks_json(self.sources), "missing": [*self.missing]}

    @classmethod
    def read(cls, f: _Fields, name: str) -> SaveOrder | None:
        value = f.data.get(name)
        if value is None:
            return None
        inner = _Fields(f.key, f.raw, "SaveOrder", value)
        return cls(
            iteration=inner.integer("iteration", minimum=0),
            sources=inner.rank_map("sources", inner.rank),
            complete=inner.boolean("complete"),
            missing=inner.ints("missing"),
        )


@dataclass(frozen=True)
class OutOfRedundancy:
    """`out_of_redundancy`: memory cannot recover a failure (no spare left, or an owner and
    every holder of its shard lost): the dead and lost ranks, the holders of the lost shards,
    and what survivors save before they stop."""

    reason: str
    dead_ranks: tuple[int, ...]
    lost_ranks: tuple[int, ...]
    lost_shard_holders: dict[int, tuple[int, ...]]
    save: SaveOrder | None

    def to_dict(self) -> dict[str, Any]:
        """As the event log and the launchers' summaries show it."""
        return {
            "reason": self.reason,
            "dead_ranks": [*self.dead_ranks],
            "lost_ranks": [*self.lost_ranks],
            "lost_shards_holders": {str(k): [*v] for k, v in self.lost_shard_holders.items()},
            "save": self.save.to_dict() if self.save else None,
        }

    def encode(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> OutOfRedundancy:
        def read(f: _Fields) -> OutOfRedundancy:
            return cls(
                reason=f.text("reason"),
                dead_ranks=f.ints("dead_ranks"),
                lost_ranks=f.ints("lost_ranks"),
                lost_shard_holders=f.rank_map("lost_shards_holders", f.rank_list),
                save=SaveOrder.read(f, "save"),
            )

        return _decode(cls, key, raw, read)


@dataclass(frozen=True)
class EndReport:
    """`end`: members lost after training completed - nothing to recompute; the dead ranks,
    the ranks whose final state is gone with them, and who writes the others' final state."""

    reason: str
    completed_iteration: int
    dead_ranks: tuple[int, ...]
    lost_ranks: tuple[int, ...]
    save: SaveOrder

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "save": self.save.to_dict()}

    def encode(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> EndReport:
        def read(f: _Fields) -> EndReport:
            save = SaveOrder.read(f, "save")
            if save is None:
                raise f._error("field 'save' missing")
            return cls(
                reason=f.text("reason"),
                completed_iteration=f.integer("completed_iteration", minimum=0),
                dead_ranks=f.ints("dead_ranks"),
                lost_ranks=f.ints("lost_ranks"),
                save=save,
            )

        return _decode(cls, key, raw, read)


@dataclass(frozen=True)
class FailureReport:
    """`failure/{member}`: a survivor saw a collective fail - the report's number (reports are
    numbered in the order they reach the store), its wall time and the error's first line."""

    number: int
    time: float
    why: str

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> FailureReport:
        def read(f: _Fields) -> FailureReport:
            return cls(f.integer("number", minimum=1), f.number("time"), f.text("why"))

        return _decode(cls, key, raw, read)


@dataclass(frozen=True)
class IterationRecord:
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def encode(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> IterationRecord:
        def read(f: _Fields) -> IterationRecord:
            parts = f.mapping("replication_parts_s")
            return cls(
                iteration=f.integer("iteration", minimum=1),
                time=f.number("time"),
                loss=f.number("loss"),
                grad_norm=f.opt_number("grad_norm"),
                lr=f.number("lr"),
                iter_time_s=f.number("iter_time_s"),
                replication_s=f.number("replication_s"),
                generation=f.integer("generation", minimum=0),
                committed_iteration=f.opt_integer("committed_iteration", minimum=0),
                replica_bytes_sent=f.integer("replica_bytes_sent", minimum=0),
                replication_parts_s={k: f._float(k, v) for k, v in parts.items()},
            )

        return _decode(cls, key, raw, read)


@dataclass(frozen=True)
class FinalReplication:
    """`replication/final`: the globally committed iteration at the end of training."""

    committed_iteration: int | None

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> FinalReplication:
        return _decode(
            cls, key, raw, lambda f: cls(f.opt_integer("committed_iteration", minimum=0))
        )


@dataclass(frozen=True)
class Preempted:
    """`preempted`: where training stopped on purpose (SIGTERM, the launcher's request), and
    whether a checkpoint was saved there."""

    iteration: int
    saved: bool

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> Preempted:
        return _decode(
            cls, key, raw, lambda f: cls(f.integer("iteration", minimum=0), f.boolean("saved"))
        )


# ---------------------------------------------------------------------- a standby takes over
@dataclass(frozen=True)
class Registration:
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
    """The newest planned generation it saw (a recovery it may have reported for)."""
    recovering: bool = False
    """It was inside a recovery (between a failed collective and its restore)."""

    def encode(self) -> str:
        return json.dumps(
            {
                **asdict(self),
                "slots": None if self.slots is None else _ranks_json(self.slots),
                "layout": None if self.layout is None else asdict(self.layout),
            }
        )

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> Registration:
        def read(f: _Fields) -> Registration:
            layout = f.data.get("layout")
            return cls(
                member=f.member("member", f.data.get("member")),
                host=f.text("host"),
                rank=f.opt_integer("rank", minimum=0),
                generation=f.integer("generation", minimum=-1),
                world_size=f.opt_integer("world_size", minimum=1),
                slots=None if f.data.get("slots") is None else f.rank_map("slots", f.member),
                restore_iteration=f.opt_integer("restore_iteration", minimum=0),
                last_completed=f.integer("last_completed", minimum=0),
                completed=f.opt_integer("completed", minimum=0),
                done=f.boolean("done"),
                layout=None if layout is None else LayoutRecord.decode(key, json.dumps(layout)),
                plan_seen=f.integer("plan_seen", minimum=0),
                recovering=f.boolean("recovering"),
            )

        return _decode(cls, key, raw, read)


def member_of(task: int, world_size: int) -> str:
    """The member name of task index `task`: actives first (ranks 0..W-1), then spares."""
    return f"a{task}" if task < world_size else f"s{task - world_size}"
