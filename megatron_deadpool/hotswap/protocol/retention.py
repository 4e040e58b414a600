"""How long the job's store keeps what it is given: which per-iteration and per-generation keys
may go, and when (pure; the deletes are the role views').

Without it two kinds of keys grow for the life of a job (the coordinator's memory with them):
  - `metrics/g{g}/{it}`, rank 0's record of every iteration (~380 bytes each). The writer keeps a
    window: publishing iteration `it` deletes the record of `it - RETAINED_ITERATIONS` of its
    generation (`expired_iteration`). The one reader, the local launcher's progress display
    (`embedded/launch.py`), reads the records in order in the same loop as the coordinator's
    ticks; it may lag rank 0 by up to that many iterations and still see every record. On a
    cluster nothing reads them, and the window bounds them all the same.
  - generation g's keys: ours (`gen{g}/...`: roster, plan, holdings, decision, sources, claims,
    phase stamps; `metrics/g{g}/...`) and torch's rendezvous keys of g's process groups (under
    the same `gen{g}/` prefix, one per rank and group). Groups repaired in place stay on the
    prefix of the generation they were created in (`gen{base}/`) and rendezvous there under
    `reconfigure/{g}/` (the repair's uuid is the generation, `devices.reconfigure`; the marks of
    an abandoned repair are there too): such a key belongs to generation g, not to the base -
    else the repairs after the base's keys went would stay for the job's life, one key per
    rank and group each. Once generation g is complete - every
    rank joined and restored, rank 0 finished its first iteration - the coordinator deletes the
    keys of every generation before g - 1 (`prunable_below`, `generation_keys`), a batch per
    tick (`pruning.py`). Generation g - 1 stays for one more recovery: a process that read the
    newest generation just before g's roster appeared (a waiting spare) may still read g - 1's
    roster, and the progress display may still be at one of g - 1's last records. No process
    reads an older generation's keys: the rosters, plans, holdings and sources processes read are
    their current generation's (`driver.py`, `recovery.py`, `megatron_lm/session.py`), a standby
    rebuilds from re-registrations (`rebuild.py`), and no group of an older generation is used
    after rebinding. Kept for good: generation 0's roster (one key; a starting process reads the
    job's world size from the newest roster, `StoreView.wait_newest_roster`).
  - the spares' wake-up keys `spares/epoch/{n}`, one per roster: at the same time, those before
    the previous roster's (`prunable_wake_ups`). A spare's waiter walks through them in order; one
    a whole recovery behind would wait on a deleted key, and its spare still looks at the store
    every second.
  - a dead member's own keys (`member_keys`: its heartbeat, announcement, failure report
    and done stamp), which would grow with every failure a long run meets (each respawn and
    each joined spare is a new member): at the same time as the generation keys, those of the
    members whose death was planned for in a generation before g - 1. Nothing reads them by
    then: the failure detector reads live members' keys only, a standby rebuilds from
    re-registrations, and the coordinator keeps who died in its own memory.
    The fault-injection keys (`fault/...`, `node_lost/...`) and the numbered error reports stay.
  - `checkpoint/failures`, one line per periodic checkpoint that could not be written (a disk
    that stays full fails every interval): the value keeps the newest
    `RETAINED_CHECKPOINT_FAILURES` lines (`retained_failures`). Its one reader, the local
    launcher, says each line once as rank 0 publishes it, so it never lags by that many.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .messages import Keys

RETAINED_ITERATIONS = 1000
"""Records of rank 0's iterations the store keeps per generation (~0.4 MB)."""

RETAINED_CHECKPOINT_FAILURES = 100
"""Lines of failed periodic checkpoints `checkpoint/failures` keeps (the newest)."""

KEPT_FOR_GOOD = frozenset({Keys.ROSTER.format(g=0)})
"""Keys of a generation that are never deleted."""

_GENERATION_KEY = re.compile(
    "|".join(
        "^" + re.escape(template.split("{g}")[0]) + r"(\d+)/"
        for template in (Keys.PROCESS_GROUPS, Keys.METRICS)
    )
)
"""A key of generation g: `gen{g}/...` (ours and torch's) or `metrics/g{g}/...`."""

_REPAIR_KEY = re.compile(
    "^" + re.escape(Keys.PROCESS_GROUPS.split("{g}")[0]) + r"\d+/(?:.*/)?reconfigure/(\d+)/"
)
"""A rendezvous key of generation g's repair of groups created in an earlier generation:
`gen{base}/.../reconfigure/{g}/...`."""


def expired_iteration(iteration: int, retain: int = RETAINED_ITERATIONS) -> int | None:
    """The iteration whose record goes when `iteration`'s is published (None: none yet)."""
    old = iteration - retain
    return old if old >= 1 else None


def retained_failures(
    lines: dict[int, str], retain: int = RETAINED_CHECKPOINT_FAILURES
) -> dict[int, str]:
    """The lines of failed checkpoints (iteration -> line) `checkpoint/failures` keeps: the
    newest `retain` iterations'."""
    return {it: lines[it] for it in sorted(lines)[-retain:]} if retain > 0 else {}


def prunable_below(completed: int) -> int:
    """Once generation `completed` is complete, the generations below this one may go."""
    return completed - 1


def prunable_wake_ups(epoch: int) -> int:
    """With the spares' wake-up counter at `epoch`, the wake-up keys below this one may go."""
    return epoch - 1


def wake_up_keys(first: int, below: int) -> list[str]:
    """The spares' wake-up keys `first` .. `below - 1`."""
    return [Keys.SPARE_EPOCH_N.format(n=n) for n in range(first, below)]


def member_keys(member: str) -> list[str]:
    """The keys only `member` writes and only while it lives is anything read from them."""
    return [
        Keys.HEARTBEAT.format(member=member),
        Keys.READY.format(member=member),
        Keys.FAILURE.format(member=member),
        Keys.DONE.format(member=member),
    ]


def key_generation(key: str) -> int | None:
    """The generation `key` belongs to; None for a key of no generation."""
    repair = _REPAIR_KEY.match(key)
    if repair is not None:
        return int(repair.group(1))
    match = _GENERATION_KEY.match(key)
    if match is None:
        return None
    return int(next(group for group in match.groups() if group is not None))


def generation_keys(keys: Iterable[str], first: int, below: int) -> list[str]:
    """Those of `keys` that belong to generations `first` .. `below - 1` and may be deleted."""
    out = []
    for key in keys:
        g = key_generation(key)
        if g is not None and first <= g < below and key not in KEPT_FOR_GOOD:
            out.append(key)
    return out
