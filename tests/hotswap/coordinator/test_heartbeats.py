"""Heartbeats are counters timed on the coordinator's own clock; agreement blocks on the store.

The skewed-clock case runs real worker processes whose wall clocks are an hour off (one behind,
one ahead) against the real coordinator and store: a live process must not look hung, and a
hung (SIGSTOPped) one must be named within the timeout whatever its clock says.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from procs import wait_until
from stores import SEAL, TEST_SECRET, Recording, keys_waited_on

from megatron_deadpool.hotswap.coordinator.heartbeats import HeartbeatClock
from megatron_deadpool.hotswap.protocol.messages import CLAIMED, GIVEN_UP, Decision, Plan, Roster
from megatron_deadpool.hotswap.protocol.seal import SECRET_ENV


def test_clock_judges_counters_by_when_they_change() -> None:
    clock = HeartbeatClock()
    assert clock.sweep(["a0", "a1"], [0, 1], now=0.0, timeout=2.0) == []
    assert clock.age("a0", 5.0) is None  # never beat: starting up, not judged
    assert clock.sweep(["a0", "a1"], [0, 1], now=2.5, timeout=2.0) == [("a1", 2.5)]
    assert clock.sweep(["a0", "a1"], [3, 2], now=3.0, timeout=2.0) == []  # both moved
    assert clock.age("a1", 4.0) == 1.0 and clock.last_change("a0") == 3.0
    assert clock.sweep(["a0", "a1"], [3, 2], now=5.5, timeout=2.0) == [("a0", 2.5), ("a1", 2.5)]


_WORKER = """
import sys, time
from megatron_deadpool.hotswap.protocol.connection import Heartbeat, open_client
from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.seal import JobSeal, job_secret
SEAL = JobSeal(job_secret())
skew = float(sys.argv[3])
real = time.time
time.time = lambda: real() + skew  # this host's wall clock is off by `skew` seconds
Membership(open_client(sys.argv[1], 30), sys.argv[2], SEAL).announce()
Heartbeat(Membership(open_client(sys.argv[1], 30), sys.argv[2], SEAL), 0.2).start()
print("beating", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(120)
def test_skewed_worker_clocks_neither_hide_a_hang_nor_fake_one(tmp_path: Path) -> None:
    from megatron_deadpool.hotswap.coordinator.coordinator import Coordinator
    from megatron_deadpool.hotswap.coordinator.events import EventLog
    from megatron_deadpool.hotswap.coordinator.liveness import HeartbeatOnly
    from megatron_deadpool.hotswap.protocol.membership import Membership, host_store

    store = host_store("127.0.0.1", 0)
    coord = Coordinator(
        Membership(store, "coordinator", SEAL),
        2,
        None,
        [],
        heartbeat_timeout=1.5,
        agree_timeout=60.0,
        liveness=HeartbeatOnly(),
        events=EventLog(tmp_path / "events.jsonl"),
        sweep_interval=0.1,
    )
    coord.start()
    skews = {"a0": -3600.0, "a1": +3600.0}  # behind: looked hung at once; ahead: never hung
    procs = {
        member: subprocess.Popen(
            [sys.executable, "-c", _WORKER, f"127.0.0.1:{store.port}", member, str(skew)],
            env={**os.environ, SECRET_ENV: TEST_SECRET},
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for member, skew in skews.items()
    }
    try:
        for proc in procs.values():
            assert proc.stdout.readline().strip() == "beating"

        def tick_for(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                coord.tick()
                time.sleep(0.05)

        tick_for(3.0)  # twice the timeout: both alive, whatever their clocks say
        assert coord.dead == set()
        os.kill(procs["a1"].pid, signal.SIGSTOP)  # hung, with its clock an hour ahead
        t0 = time.monotonic()
        while "a1" not in coord.dead and time.monotonic() - t0 < 10.0:
            coord.tick()
            time.sleep(0.05)
        named = time.monotonic()
        assert coord.dead == {"a1"}
        # Silence is counted from the last beat the coordinator saw (before the SIGSTOP, by up
        # to one beat and one sweep): never named before a full timeout of it, and not late.
        last_beat = coord.detector.beats.last_change("a1")
        assert last_beat is not None and t0 - last_beat < 0.2 + 0.1 + 0.2
        assert 1.5 <= named - last_beat and named - t0 < 4.0
        dead = coord.events.of("process_dead")
        assert dead[0]["member"] == "a1" and "(hung)" in dead[0]["why"]
    finally:
        for proc in procs.values():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        coord.close()


@pytest.mark.timeout(240)  # importing megatron-core (under recovery) is slow on a busy machine
def test_agreement_blocks_until_decided_and_follows_a_superseding_plan() -> None:
    """A survivor reports for plan 1; more ranks die, plan 2 supersedes it; the survivor
    reports again and returns with roster 2 - without polling (it only ever blocks), and
    without reading the full roster (it applies the plan's replacements to its own)."""
    coord, plan, thread, out, survivor = _survivor_reported_for_plan_1()
    report = coord.holdings(1, 0)
    assert report is not None and report.last_completed == 7
    replaced = {1: "s1", 2: "s0"}
    coord.publish_plan(replace(plan, generation=2, needy=(1, 2), replaced=replaced))
    coord.decide(1, Decision.superseded(2))
    wait_until(lambda: coord.holdings_count(2) == 1, 10, "the report for plan 2")
    coord.decide(2, Decision.roster(6))  # no gen2/roster key: the survivor must not need it
    coord.claim_slot(2, 1)
    # It joins only once every newcomer claimed its slot: it blocks on s0's claim.
    _wait_blocked_on_claim(survivor, coord, thread, 2, 2)
    coord.claim_slot(2, 2)
    thread.join(10)
    assert "error" not in out, out
    assert out["roster"] == Roster(2, 3, {0: "a0", 1: "s1", 2: "s0"}, restore_iteration=6)


@pytest.mark.timeout(240)
def test_a_newcomer_lost_before_its_claim_sends_the_survivor_to_the_next_plan() -> None:
    """Plan 1 is decided (rank 2 <- s0), but s0 dies before claiming its slot: the coordinator
    gives the slot up and plans generation 2 (rank 2 <- s1); the survivor, which waited for the
    claim instead of entering generation 1's rendezvous, reports for plan 2 and returns its
    roster. A claim made before the give-up stands (`compare_set`)."""
    coord, plan, thread, out, survivor = _survivor_reported_for_plan_1()
    coord.decide(1, Decision.roster(7))
    _wait_blocked_on_claim(survivor, coord, thread, 1, 2)  # waiting for s0's claim
    coord.give_up_slot(1, 2)
    assert coord.claim_slot(1, 2) == GIVEN_UP  # s0, had it lived: too late
    coord.publish_plan(replace(plan, generation=2, base=1, replaced={2: "s1"}))
    coord.decide(1, Decision.superseded(2))
    wait_until(lambda: coord.holdings_count(2) == 1, 10, "the report for plan 2")
    coord.publish_roster(Roster(2, 3, {0: "a0", 1: "a1", 2: "s1"}, restore_iteration=7))
    coord.decide(2, Decision.roster(7))
    assert coord.claim_slot(2, 2) == CLAIMED
    coord.give_up_slot(2, 2)  # after the claim: no effect
    thread.join(10)
    assert "error" not in out, out
    assert out["roster"] == Roster(2, 3, {0: "a0", 1: "a1", 2: "s1"}, restore_iteration=7)


def _survivor_reported_for_plan_1() -> tuple[Any, Plan, threading.Thread, dict, Recording]:
    """A store, the coordinator's view of it, and a survivor in agreement that has reported
    for plan 1 (rank 2 <- s0): (coordinator membership, plan 1, the survivor's thread, its
    result dict, the survivor's recording store)."""
    from megatron_deadpool.hotswap.protocol.membership import Membership, host_store

    store = host_store("127.0.0.1", 0)
    coord = Membership(store, "coordinator", SEAL)
    survivor = Recording(store.clone())
    thread, out = _survivor_in_agreement(Membership(survivor, "a0", SEAL))
    plan = Plan(generation=1, base=0, world_size=3, dead=(2,), needy=(2,), replaced={2: "s0"})
    coord.publish_plan(plan)
    wait_until(lambda: coord.holdings_count(1) == 1, 10, "the report for plan 1")
    return coord, plan, thread, out, survivor


def _wait_blocked_on_claim(
    survivor: Recording, coord: Any, thread: threading.Thread, generation: int, rank: int
) -> None:
    """Until the survivor blocks in a store wait on the newcomer's claim of `rank`'s slot in
    `generation` (which nobody made yet), then check it is still there."""
    claim = keys_waited_on(coord.store, lambda m: m.wait_newcomers(generation, [rank], 0.001))
    wait_until(lambda: survivor.waited_on(claim) or not thread.is_alive(), 10, f"a wait on {claim}")
    assert thread.is_alive() and survivor.waited_on(claim), survivor.ops


def _survivor_in_agreement(survivor) -> tuple[threading.Thread, dict]:
    """Rank 0 of a 3-rank generation 0 in `recovery.agree`, on a thread of its own; the dict
    gets its "roster", or its "error"."""
    from megatron_deadpool.hotswap.worker.recovery import Recovery

    out: dict = {}

    def run() -> None:
        try:
            steps = Recovery(survivor, "a0", 0, Roster(0, 3, {0: "a0", 1: "a1", 2: "a2"}), None)
            out["roster"] = steps.agree(
                {},
                last_completed=7,
                deadline=time.time() + 30,
                cause=RuntimeError("peer died"),
                salvage_target=lambda t: (None, None),
            )
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out
