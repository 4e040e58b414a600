"""The NCCL decisions DeadPool makes: process settings, eager communicators, aborting.

Everything here is checked against torch 2.13 (`torch/distributed/distributed_c10d.py` of the
installed wheel; ProcessGroupNCCL's C++ and its environment-variable table in
`ProcessGroupNCCL.hpp` / the "PYTORCH ProcessGroupNCCL Environment Variables" page).

Settings (`apply_settings`, called once per process before its first NCCL group exists, i.e.
by `devices.select_device` for the CUDA path; ProcessGroupNCCL reads them in its constructor):

- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (required). torch's default (3, "SkipCleanUp") makes
  the watchdog thread tear the process down when a collective fails or times out; 1 aborts
  the communicator and tears down; 2 aborts each communicator on its own. A survivor must
  live and abort *all* its communicators together itself (below), and
  `_abort_process_group` says it "should be used with TORCH_NCCL_ASYNC_ERROR_HANDLING turned
  off (i.e. set to 0)". A user value other than 0 (also under the deprecated name
  ``NCCL_ASYNC_ERROR_HANDLING``) is refused with a `ConfigError`.
- ``TORCH_NCCL_ENABLE_MONITORING=0`` (default, a user value is kept). The heartbeat monitor's
  only action is to kill a process whose watchdog looks stuck (``TORCH_NCCL_HEARTBEAT_TIMEOUT_
  SEC``, 480 s), which is what a survivor's watchdog can look like while a peer hangs;
  DeadPool's own heartbeat names hung ranks and replaces them instead.
- ``TORCH_NCCL_BLOCKING_WAIT`` is left alone: with 0 (default) `Work.wait()` only orders the
  current stream after the collective, so a main thread blocked on a dead peer sits in the
  next `.item()` / `synchronize()`, and the driver's watcher thread calling `abort_groups`
  is what makes the kernels return and the next collective raise (`DistBackendError`).

Communicators per generation (`init_kwargs`, `warm_groups`; ``DEADPOOL_NCCL_INIT``):

- ``split`` (default): ``device_id`` in `init_process_group` forms the default group's
  communicator immediately ("calling ncclCommInit* immediately rather than the normal lazy
  call") and every later `new_group` is split from it (`_new_process_group_helper` with
  ``split_from``, torch 2.13 `distributed_c10d.py` ~2040-2057 and ~2200): a new generation's
  communicators exist before its first iteration. The price: every `new_group` is an
  ``ncclCommSplit`` of the world communicator - a bootstrap all-gather over every rank, also on
  the ranks outside the group (``perform_nocolor_split``) - so Megatron's few hundred groups at
  a thousand ranks cost as many world-wide all-gathers per generation, and a group created by
  only some ranks would hang in the split (NVIDIA-NeMo/RL#3189; DeadPool creates none).
- ``warm``: no ``device_id``; after the generation's groups exist, `warm_groups` runs one
  one-element all-reduce on the world, then on each of this rank's own NCCL groups in creation
  order: each communicator is set up by its members only (``ncclCommInitRank`` over the group),
  and the common creation order on every rank keeps those blocking set-ups free of cycles.
  Which is faster at scale is what a multi-node measurement must decide (not done yet).

Abort (`abort_all`): torch 2.13's `_abort_process_group()` calls ``ncclGroupStart`` of the
default group's backend on the caller's thread and then each group's ``abort()``, but
``ProcessGroupNCCL::abort`` runs its communicators' aborts on a ``std::async`` thread of its
own and waits for it up to the group's timeout, and NCCL's group state is per thread: the
groups are in fact aborted one at a time, each inside its own ``ncclGroupStart/End`` (NCCL >=
2.22, `abortCommsFromMap`), so one group's abort can wait for a kernel of another group that
is not aborted yet (the deadlock of NVIDIA/nccl#1013, #829). Python reaches no raw
communicator to group every ``ncclCommAbort`` on one thread; `abort_all` instead starts every
NCCL group's abort at the same time, each on a thread of its own, so that no group's abort
waits for another's to begin (``ncclCommAbort`` raises its communicator's abort flag, which
ends that communicator's kernels), then lets `_abort_process_group()` forget the groups (a
second abort of an aborted communicator is a no-op: ``NCCLComm::abort`` has set it to null).
A graceful `destroy_process_group` is never used with a dead peer: it calls
`ProcessGroupNCCL::shutdown()`, which waits for the failed kernels (pytorch#150690).

Errors (`backend_errors`): each NCCL backend's `get_error()` (`ProcessGroupNCCL.get_error`,
`ErrorType` SUCCESS / TIMEOUT / COMM_ERROR / REMOTE_ERROR), which ProcessGroupNCCL's watchdog
sets when a collective of the group timed out (host time since it was enqueued, against the
group's timeout) or NCCL reported an asynchronous error; REMOTE_ERROR comes from a peer's
watchdog through the store (``TORCH_NCCL_PROPAGATE_ERROR``). With
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` nothing else acts on it: the heartbeat thread polls it
(`hotswap.worker.plan_watch`) and aborts, so the main thread blocked behind the failed kernel raises.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .threads import start_thread

log = logging.getLogger(__name__)

REQUIRED: dict[str, str] = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
"""Settings DeadPool cannot work without; a different user value is refused."""

DEPRECATED_NAMES: dict[str, str] = {"NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
"""Older names torch still reads for the same setting (the TORCH_ name takes precedence)."""

DEFAULTS: dict[str, str] = {"TORCH_NCCL_ENABLE_MONITORING": "0"}
"""Settings DeadPool applies unless the user set them."""

_WHY = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": (
        "the NCCL watchdog would tear a survivor down (modes 1, 3) or abort its communicators "
        "one by one (mode 2) when a peer fails; DeadPool aborts them all itself"
    ),
}


def apply_settings(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put DeadPool's NCCL settings into `environ` (default: this process's environment).

    Returns the settings it applied. Raises `ConfigError` naming the variable and the fix when
    the user set one of `REQUIRED` (or its deprecated name) to another value.
    """
    env = os.environ if environ is None else environ
    for old, new in DEPRECATED_NAMES.items():
        if old in env and new not in env and env[old] != REQUIRED[new]:
            raise ConfigError(
                f"{old}={env[old]}: {_WHY[new]}; unset it or set {new}={REQUIRED[new]}"
            )
    applied: dict[str, str] = {}
    for name, value in REQUIRED.items():
        if name in env and env[name] != value:
            raise ConfigError(f"{name}={env[name]}: {_WHY[name]}; unset it or set {name}={value}")
        env[name] = applied[name] = value
    for name, value in DEFAULTS.items():
        if name not in env:
            env[name] = applied[name] = value
    return applied


