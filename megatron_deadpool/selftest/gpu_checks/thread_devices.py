"""Every thread DeadPool started selected the rank's CUDA device (N1).

A new thread's current device is 0: a thread that calls the CUDA runtime without selecting the
rank's device (an event query on the heartbeat thread, an event synchronize on the poster
thread) creates a context on GPU 0 for every other rank of the node. One GPU cannot show the
extra context, but it can show which device each thread selected:
`devices.threads.device_threads()` maps each live thread DeadPool started to the CUDA device
index it selected (None: none). The probe runs a round with pinned host replicas (the poster and
the verifier threads) while a heartbeat runs the plan watch and the device watch, then asks.
`devices.threads` comes with the N1 fix; without it the row fails saying so.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .base import Outcome, adam_state, replicator_of_one, world_of_one

Lookup = Callable[[], Mapping[str, "int | None"]]


def lookup() -> Lookup | None:
    """`devices.threads.device_threads`, or None where this build lacks it."""
    try:
        module = importlib.import_module("megatron_deadpool.devices.threads")
    except ImportError:
        return None
    found = getattr(module, "device_threads", None)
    return found if callable(found) else None


def judge(found: Mapping[str, int | None] | None, device: int) -> tuple[bool, str]:
    """(passed, what was wrong) for the threads' devices `found` (None: no way to ask)."""
    if found is None:
        return False, "devices.threads missing: this build cannot tell which device its threads use"
    if not found:
        return False, "no DeadPool thread recorded (expected the heartbeat, poster and verifier)"
    wrong = {name: dev for name, dev in sorted(found.items()) if dev != device}
    if wrong:
        shown = ", ".join(f"{name} -> {'none' if d is None else d}" for name, d in wrong.items())
        return False, f"threads not on the rank's device {device}: {shown}"
    return True, ""


def check() -> Outcome:
    """The row (CUDA): a round with pinned host replicas beside a heartbeat, then every
    DeadPool thread's device."""
    import torch.distributed as dist

    from ...devices.health import DeviceWatch
    from ...hotswap.connection import Heartbeat, open_client
    from ...hotswap.membership import Membership, host_store
    from ...hotswap.seal import JobSeal, new_secret

    ask = lookup()
    world_of_one()
    device = torch.cuda.current_device()
    group = dist.new_group(backend="nccl")
    host_group = dist.new_group(backend="gloo")
    store = host_store("127.0.0.1", 0)
    membership = Membership(store, "a0", JobSeal(new_secret()))
    gpu_watch = DeviceWatch(60.0, end=lambda code, why: None)
    beat = Heartbeat(membership.sibling(open_client(f"127.0.0.1:{store.port}", 30)), 0.1)
    beat.after_beat = gpu_watch
    beat.start()
    state = adam_state((256 << 20) // 12)
    repl = replicator_of_one(state, group, "cpu", host_group=host_group)
    figures: dict[str, Any] = {"device": device, "pinned": bool(repl.pinned)}
    try:
        for it in (1, 2):
            repl.start_round(it)
            gpu_watch.step_done(it)
            repl.before_step()
            figures[f"committed_{it}"] = repl.finish_round()
        found = dict(ask()) if ask is not None else None
    finally:
        beat.stop(5)
    figures["threads"] = found
    ok, note = judge(found, device)
    if ok and figures["committed_2"] != 2:
        ok, note = False, f"round 2 not committed ({figures['committed_2']})"
    return {"status": "pass" if ok else "FAIL", "figures": figures, "note": note}
