"""Repairing this process's groups in place (torch >= 2.14's reconfigure) instead of rebuilding.

A hot swap keeps every slot: a newcomer takes the dead rank's place, so every group keeps its
ranks and only the process behind one of them changes. torch 2.14 can re-connect a group's
communicator in place (`torch.distributed._reconfigure`, `ProcessGroup.reconfigure`; all
experimental); for gloo (torch's ``ProcessGroupGloo::reconfigure``, read in its source):

- a group's reconfigure handle is ``gloo:{group rank}:{uuid of its last reconfigure, -1 for
  none}:{global rank}:{host:port of its TCP store}``; `reconfigure(uuid, handles)` needs every
  member's handle, its own among them, in group-rank order (a list assigns ranks by position);
- it re-connects the full mesh over the group's *own* store under ``reconfigure/{uuid}/``
  (so the newcomer must create its groups on the store prefix the survivors' were created on,
  with the same names: the same creation order), resets the collective counter and returns a
  completed `Work`; it raises after `timeout` when a member never comes (its old rank, size
  and members restored), and refuses a uuid used before on that group;
- a group created with ``enable_reconfigure=True`` connects nothing until its first
  reconfigure: that is how a newcomer builds its world without the survivors
  (`reconfigurable_creation`), then joins each repaired group;
- it drops the group's old pairs, and gloo closes a pair that is still connected from the
  calling thread by waiting for a tick of the pair's event loop (``Loop::unregisterDescriptor``),
  whose ``epoll_wait`` times out every 10 ms when nothing happens on it: each group has a loop
  of its own, idle by then. Measured (torch 2.14.1, 4 processes on 2 cores, 12 groups each):
  groups with live connections took 10-42 ms each to reconfigure, in steps of ~10 ms (one per
  peer), 180-220 ms in all; after the abort had shut their connections down
  (`devices.gloo.shutdown_connections`: each loop closes its pairs as it sees them end) 0.5-4 ms
  each, 16-18 ms in all. The one long wait a hot swap's repair then still had (9-16 ms, in the
  newcomer's ~22nd of its 25 groups, every run) was not this tick: the kernel grew the
  newcomer's descriptor table there (`devices.descriptors`, which now grows it at start-up).

So survivors keep their `ProcessGroup` objects - Megatron's module globals and every handle the
model, DDP and the optimizer hold stay valid, nothing is walked or rebound - and the repair of
a generation is one reconfigure per group, in two parts (`split_by_members`): the groups no
newcomer is in, which the survivors repair while the newcomers still build, then the others,
each part in the order the groups were created (every member takes any two groups it shares
with another in the same order: no cycle of waits).

`choose` decides, from what the running torch offers and the backend, whether a recovery
repairs (`Choice.repair`) or falls back to the rebuild of a new generation (torch < 2.14, NCCL,
or ``DEADPOOL_GROUP_REPAIR=rebuild``); `plan_repair` is the pure planning (handles of every
member, from what each process published); `repair` is the communication.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import ConfigError, DeadpoolRuntimeError
from . import gloo

MODE_ENV = "DEADPOOL_GROUP_REPAIR"
"""``auto`` (the default): repair in place where torch and the backend can; ``rebuild``: always
rebuild a new generation's groups (today's way)."""

MODES = ("auto", "rebuild")

HANDLE_PREFIX = "gloo:"
"""What a gloo reconfigure handle starts with (its backend's name)."""

MAX_HANDLE_CHARS = 512
"""Longest handle accepted from another process (host names included)."""


class RepairPlanError(DeadpoolRuntimeError):
    """The handles published for a repair do not describe the groups to repair."""


@dataclass(frozen=True)
class Choice:
    """Whether this process's groups are repaired in place or rebuilt, and why."""

    repair: bool
    reason: str

    @property
    def way(self) -> str:
        """``repair`` or ``rebuild`` (as `bench recovery` reports it)."""
        return "repair" if self.repair else "rebuild"


def api_available() -> bool:
    """Whether the running torch has the reconfigure API (torch >= 2.14)."""
    return hasattr(dist, "_reconfigure") and hasattr(dist.ProcessGroup, "reconfigure")


def mode(environ: Mapping[str, str] | None = None) -> str:
    """The repair mode asked for (``DEADPOOL_GROUP_REPAIR``, default ``auto``)."""
    env = os.environ if environ is None else environ
    value = env.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ConfigError(f"{MODE_ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def choose(
    backend: str, *, available: bool | None = None, environ: Mapping[str, str] | None = None
) -> Choice:
    """Repair in place or rebuild, for a job whose groups use `backend` (``gloo``, ``nccl``, or
    torch's ``cpu:gloo,cuda:nccl`` form). Pure apart from `api_available` (`available`)."""
    if mode(environ) == "rebuild":
        return Choice(False, f"{MODE_ENV}=rebuild")
    if not (api_available() if available is None else available):
        return Choice(False, "this torch has no process-group reconfigure (torch < 2.14)")
    names = {part.split(":")[-1].strip() for part in backend.split(",") if part.strip()}
    if names != {"gloo"}:
        return Choice(
            False,
            f"backend {backend!r}: only gloo groups are repaired in place (NCCL's reconfigure "
            "is torch's experimental nccl2 backend)",
        )
    return Choice(True, "gloo groups reconfigured in place (torch reconfigure API)")


@dataclass(frozen=True)
class GroupRepair:
    """One group's reconfigure: its name and every member's handle in group-rank order."""

    name: str
    ranks: tuple[int, ...]
    handles: tuple[str, ...]


def known_groups() -> list[tuple[str, dist.ProcessGroup, tuple[int, ...]]]:
    """(name, group, global ranks) of every group this process is a member of, in the order
    torch created them (its group map keeps creation order)."""
    c10d = dist.distributed_c10d
    out = []
    for pg in list(c10d._world.pg_map):
        name = c10d._world.pg_names.get(pg, "")
        out.append((name, pg, tuple(dist.get_process_group_ranks(pg))))
    return out


def own_handles() -> dict[str, str]:
    """name -> this process's reconfigure handle of every group it is in (what it publishes)."""
    return {name: _api(pg).get_reconfigure_handle() for name, pg, _ in known_groups()}


def check_handles(rank: int, handles: object) -> dict[str, str]:
    """The handles `rank` published, checked before use: a mapping of group names to gloo
    handles of bounded length; `RepairPlanError` naming the rank otherwise."""
    if not isinstance(handles, Mapping):
        raise RepairPlanError(f"rank {rank}'s reconfigure handles are not a mapping")
    out: dict[str, str] = {}
    for name, handle in handles.items():
        if not isinstance(name, str) or not isinstance(handle, str):
            raise RepairPlanError(f"rank {rank}'s reconfigure handle of {name!r} is not text")
        if not handle.startswith(HANDLE_PREFIX) or len(handle) > MAX_HANDLE_CHARS:
            raise RepairPlanError(
                f"rank {rank}'s reconfigure handle of group {name!r} is not a gloo handle of at "
                f"most {MAX_HANDLE_CHARS} characters: {handle[:80]!r}"
            )
        out[name] = handle
    return out


def plan_repair(
    groups: Sequence[tuple[str, Sequence[int]]], handles: Mapping[int, Mapping[str, str]]
) -> list[GroupRepair]:
    """The reconfigure of each of `groups` (name, global ranks; in creation order) from the
    handles every rank published (rank -> group name -> handle). Pure.

    Each group's handle list is its members' handles in group-rank order, so every member
    keeps its rank. A member that published no handle for a group it is in, or a handle that
    another member also gave, is an error naming them (a reconfigure would refuse it, or wait
    for a member that never comes)."""
    out = []
    for name, ranks in groups:
        listed = []
        for rank in ranks:
            published = handles.get(rank)
            if published is None:
                raise RepairPlanError(f"rank {rank} published no reconfigure handles")
            handle = published.get(name)
            if handle is None:
                raise RepairPlanError(
                    f"rank {rank} published no reconfigure handle for group {name!r} "
                    f"(ranks {list(ranks)}): it did not create the same groups"
                )
            listed.append(handle)
        if len(set(listed)) != len(listed):
            raise RepairPlanError(f"group {name!r}: two members published the same handle")
        out.append(GroupRepair(name, tuple(ranks), tuple(listed)))
    return out


def split_by_members(
    groups: Sequence[tuple[str, Sequence[int]]], ranks: Collection[int]
) -> tuple[list[tuple[str, Sequence[int]]], list[tuple[str, Sequence[int]]]]:
    """`groups` (name, global ranks; in creation order) split into those none of `ranks` is in
    and the others, each part in creation order. Pure.

    Survivors repair the first part while the newcomers (`ranks`) still build, and the second
    once they joined; a newcomer is in the second part's groups only. So every process takes
    any two groups it shares with another in the same order - a first part's group before a
    second part's, creation order within a part - and no two wait on each other."""
    apart = set(ranks)
    without = [(name, members) for name, members in groups if not apart & set(members)]
    with_them = [(name, members) for name, members in groups if apart & set(members)]
    return without, with_them


@dataclass(frozen=True)
class RepairReport:
    """What `repair` did."""

    groups: int
    seconds: float


def repair(plan: Sequence[GroupRepair], uuid: int, timeout: datetime.timedelta) -> RepairReport:
    """Reconfigure this process's groups in place, one after another in `plan`'s order (the
    creation order: every member takes them in the same order), under a `uuid` never used on
    them before (e.g. the generation). Each reconfigure waits at most `timeout` for its members
    (then raises `DistBackendError`-like `RuntimeError`: the recovery starts over). The
    connections it opens are recorded, so the next failure's abort shuts them down
    (`devices.gloo`).

    One after another: side by side (a thread per group) they hang. Every group rendezvouses
    on a prefix of the job's one TCP store client, and that client holds its lock through a
    blocking `get`: measured, a `set` from a second thread waited out the first thread's `get`
    (4.7 s of a 5 s timeout). So one group's reconfigure, waiting for a peer's address, holds
    back this process's writes of its address for the other groups, which its peers wait for in
    turn. On 2 cores the 25 groups of Megatron's TP2xDP2 take ~65 ms this way."""
    if uuid < 0:
        raise ValueError(f"uuid={uuid}: a reconfigure uuid must be >= 0 (-1 means none yet)")
    by_name = {name: pg for name, pg, _ in known_groups()}
    missing = [step.name for step in plan if step.name not in by_name]
    if missing:
        raise RepairPlanError(f"this process has no group {missing[0]!r} to repair")
    stores = {gloo.store_port(by_name[step.name]) for step in plan}
    t0 = time.perf_counter()
    with gloo.recording(f"repair {uuid}", stores):
        for step in plan:
            pg = by_name[step.name]
            work = _api(dist)._reconfigure(uuid, list(step.handles), group=pg, timeout=timeout)
            # gloo connects inside the call and hands back a completed work, whose wait() with
            # a bound (`gloo.interruptible_waits`) torch does not implement: its future is done.
            work.get_future().wait()
    return RepairReport(len(plan), time.perf_counter() - t0)


def _api(obj: object) -> Any:
    """`obj` as torch >= 2.14 has it (the type stubs checked may be an older torch's)."""
    return obj


def repaired(ranks: Sequence[int]) -> bool:
    """Whether a group of global ranks `ranks` is repaired on a recovery: a group of one has no
    peer and no connection - nothing an abort shuts down or a newcomer joins - so it is not
    (Megatron's TP2xDP2 gives each rank 7-9 of its 25 groups: ~0.3 ms each, on the critical
    path). Pure."""
    return len(ranks) > 1


@contextlib.contextmanager
def reconfigurable_creation() -> Iterator[None]:
    """Inside the block every group of more than one member torch creates is created to be
    reconfigured: it connects nothing until `repair` (a newcomer builds its world without the
    survivors this way); a group of one is created ready (`repaired`: never reconfigured)."""
    c10d: Any = dist.distributed_c10d
    real = c10d._new_process_group_helper

    @functools.wraps(real)
    def helper(*args: Any, **kwargs: Any) -> Any:
        size = args[0] if args else kwargs.get("group_size")
        kwargs["enable_reconfigure"] = not isinstance(size, int) or size > 1
        return real(*args, **kwargs)

    c10d._new_process_group_helper = helper
    try:
        yield
    finally:
        c10d._new_process_group_helper = real
