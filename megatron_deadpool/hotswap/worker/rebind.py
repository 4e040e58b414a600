"""Patched `parallel_state` re-initialisation: rebuild Megatron's groups, rebind every handle.

Megatron-Core keeps process-group handles in `parallel_state` globals, in every layer's
`pg_collection`, in parallel linears (`tp_group`), in DDP bucket groups and in the distributed
optimizer. On a failure `release` swaps each of those handles in the survivor's live objects
for a `GroupSlot` placeholder named after the `parallel_state` global (or WORLD) that held it
and aborts every group (`devices.abort_groups`: NCCL communicators all together, never a
graceful destroy with a dead peer; gloo connections shut down): peers blocked on this rank
are unblocked at once, and with no reference left the old groups are freed. Once the new
generation's default group exists and Megatron's groups are re-created in their fixed order,
`attach` puts the new group of the same name in every slot, so no object keeps a handle to an
aborted group. A newcomer's private world needs neither the placeholders nor the abort's care
(its fake groups have no connection and no peer): torch forgets it while the objects keep its
groups (`forget`), and once the real groups exist `swap` puts them in place, in one walk.
`stale_group_refs` is the check: every group reachable from the objects must belong to the
current world. `unnamed_groups` is the check before the first failure: a group the objects hold
that is none of `parallel_state`'s (a module or library that made a group of its own) has no
name to be rebound by, so the job is refused at start-up rather than failing in a recovery.
"""

from __future__ import annotations

import functools
import gc
import logging
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ...devices.abort import abort_groups, last_abort
from ...devices.threads import start_thread
from ...errors import ConfigError

log = logging.getLogger(__name__)

_ATOMS = (
    str,
    bytes,
    int,
    float,
    bool,
    complex,
    type(None),
    torch.Tensor,
    torch.dtype,
    torch.device,
    type,
    types.ModuleType,
    types.BuiltinFunctionType,
)


_KINDS: dict[type, tuple[bool, bool]] = {}
"""type -> (an atom the walk does not enter, a process group): each type asked once. torch >=
2.14 answers `isinstance(x, ProcessGroup)` in Python (`CustomClassBaseMeta.__instancecheck__`),
~1 us a value: a third of a walk over Megatron's ~23,000 values. Per type, which that answer is
for every object the walk meets (its per-instance case is torch.compile's tracing stand-in)."""


def _kind(value: Any) -> tuple[bool, bool]:
    """(atom, process group) for `value`'s type."""
    kind = _KINDS.get(type(value))
    if kind is None:
        kind = _KINDS[type(value)] = (
            isinstance(value, _ATOMS),
            isinstance(value, dist.ProcessGroup),
        )
    return kind


def is_group(value: Any) -> bool:
    """Whether `value` is a process group."""
    return _kind(value)[1]


def group_globals() -> dict[str, Any]:
    """parallel_state's module globals that hold process groups (or lists of them)."""
    out: dict[str, Any] = {}
    for name, value in vars(ps).items():
        if not name.startswith("_") or name.startswith("__"):
            continue
        if isinstance(value, dist.ProcessGroup) or (
            isinstance(value, list)
            and value
            and all(isinstance(v, dist.ProcessGroup) for v in value)
        ):
            out[name] = value
    return out


