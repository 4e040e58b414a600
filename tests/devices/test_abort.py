"""`abort_groups` with a real SIGSTOPped peer: blocked gloo collectives return at once.

A stopped process keeps its sockets open, so without DeadPool a survivor blocked in a
collective with it waits for the group's timeout (60 s here). Three gloo processes create the
default group and two sub-groups (the way Megatron's groups exist next to WORLD); rank 2
stops itself with SIGSTOP. Ranks 0 and 1 each block one thread in an all-reduce on WORLD and
one in a receive from rank 2 on a sub-group, then call `abort_groups()`: every blocked
operation must raise within seconds, `is_peer_failure` must recognise what they raised, and
the survivors must then form the next generation's world (2 ranks) and reduce over it. A
control case shows that `ProcessGroup.abort()` alone (torch's own abort, a no-op for gloo)
leaves the threads blocked. The stopped rank is killed by the harness at the end.
"""

from __future__ import annotations

import datetime
import linecache
import os
import signal
import sys
import threading
import time
from typing import Any

import pytest
from mp import run_world
from procs import wait_stopped, wait_until

PG_TIMEOUT_S = 60.0


def _blocked(target: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """A thread running `target` (a collective that blocks), and what it raised and when."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            target()
            outcome["error"] = None
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _waiting_in_collective(thread: threading.Thread) -> bool:
    """Whether `thread` is in a torch.distributed call at its `work.wait()`: the operation is
    posted and the thread blocks on it (in C++, with the GIL released)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.endswith("distributed_c10d.py"):
            return linecache.getline(path, frame.f_lineno).strip() == "work.wait()"
        frame = frame.f_back
    return False


def _abort_rank(*, rank: int, world_size: int, store: Any, use_deadpool: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from megatron_deadpool.devices.abort import abort_groups
    from megatron_deadpool.devices.failures import is_peer_failure
    from megatron_deadpool.devices.gloo import tracked

    timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
    sub = dist.new_group([0, 1, 2], backend="gloo", timeout=timeout)
    pair = dist.new_group([0, 2], backend="gloo", timeout=timeout)  # members only use it
    dist.barrier()
    if rank == 2:
        store.set("stopping", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # never continued: the harness kills it
        time.sleep(3600)
    store.wait(["stopping"])
    wait_stopped(int(store.get("stopping")))
    threads = [_blocked(lambda: dist.all_reduce(torch.ones(1 << 16)))]
    if rank == 0:
        threads.append(_blocked(lambda: dist.recv(torch.empty(8), src=2, group=pair)))
    else:
        threads.append(_blocked(lambda: dist.all_reduce(torch.ones(4), group=sub)))
    wait_until(
        lambda: all(_waiting_in_collective(t) or not t.is_alive() for t, _ in threads),
        30,
        "both threads to block in their collective",
    )
    still_blocked = all(t.is_alive() for t, _ in threads)
    connections = len(tracked())
    # Neither survivor aborts before the other has seen its own threads block: an abort shuts
    # the connection between the two survivors as well, which ends the other's collectives.
    store.set(f"blocked{rank}", "1")
    store.wait([f"blocked{peer}" for peer in (0, 1)])
    t0 = time.monotonic()
    if use_deadpool:
        report = abort_groups()
        aborted = report.aborted
    else:
        for group in list(dist.distributed_c10d._world.pg_map):
            group.abort()  # torch's own abort: a no-op for gloo
        aborted = False
    for thread, _ in threads:
        thread.join(timeout=10.0 if use_deadpool else 3.0)
    returned_s = time.monotonic() - t0
    out: dict[str, Any] = {
        "blocked_before_abort": still_blocked,
        "tracked_connections": connections,
        "all_returned": not any(t.is_alive() for t, _ in threads),
        "returned_s": returned_s,
        "aborted": aborted,
        "errors": [repr(o.get("error")) for _, o in threads],
        "peer_failures": [
            o.get("error") is not None and is_peer_failure(o["error"]) for _, o in threads
        ],
    }
    if not use_deadpool:
        return out  # the harness kills this process (its threads wait for the group timeout)
    # The next generation: the two survivors alone.
    dist.init_process_group(
        backend="gloo",
        store=dist.PrefixStore("gen1", store),
        rank=rank,
        world_size=2,
        timeout=timeout,
    )
    total = torch.full((3,), float(rank + 1))
    dist.all_reduce(total)
    out["next_generation_sum"] = total.tolist()
    return out


@pytest.mark.timeout(120)
def test_abort_groups_unblocks_collectives_with_a_stopped_peer() -> None:
    results = run_world(
        "test_abort:_abort_rank", 3, kwargs={"use_deadpool": True}, timeout=90, optional=(2,)
    )
    for rank in (0, 1):
        r = results[rank]
        assert r["blocked_before_abort"], (r["errors"], r)
        assert r["tracked_connections"] >= 2, r  # WORLD and the sub-groups' gloo connections
        assert r["aborted"] and r["all_returned"], r
        assert r["returned_s"] < 5.0, r  # not the 60 s group timeout
        assert all(r["peer_failures"]), r  # what they raised is recognised as a peer failure
        assert r["next_generation_sum"] == [3.0, 3.0, 3.0], r


@pytest.mark.timeout(120)
def test_torch_abort_alone_leaves_gloo_collectives_blocked() -> None:
    """The control: torch's `ProcessGroup.abort()` does not unblock gloo (why `abort_groups`
    shuts the connections down)."""
    results = run_world(
        "test_abort:_abort_rank", 3, kwargs={"use_deadpool": False}, timeout=90, optional=(2,)
    )
    for rank in (0, 1):
        r = results[rank]
        assert r["blocked_before_abort"] and not r["all_returned"], r


def _unreached_rank(
    *, rank: int, world_size: int, store: Any, interruptible: bool
) -> dict[str, Any]:
    """Rank 0 blocks in an all-reduce that rank 1 (alive) never joins, over connections the
    abort does not know of - standing in for the operation gloo neither completes nor fails
    after its connection ended (a send under way, `devices.gloo`'s docstring), which no
    deterministic test can catch mid-write."""
    import torch
    import torch.distributed as dist

    from megatron_deadpool.devices import gloo
    from megatron_deadpool.devices.abort import abort_groups
    from megatron_deadpool.devices.failures import is_peer_failure

    if not interruptible:
        dist.Work.wait = gloo._INSTALLED["wait"]  # type: ignore[method-assign]
    pair = dist.new_group([0, 1], backend="gloo")
    dist.barrier(group=pair)
    if rank == 1:
        store.set("idle", "1")
        time.sleep(3600)  # never joins: the harness kills it
    store.wait(["idle"])
    gloo._TRACKED.clear()  # the abort shuts nothing down: gloo alone would never end the wait
    thread, outcome = _blocked(lambda: dist.all_reduce(torch.ones(8), group=pair))
    thread.join(timeout=1.0)
    blocked = thread.is_alive()
    t0 = time.monotonic()
    abort_groups()
    thread.join(timeout=10.0 if interruptible else 3.0)
    error = outcome.get("error")
    return {
        "blocked_before_abort": blocked,
        "returned": not thread.is_alive(),
        "returned_s": time.monotonic() - t0,
        "error": repr(error),
        "peer_failure": error is not None and is_peer_failure(error),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("interruptible", [True, False], ids=["interruptible", "gloo-alone"])
def test_a_collective_the_abort_cannot_reach_still_ends_with_it(interruptible: bool) -> None:
    """In CPU mode a wait on a collective ends within a slice of the abort, whether or not gloo
    ends the operation (`gloo.interruptible_waits`), and what it raises is a peer failure; the
    control ("gloo-alone") stays blocked."""
    r, _ = run_world(
        "test_abort:_unreached_rank",
        2,
        kwargs={"interruptible": interruptible},
        timeout=90,
        optional=(1,),
    )
    assert r["blocked_before_abort"], r
    if interruptible:
        assert r["returned"] and r["peer_failure"], r
        assert r["returned_s"] < 5.0, r
        assert "aborted" in r["error"], r
    else:
        assert not r["returned"], r
