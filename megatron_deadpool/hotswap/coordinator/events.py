"""The coordinator's event log: its observations and decisions, one JSON object per line.

Each entry has the schema's version (`v`, `SCHEMA_VERSION`), the job's id (`job`, the same on
every line a job's coordinators write: `job_id`), its wall time (`t`), its kind (`event`) and
the event's fields; the list of entries is also kept in memory (`events`) for the launcher's
summary and for tests. Messages (`messages.py`) go into it through their `to_dict`/`asdict`
form. `EVENTS` is the schema - every kind, what it means and its fields - in one place, for
the reference documentation and for the tests that check each written entry against it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
"""Version of the entries' layout (`v` on every line); raised when a field changes meaning or
goes away (new kinds and new fields keep it)."""

COMMON_FIELDS = ("v", "job", "t", "event")
"""On every entry: the schema version, the job's id, the wall time (seconds since the epoch)
and the kind."""


@dataclass(frozen=True)
class EventKind:
    """One kind of entry: what it records and the fields it carries beyond `COMMON_FIELDS`."""

    meaning: str
    fields: tuple[str, ...]


_RECOVERY = ("generation", "dead_ranks", "replaced_by", "respawned", "restore_iteration",
             "recomputed_iterations", "phases_s", "failure_time", "stale_group_refs",
             "total_s", "newcomers_claimed_s")  # fmt: skip
_ERROR = ("number", "member", "rank", "generation", "phase", "error", "message", "time", "tail")

EVENTS: dict[str, EventKind] = {
    "store": EventKind(
        "where the job's store listens (a launcher on this machine), and the run's id its "
        "values are sealed for (DEADPOOL_JOB_ID: a process that joins the job needs it)",
        ("address", "run"),
    ),
    "settings": EventKind(
        "a coordinator process started with these timeouts (seconds)",
        (
            "role",
            "address",
            "heartbeat_interval",
            "heartbeat_timeout",
            "agree_timeout",
            "join_timeout",
            "pg_timeout",
        ),
    ),
    "roster": EventKind(
        "the ranks' members of a generation (slots: rank -> member); adopted: a standby's",
        ("generation", "slots", "adopted"),
    ),
    "process_dead": EventKind("a process was found dead, and why", ("member", "why")),
    "exited_after_done": EventKind(
        "a process exited after its rank's work was done", ("member", "code")
    ),
    "failure_reported": EventKind("survivors reported failed collectives", ("count",)),
    "error_reported": EventKind("a rank reported its own exception", _ERROR),
    "respawned": EventKind(
        "a failed rank's node started a new process in its place (no spare spent)",
        ("rank", "node", "member", "replaces"),
    ),
    "respawn_refused": EventKind(
        "no respawn on the node (its agent lost, or its respawn limit reached): a spare",
        ("rank", "node", "why"),
    ),
    "plan": EventKind(
        "a recovery planned: the dead ranks, those that need state, the new slots, the shards "
        "whose replicas the dead held (replicas_lost: owner ranks)",
        ("generation", "dead", "needy", "slots", "replicas_lost"),
    ),
    "agreed": EventKind(
        "the survivors agreed on the iteration every rank restores; under_replicated: the "
        "shards (owner ranks) fewer than deadpool-replicas ranks hold a copy of it, until a "
        "round after it commits",
        ("generation", "restore_iteration", "sources", "last_completed", "under_replicated"),
    ),
    "agree_timeout": EventKind(
        "survivors that never reported in time, presumed dead", ("generation", "missing")
    ),
    "recovered": EventKind(
        "a recovery completed: per-phase seconds (detect, agree, reconstruct, restore, "
        "first_iteration) and the total; newcomers_claimed_s: of the reconstruct, the seconds "
        "until the last newcomer claimed its slot (its objects built)",
        _RECOVERY,
    ),
    "join_abandoned": EventKind(
        "a newcomer did not claim its slot in time; the next spare takes it", ("member", "why")
    ),
    "spare_lost": EventKind("a waiting spare died", ("member", "spares_left")),
    "out_of_redundancy": EventKind(
        "no spare or no surviving copy: the survivors save what they hold, the job ends (3)",
        ("reason", "dead_ranks", "lost_ranks", "lost_shards_holders", "save"),
    ),
    "lost_after_training": EventKind(
        "ranks lost after training ended, before the job finished",
        ("reason", "completed_iteration", "dead_ranks", "lost_ranks", "save"),
    ),
    "job_error": EventKind(
        "the job's own error (not a node's): the job ends (9)", ("reason", "report", "dead_ranks")
    ),
    "rejected_value": EventKind(
        "a store value that failed its seal or check was ignored", ("key", "why")
    ),
    "finished": EventKind(
        "every rank finished; digests of the final parameters",
        ("final_param_digest", "rank_digests"),
    ),
    "step_killed": EventKind("a Slurm job step was ended, and why", ("step", "why")),
    "standby_watching": EventKind(
        "a standby coordinator watches the primary", ("coordinator", "epoch")
    ),
    "standby_not_needed": EventKind("the job ended without the standby", ("coordinator",)),
    "standby_lost": EventKind("the primary lost its standby", ("standby", "ever_seen")),
    "standby_back": EventKind("the primary's standby is back", ("standby",)),
    "coordinator_lost": EventKind(
        "the coordinators before this standby went silent",
        ("coordinators", "silent_s", "last_seen"),
    ),
    "taking_over": EventKind("this standby takes the job over", ("epoch",)),
    "rebuilt": EventKind(
        "the standby rebuilt the job's state from the store",
        ("generation", "slots", "missing", "spares", "next_generation", "progress", "registered"),
    ),
    "rejoined": EventKind(
        "a process re-registered with the standby",
        ("member", "rank", "generation", "last_completed"),
    ),
    "superseded": EventKind("another standby took the job over", ("standby",)),
    "withdrew": EventKind("a coordinator found it is no longer the job's", ("coordinators",)),
}
"""Every kind of entry the coordinators write, by name."""


def job_id(secret: str) -> str:
    """The job's id in its event log: 12 hex digits of a hash of the job's secret - the same
    for every coordinator of one job, new for every job, and no clue to the secret."""
    return hashlib.sha256(b"deadpool-job-id:" + secret.encode()).hexdigest()[:12]


class EventLog:
    """Append-only JSON-lines log of the coordinator's observations and decisions."""

    def __init__(
        self,
        path: Path | None,
        clock: Callable[[], float] = time.time,
        *,
        job: str = "",
        listeners: list[Callable[[dict[str, Any]], None]] | None = None,
    ) -> None:
        """`job`: the job's id on every entry (`job_id`); `listeners`: called with each entry
        once it is written (a metrics file rewritten at each event)."""
        self.path = path
        self.clock = clock
        self.job = job
        self.listeners = list(listeners or [])
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: str, **fields: Any) -> None:
        entry = {"v": SCHEMA_VERSION, "job": self.job, "t": self.clock(), "event": event, **fields}
        self.events.append(entry)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        for listener in self.listeners:
            listener(entry)

    def of(self, event: str) -> list[dict[str, Any]]:
        """The entries of one kind, in order."""
        return [e for e in self.events if e["event"] == event]
