"""A plan-watch abort while the heartbeat keeps beating, optionally with `DeviceWatch` after
every beat (as the driver runs it: `hotswap.worker.driver`'s `_after_beat`).

A world of one with ten NCCL groups; the heartbeat thread runs the plan watch (and the device
watch); the GPU is made busy for seconds and the main thread waits behind it in `.item()`;
the coordinator's plan arrives: the plan watch must abort the groups off the heartbeat thread,
the heartbeat must keep beating meanwhile (no lost coordinator), and the device watch, querying
the busy step's event from the heartbeat thread every beat, must neither raise nor end the
process (its bound is far away).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .base import Outcome, world_of_one

MIN_BEATS = 5
DEVICE_WATCH_BOUND_S = 60.0


@dataclass(frozen=True)
class BeatFigures:
    """What one run of the probe saw."""

    fired: bool
    """The plan watch acted on the plan."""
    aborted: bool
    """An abort of the groups completed."""
    beats: int
    """Beats counted while the main thread waited and the abort ran."""
    lost: str | None
    """Why the heartbeat lost the coordinator, if it did."""
    watch_calls: int | None
    """Device-watch checks completed after beats (None: no device watch)."""
    ended: str | None
    """Why the device watch ended the process (recorded, not done), if it did."""


def judge(seen: BeatFigures) -> tuple[bool, str]:
    """(passed, what went wrong)."""
    problems = []
    if not seen.fired:
        problems.append("the plan watch did not act on the plan")
    if not seen.aborted:
        problems.append("no abort of the groups completed")
    if seen.beats < MIN_BEATS:
        problems.append(f"{seen.beats} beats during the abort (at least {MIN_BEATS} expected)")
    if seen.lost is not None:
        problems.append(f"the heartbeat lost the coordinator: {seen.lost}")
    if seen.watch_calls is not None and seen.watch_calls < MIN_BEATS:
        problems.append(f"the device watch completed {seen.watch_calls} checks after beats")
    if seen.ended is not None:
        problems.append(f"the device watch would have ended the process: {seen.ended}")
    return not problems, "; ".join(problems)


def measure(device_watch: bool) -> tuple[BeatFigures, dict[str, Any]]:
    """Run the probe (CUDA); its figures and the timings beside them."""
    import torch.distributed as dist

    from ...devices import abort, nccl
    from ...devices.health import DeviceWatch
    from ...hotswap.protocol.connection import Heartbeat, open_client
    from ...hotswap.protocol.membership import Membership, host_store
    from ...hotswap.protocol.messages import Plan
    from ...hotswap.protocol.seal import JobSeal, new_secret
    from ...hotswap.worker.plan_watch import PlanWatch

    store = host_store("127.0.0.1", 0)
    membership = Membership(store, "a0", JobSeal(new_secret()))
    world_of_one(groups=10)
    watch = PlanWatch(abort.start_abort, errors=nccl.backend_errors)
    watch.joined(0)
    abort.bound_aborts(20.0)
    ended: list[str] = []
    gpu_watch = (
        DeviceWatch(DEVICE_WATCH_BOUND_S, end=lambda code, why: ended.append(f"{code}: {why}"))
        if device_watch
        else None
    )
    calls = [0]

    def after_beat(m: Membership) -> None:  # what the driver's `_after_beat` does
        watch(m)
        if gpu_watch is not None:
            gpu_watch(m)
            calls[0] += 1

    beat = Heartbeat(membership.sibling(open_client(f"127.0.0.1:{store.port}", 30)), 0.1)
    beat.after_beat = after_beat
    beat.start()
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)
    torch.cuda._sleep(int(6e9))  # the main thread will wait behind this (no NCCL work queued)
    if gpu_watch is not None:
        gpu_watch.step_done(1)  # a step whose work is queued behind the sleep
    x = x * 2
    plan = Plan(generation=1, base=0, world_size=1, dead=(0,), needy=(0,), replaced={0: "s0"})
    threading.Timer(0.5, membership.publish_plan, (plan,)).start()
    t0 = time.perf_counter()
    beats0 = membership.heartbeat_counts(["a0"])[0]
    calls0 = calls[0]
    try:
        x.item()
        returned = "returned"
    except RuntimeError as exc:
        returned = f"raised: {str(exc).splitlines()[0][:80]}"
    waited = time.perf_counter() - t0
    deadline = time.monotonic() + 20
    while abort.last_abort() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    beats = membership.heartbeat_counts(["a0"])[0] - beats0
    report = abort.last_abort()
    beat.stop(5)
    seen = BeatFigures(
        fired=watch.fired is not None,
        aborted=report is not None,
        beats=beats,
        lost=beat.lost,
        watch_calls=calls[0] - calls0 if gpu_watch is not None else None,
        ended=ended[0] if ended else None,
    )
    extra = {
        "abort_s": report.seconds if report else None,
        "main_thread_waited_s": round(waited, 2),
        "main_thread": returned,
    }
    return seen, extra


def check(device_watch: bool = False) -> Outcome:
    """The row: the probe, judged."""
    seen, extra = measure(device_watch)
    ok, note = judge(seen)
    return {"status": "pass" if ok else "FAIL", "figures": {**asdict(seen), **extra}, "note": note}
