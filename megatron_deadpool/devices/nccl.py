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

Eager communicators (`init_kwargs`): ``device_id`` in `init_process_group` forms the default
group's communicator immediately ("calling ncclCommInit* immediately rather than the normal
lazy call") and later `new_group`s are split from it (`ncclCommSplit`, `_new_process_group_
helper` with ``split_from``), so a new generation does not set communicators up one group and
one peer pair at a time inside its first iteration. Splitting requires every rank of the
parent group to create every sub-group in the same order, which Megatron's
`initialize_model_parallel` and DeadPool's replication group already do.

Abort (`abort_all`): `_abort_process_group()` (no group) aborts every group of the process
between ``ncclGroupStart``/``ncclGroupEnd`` of the default group's backend "so that different
NCCL communicators' abort calls won't deadlock each other" (pytorch#119797; NVIDIA/nccl#1013),
then forgets them all (`_world` is cleared). A graceful `destroy_process_group` is never used
with a dead peer: it calls `ProcessGroupNCCL::shutdown()`, which waits for the failed
kernels (pytorch#150690).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError

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


def init_kwargs(backend: str) -> dict[str, Any]:
    """Extra `init_process_group` arguments: ``device_id`` (the current CUDA device, which
    `select_device` or Megatron-LM's start-up sets before the first group) for eager NCCL
    communicators; nothing for gloo."""
    if "nccl" not in backend:
        return {}
    return {"device_id": torch.device("cuda", torch.cuda.current_device())}


def abort_all() -> bool:
    """Abort every process group of this process together; False when there was none.

    On NCCL the communicators are aborted inside one ``ncclGroupStart/End``; a gloo group's
    `abort()` is a no-op (see `devices.gloo` for what unblocks a gloo collective). Afterwards
    torch knows no group: the next generation starts with `init_process_group`.
    """
    if not dist.is_initialized():
        return False
    dist.distributed_c10d._abort_process_group()
    return True