InitMode = Literal["split", "warm"]

INIT_MODE_VARIABLE = "DEADPOOL_NCCL_INIT"


def init_mode(environ: MutableMapping[str, str] | None = None) -> InitMode:
    """How a generation's NCCL communicators are set up (module docstring): ``split``
    (default) or ``warm``; any other value of ``DEADPOOL_NCCL_INIT`` is refused."""
    env = os.environ if environ is None else environ
    value = env.get(INIT_MODE_VARIABLE, "split").strip().lower() or "split"
    if value not in ("split", "warm"):
        raise ConfigError(
            f"{INIT_MODE_VARIABLE}={env[INIT_MODE_VARIABLE]}: expected split (communicators "
            "split from the world's at creation) or warm (set up by each group's members "
            "after creation); unset it for split"
        )
    return value  # type: ignore[return-value]


def init_kwargs(backend: str, mode: InitMode | None = None) -> dict[str, Any]:
    """Extra `init_process_group` arguments: ``device_id`` (the current CUDA device, which
    `select_device` or Megatron-LM's start-up sets before the first group) for eager NCCL
    communicators split from the world's (mode ``split``); nothing for gloo or mode ``warm``."""
    if "nccl" not in backend or (mode or init_mode()) == "warm":
        return {}
    return {"device_id": torch.device("cuda", torch.cuda.current_device())}


def nccl_backend(group: Any) -> Any | None:
    """The NCCL backend of `group` (a `ProcessGroup`), or None when it has none."""
    try:
        backend = group._get_backend(torch.device("cuda"))
    except (RuntimeError, AttributeError):
        return None
    return backend if type(backend).__name__ == "ProcessGroupNCCL" else None


def known_groups() -> list[Any]:
    """Every process group torch knows in this process, in creation order (a copy: safe from
    another thread while the main thread creates groups)."""
    c10d = dist.distributed_c10d
    for _ in range(3):
        try:
            return list(c10d._world.pg_map)
        except RuntimeError:  # the dict changed size while it was copied
            continue
    return []


def warm_groups(groups: Iterable[Any] | None = None, mode: InitMode | None = None) -> int:
    """Mode ``warm``: set up the communicator of each NCCL group of this rank with one
    one-element all-reduce, the world first, then in creation order (every rank of a group
    reaches it in the same order); returns how many. Nothing in mode ``split``."""
    if (mode or init_mode()) != "warm" or not dist.is_initialized():
        return 0
    world = dist.distributed_c10d._get_default_group()
    ordered = [world, *(g for g in (groups or known_groups()) if g is not world)]
    count = 0
    for group in ordered:
        if nccl_backend(group) is None:
            continue
        dist.all_reduce(torch.zeros(1, device="cuda"), group=group)
        count += 1
    return count


def backend_errors(groups: Iterable[Any] | None = None) -> list[str]:
    """ "GROUP: ERROR" for every NCCL backend whose `get_error()` is not SUCCESS (TIMEOUT,
    COMM_ERROR, REMOTE_ERROR); empty when all are fine, or where torch has no `get_error`."""
    out: list[str] = []
    for group in known_groups() if groups is None else groups:
        backend = nccl_backend(group)
        get_error = getattr(backend, "get_error", None)
        if get_error is None:
            continue
        try:
            error = get_error()
        except RuntimeError:  # the group is being torn down
            continue
        name = getattr(error, "name", str(error)).split(".")[-1]
        if name != "SUCCESS":
            out.append(f"{getattr(group, 'group_name', '?')}: {name}")
    return out


def abort_all(forget: Callable[[], object] | None = None) -> bool:
    """Abort every process group of this process; False when there was none.

    Every NCCL group's abort starts at the same time, each on a thread of its own (module
    docstring), all are waited for, then torch forgets every group
    (`_abort_process_group()`); a gloo group's `abort()` is a no-op (see `devices.gloo` for
    what unblocks a gloo collective). Afterwards torch knows no group: the next generation
    starts with `init_process_group`. `forget` (tests) replaces the final step.
    """
    if not dist.is_initialized():
        return False
    abort_concurrently([b for b in map(nccl_backend, known_groups()) if b is not None])
    (forget or dist.distributed_c10d._abort_process_group)()
    return True


def abort_concurrently(backends: list[Any]) -> float:
    """Call `abort()` on every backend at once, one thread each, and wait for all; returns
    the seconds it took. An error is logged: `_abort_process_group` aborts that group again."""
    t0 = time.perf_counter()

    def one(backend: Any) -> None:
        try:
            backend.abort()
        except RuntimeError as exc:
            log.warning("aborting an NCCL group: %s", str(exc).splitlines()[0][:200])

    threads = [start_thread(one, b, name="deadpool-nccl-abort") for b in backends]
    for thread in threads:
        thread.join()
    return time.perf_counter() - t0