class GroupSlot:
    """Stands in for a released process group until the new generation's group exists."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"GroupSlot({self.name})"


def group_names(extra: dict[str, Any] | None = None) -> dict[int, str]:
    """id(group) -> a stable name: its parallel_state global (with index), WORLD, extras."""
    names: dict[int, str] = {}
    if dist.is_initialized():
        names[id(dist.distributed_c10d._get_default_group())] = "WORLD"
    elif (aborted := last_abort()) is not None and aborted.world_id is not None:
        names[aborted.world_id] = "WORLD"  # aborted (torch forgot it), still held by objects
    for name, value in {**group_globals(), **(extra or {})}.items():
        if isinstance(value, list):
            for i, pg in enumerate(value):
                names.setdefault(id(pg), f"{name}[{i}]")
        elif value is not None:
            names.setdefault(id(value), name)
    return names


def groups_by_name(extra: dict[str, Any] | None = None) -> dict[str, dist.ProcessGroup]:
    """The inverse of `group_names` for the current generation."""
    out: dict[str, dist.ProcessGroup] = {"WORLD": dist.distributed_c10d._get_default_group()}
    for name, value in {**group_globals(), **(extra or {})}.items():
        if isinstance(value, list):
            out.update({f"{name}[{i}]": pg for i, pg in enumerate(value)})
        elif value is not None:
            out[name] = value
    return out


def _walk(roots: Iterable[Any], visit: Callable[[Any], Any | None]) -> None:
    """Depth-first over containers and object attributes from each of `roots`, every object
    entered once (roots share most of it: the optimizer holds the model, each model chunk the
    configs - walked root by root, a newcomer's swap entered ~10,500 values instead of ~3,000);
    `visit` may return a replacement."""
    seen: set[int] = set()
    stack: list[Any] = list(roots)[::-1]

    def fix(value: Any) -> Any:
        replacement = visit(value)
        if replacement is not None:
            return replacement
        if _kind(value)[0]:
            return value
        if isinstance(value, tuple):
            items = [fix(v) for v in value]
            if any(a is not b for a, b in zip(items, value)):
                try:
                    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
                except TypeError:
                    return value
        if id(value) not in seen:
            stack.append(value)
        return value

    while stack:
        obj = stack.pop()
        if id(obj) in seen or _kind(obj)[0]:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            for key in list(obj):
                obj[key] = fix(obj[key])
        elif isinstance(obj, list):
            for i, item in enumerate(obj):
                obj[i] = fix(item)
        elif isinstance(obj, (set, frozenset, tuple)):
            for item in obj:
                fix(item)
        elif isinstance(obj, functools.partial):
            fix(obj.func)
            for item in obj.args:
                fix(item)
            for item in (obj.keywords or {}).values():
                fix(item)
        elif isinstance(obj, types.MethodType):
            fix(obj.__self__)
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    cell.cell_contents = fix(cell.cell_contents)
                except ValueError:  # empty cell
                    pass
        elif is_group(obj):
            continue
        else:
            attrs = getattr(obj, "__dict__", None)
            if attrs is not None:
                for key in list(attrs):
                    attrs[key] = fix(attrs[key])
            for slot in getattr(type(obj), "__slots__", ()):
                if isinstance(slot, str) and hasattr(obj, slot):
                    try:
                        setattr(obj, slot, fix(getattr(obj, slot)))
                    except (AttributeError, TypeError):
                        pass


def hold_groups() -> list[list[dist.ProcessGroup]]:
    """Every group torch knows, each in a box of its own, for `release` to free.

    Freeing a gloo group closes its connections, and each close waits for a tick of gloo's
    event loop (up to 10 ms when idle, gloo/transport/tcp/loop.cc): Megatron's ~50 groups freed
    one after another took 0.36-0.45 s (6 ms of CPU). Held in boxes while torch forgets them
    (an abort), they are freed in parallel instead (`_free_in_parallel`)."""
    return [[pg] for pg in dist.distributed_c10d._world.pg_map]


def release(
    roots: Iterable[Any],
    extra: dict[str, Any] | None = None,
    held: list[list[dist.ProcessGroup]] | None = None,
) -> int:
    """Abort this generation: swap every group handle in `roots` for a `GroupSlot`, then
    abort all groups (`devices.abort_groups`, a no-op when the caller aborted already), so
    peers blocked in a collective with this rank fail now rather than at the process-group
    timeout; with no reference left the groups are freed. Returns the number of handles
    released. `held`: groups boxed by `hold_groups` before the caller aborted them."""
    boxes = hold_groups() + (held or [])
    names = group_names(extra)
    alive = [weakref.ref(box[0]) for box in boxes]
    count = 0

    def visit(value: Any) -> Any | None:
        nonlocal count
        if is_group(value):
            count += 1
            alive.append(weakref.ref(value))
            return GroupSlot(names.get(id(value), f"unknown:{id(value):#x}"))
        return None

    _walk(roots, visit)
    if extra:
        extra.clear()  # the caller's handles go too: nothing may keep a released group alive
    _abort_world()
    _free_in_parallel(boxes)
    # Usually reference counting alone frees the groups; a cycle needs the collector, and a
    # full collection costs ~0.5 s on Megatron's heap, so go step by step.
    for generation in (0, 2):
        if not any(ref() is not None for ref in alive):
            break
        gc.collect(generation)
    left = sorted({names.get(id(ref()), "?") for ref in alive if ref() is not None})
    if left:
        log.warning(
            "released process group(s) %s are still referenced somewhere; peers blocked on "
            "this rank will wait for their collective timeout",
            left,
        )
    return count


def _abort_world() -> None:
    """Abort every group of this process (`devices.abort_groups`) and let `parallel_state`
    drop them."""
    abort_groups()  # first: destroy_model_parallel would destroy its gloo groups gracefully
    ps.destroy_model_parallel()
    # destroy_model_parallel (0.16.1) leaves a few globals set, e.g.
    # _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP(_GLOO): clear whatever still holds a group.
    for name in group_globals():
        setattr(ps, name, None)


def _free_in_parallel(boxes: list[list[dist.ProcessGroup]]) -> None:
    """Drop the last references to the groups in `boxes`, one thread per group (the
    destructors wait on gloo's event loops without the GIL, so they overlap)."""
    threads = [start_thread(box.clear, name="deadpool-free-group", daemon=False) for box in boxes]
    boxes.clear()
    for thread in threads:
        thread.join()


def attach(
    roots: Iterable[Any], extra: dict[str, Any] | None = None, stale: list[str] | None = None
) -> int:
    """Replace every `GroupSlot` in `roots` by the new generation's group of that name.

    With `stale`, the same walk also appends what `stale_group_refs` would report (one walk
    over Megatron's objects instead of two)."""
    return _put_back(roots, lambda v: v.name if isinstance(v, GroupSlot) else None, extra, stale)


def _put_back(
    roots: Iterable[Any],
    name_of: Callable[[Any], str | None],
    extra: dict[str, Any] | None,
    stale: list[str] | None,
) -> int:
    """Replace each value in `roots` that `name_of` names by the current world's group of that
    name; returns how many. With `stale`, also list the groups met that are not the current
    world's."""
    groups = groups_by_name(extra)
    live = {id(pg) for pg in dist.distributed_c10d._world.pg_map}
    count = 0
    missing: list[str] = []

    def visit(value: Any) -> Any | None:
        nonlocal count
        name = name_of(value)
        if name is not None:
            if name not in groups:
                missing.append(name)
                return None
            count += 1
            return groups[name]
        if stale is not None and is_group(value) and id(value) not in live:
            stale.append(f"{value!r} (id {id(value):#x})")
        return None

    _walk(roots, visit)
    if missing:
        raise RuntimeError(f"no new group for released handles: {sorted(set(missing))}")
    return count


Held = dict[int, tuple[str, dist.ProcessGroup]]
"""id -> (name, group) of a world torch forgot while objects still hold its groups (`forget`)."""


def forget() -> Held:
    """A newcomer's private world goes: torch forgets its groups (an abort: `devices.abort`
    with `keep_groups(False)`) and `parallel_state` drops them, while the objects built in it
    keep their handles - returned by id with their names (`group_names`), and held (so no id
    is reused) until `swap` puts the real world's groups of the same names in their place.
    One walk over the objects instead of `release`'s and `attach`'s two: a private world's
    groups (torch's fake backend) have no connections to close and no peer waits on them."""
    names = group_names()
    held = {
        id(pg): (names.get(id(pg), f"unknown:{id(pg):#x}"), pg)
        for pg in dist.distributed_c10d._world.pg_map
    }
    _abort_world()
    return held


def swap(
    roots: Iterable[Any],
    held: Held,
    extra: dict[str, Any] | None = None,
    stale: list[str] | None = None,
) -> int:
    """Replace every group of the forgotten world (`forget`) in `roots` by the current world's
    group of its name; returns how many. With `stale`, the same walk appends what
    `stale_group_refs` would report."""

    def name_of(value: Any) -> str | None:
        return held[id(value)][0] if is_group(value) and id(value) in held else None

    return _put_back(roots, name_of, extra, stale)


def stale_group_refs(roots: Iterable[Any]) -> list[str]:
    """Descriptions of groups reachable from `roots` that are not in the current world."""
    live = {id(pg) for pg in dist.distributed_c10d._world.pg_map}
    stale: list[str] = []

    def visit(value: Any) -> Any | None:
        if is_group(value) and id(value) not in live:
            stale.append(f"{value!r} (id {id(value):#x})")
        return None

    _walk(roots, visit)
    return stale


def check_rebindable(roots: Iterable[Any], extra: dict[str, Any]) -> None:
    """Once the job's objects exist (`Driver.bind`): refuse, in one line, a process group they
    hold that a recovery could not rebind (`unnamed_groups`: not one of Megatron's
    `parallel_state` groups, nor in `extra`)."""
    unnamed = unnamed_groups(roots, extra)
    if unnamed:
        raise ConfigError(
            f"--deadpool cannot protect this run: the job's objects hold {len(unnamed)} "
            f"process group(s) that are none of Megatron's parallel_state groups "
            f"({', '.join(unnamed[:3])}), which a hot swap could not rebuild and rebind"
        )


def unnamed_groups(roots: Iterable[Any], extra: dict[str, Any] | None = None) -> list[str]:
    """Groups reachable from `roots` that `release` could not name - neither WORLD nor a
    `parallel_state` global nor in `extra` - so that `attach` would find no group to put back:
    each as its ranks (one entry per group)."""
    names = group_names(extra)
    found: dict[int, str] = {}

    def visit(value: Any) -> Any | None:
        if is_group(value) and id(value) not in names:
            try:
                ranks = dist.get_process_group_ranks(value)
            except (RuntimeError, ValueError):  # not a group of this world
                ranks = []
            found.setdefault(id(value), f"a group of ranks {ranks}")
        return None

    _walk(roots, visit)
    return list(found.values())
