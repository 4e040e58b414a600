"""The plan watch's decisions on a real store: when it aborts a survivor's groups, and when not;
and a real heartbeat that goes on beating while the abort it started runs (slow or hung), and
that takes only a store error after a beat for a lost coordinator.

(`tests/hotswap/worker/test_frozen_peer.py` runs it in a job with a frozen rank;
`tests/devices/test_abort_bound.py` ends a process whose abort outlives its bound.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from stores import SEAL

from megatron_deadpool.hotswap.protocol.connection import Heartbeat, open_client
from megatron_deadpool.hotswap.protocol.membership import Membership, host_store
from megatron_deadpool.hotswap.protocol.messages import EndReport, Plan, SaveOrder
from megatron_deadpool.hotswap.worker.plan_watch import PlanWatch

PLAN = Plan(generation=1, base=0, world_size=4, dead=(2,), needy=(2,), replaced={2: "s0"})
END = EndReport("lost", 8, (2,), (), SaveOrder(8, {2: 3}, True, ()))


@pytest.fixture
def membership() -> Iterator[Membership]:
    yield Membership(host_store("127.0.0.1", 0), "a1", SEAL)


def _watch() -> tuple[PlanWatch, list[int]]:
    aborts: list[int] = []
    return PlanWatch(lambda: aborts.append(1)), aborts


@pytest.mark.timeout(30)
def test_a_plan_the_main_thread_does_not_act_on_aborts_the_groups_one_beat_later(
    membership: Membership,
) -> None:
    watch, aborts = _watch()
    watch(membership)  # nothing joined yet: nothing to abort
    watch.joined(0)
    watch(membership)
    assert aborts == [] and watch.fired is None
    membership.publish_plan(PLAN)
    watch(membership)  # first sight: the main thread may be on its way into recovery
    assert aborts == []
    watch(membership)  # still not recovering a beat later: it is blocked
    assert aborts == [1] and "a generation after 0" in (watch.fired or "")
    watch(membership)
    assert aborts == [1]  # once per generation
    watch.recovering()
    watch.joined(1)
    assert watch.fired is None
    watch(membership)
    watch(membership)
    assert aborts == [1]  # generation 1's own plan is not news


@pytest.mark.timeout(30)
def test_a_main_thread_still_out_of_recovery_after_the_abort_gets_its_stack_logged(
    membership: Membership, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    aborts: list[int] = []
    watch = PlanWatch(lambda: aborts.append(1), stuck_s=1.0)
    watch.joined(0)
    membership.publish_plan(PLAN)
    watch(membership)
    watch(membership)
    assert aborts == [1]
    watch(membership)  # fired just now: not stuck yet
    assert "most recent call first" not in capfd.readouterr().err
    time.sleep(1.2)
    watch(membership)
    err = capfd.readouterr().err
    assert "most recent call first" in err and "test_plan_watch.py" in err, err
    (said,) = [r.getMessage() for r in caplog.records if "not entered recovery" in r.message]
    port = membership.store.port  # its own client's connection to the store it hosts
    assert f" -> 127.0.0.1:{port}" in said or f" -> ::ffff:127.0.0.1:{port}" in said, said
    watch(membership)
    assert capfd.readouterr().err == ""  # once

    # The next generation: this time the main thread enters recovery after the abort.
    watch.recovering()
    watch.joined(1)
    membership.publish_plan(replace(PLAN, generation=2, base=1))
    watch(membership)
    watch(membership)
    assert aborts == [1, 1]
    watch.recovering()
    time.sleep(1.2)
    watch(membership)
    assert capfd.readouterr().err == ""


@pytest.mark.timeout(30)
def test_the_main_threads_stack_is_shown_in_a_process_of_many_threads(
    membership: Membership, capfd: pytest.CaptureFixture[str]
) -> None:
    """faulthandler writes at most 100 threads, newest first: in a process with more (data
    loaders, pools) the main thread - the one stuck - would be cut off."""
    release = threading.Event()
    idle = [threading.Thread(target=release.wait, daemon=True) for _ in range(120)]
    for thread in idle:
        thread.start()
    try:
        watch = PlanWatch(lambda: None, stuck_s=0.2)
        watch.joined(0)
        membership.publish_plan(PLAN)
        watch(membership)
        watch(membership)
        time.sleep(0.3)
        watch(membership)
        err = capfd.readouterr().err
        main = err.split("Main thread (most recent call last):", 1)[-1].split("\n\n", 1)[0]
        assert "test_plan_watch.py" in main, err[:2000]
    finally:
        release.set()
        for thread in idle:
            thread.join(timeout=5)


@pytest.mark.timeout(30)
def test_a_main_thread_that_enters_recovery_first_is_left_alone(membership: Membership) -> None:
    watch, aborts = _watch()
    watch.joined(0)
    membership.publish_plan(PLAN)
    watch(membership)
    watch.recovering()  # its collective failed: it releases the groups itself
    watch(membership)
    watch.joined(1)
    watch(membership)
    assert aborts == []


@pytest.mark.timeout(30)
def test_after_training_the_end_report_aborts_too(membership: Membership) -> None:
    watch, aborts = _watch()
    watch.joined(0)
    membership.publish_end(END)
    watch(membership)
    watch(membership)
    assert aborts == []  # during training an end report is not the watch's business
    watch.training_completed()
    watch(membership)
    watch(membership)
    assert aborts == [1] and "after training" in (watch.fired or "")


@pytest.mark.timeout(30)
def test_a_collective_that_failed_silently_aborts_the_groups_one_beat_later(
    membership: Membership,
) -> None:
    """NCCL: a failed or timed-out collective raises nothing (blocking wait is off); its backend
    records it (`get_error`), and the watch aborts like for a plan."""
    aborts: list[int] = []
    failed: list[str] = []
    watch = PlanWatch(lambda: aborts.append(1), errors=lambda: list(failed))
    watch.joined(0)
    watch(membership)
    failed.append("tp: TIMEOUT")
    watch(membership)
    assert aborts == []  # the main thread gets its beat
    failed.append("dp: COMM_ERROR")  # more groups time out: still the same finding
    watch(membership)
    assert aborts == [1] and "collective of this rank failed (tp: TIMEOUT" in (watch.fired or "")


# ---------------------------------------------------------------------- a real heartbeat


@pytest.fixture
def stand_in_abort(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The abort's work replaced by one that blocks until the returned event is set (never,
    for a hung abort); unbounded, so this test process is not ended."""
    from megatron_deadpool.devices import abort

    release = threading.Event()
    monkeypatch.setattr(
        abort,
        "_abort_now",
        lambda: (release.wait(60), abort.AbortReport(0, False, 0.0, None))[1],
    )
    abort.bound_aborts(None)
    yield release
    release.set()


def _beating(store: Any, after_beat: Any) -> Heartbeat:
    beat = Heartbeat(Membership(open_client(f"127.0.0.1:{store.port}", 30), "a1", SEAL), 0.1)
    beat.after_beat = after_beat
    beat.start()
    return beat


def _beats(membership: Membership) -> int:
    return membership.heartbeat_counts(["a1"])[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("abort_kind", ["slow", "hung"])
def test_the_heartbeat_keeps_beating_while_the_plan_watch_aborts(
    abort_kind: str, stand_in_abort: threading.Event
) -> None:
    from megatron_deadpool.devices import abort

    store = host_store("127.0.0.1", 0)
    membership = Membership(store, "a1", SEAL)
    watch = PlanWatch(abort.start_abort)
    watch.joined(0)
    beat = _beating(store, watch)
    try:
        membership.publish_plan(PLAN)
        deadline = time.monotonic() + 20
        while watch.fired is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.fired is not None  # the abort started (and is still running)
        before = _beats(membership)
        time.sleep(1.5)
        assert _beats(membership) >= before + 4  # beating on through the abort
        if abort_kind == "slow":
            stand_in_abort.set()
            time.sleep(0.5)
            before = _beats(membership)
            time.sleep(0.5)
            assert _beats(membership) > before
        assert beat.lost is None and beat.is_alive()
    finally:
        beat.stop(5)


@pytest.mark.timeout(60)
def test_only_a_store_error_after_a_beat_means_the_coordinator_is_lost() -> None:
    from torch.distributed import DistBackendError

    from megatron_deadpool.errors import CoordinatorUnreachableError

    store = host_store("127.0.0.1", 0)
    membership = Membership(store, "a1", SEAL)
    raised: list[BaseException] = [DistBackendError("Future for ProcessGroup abort timed out")]

    def after_beat(_: Membership) -> None:
        if raised:
            raise raised[0]

    beat = _beating(store, after_beat)
    try:
        time.sleep(0.8)
        assert beat.lost is None and beat.is_alive()  # a RuntimeError of a group: beat on
        before = _beats(membership)
        time.sleep(0.5)
        assert _beats(membership) > before
        raised[0] = CoordinatorUnreachableError("no coordinator at 127.0.0.1:1")
        deadline = time.monotonic() + 10
        while beat.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert beat.lost is not None and "no coordinator" in beat.lost
    finally:
        beat.stop(5)


@pytest.mark.timeout(30)
def test_out_of_redundancy_after_the_plan_watch_fired_ends_the_step_loop() -> None:
    """Once the plan watch aborted this generation's groups, any error of the step loop counts
    as the peer failure that caused it - but not DeadPool's own: a recovery that ends out of
    redundancy raises it out of `Driver.recovering`, once. (Seen in the Slurm lab: a survivor
    whose plan watch fired before its collective failed met out of redundancy and, taking it for
    another peer failure, recovered again, 25 times a second, for ten minutes.)"""
    from stores import TEST_SECRET

    from megatron_deadpool.config.deadpool import DeadpoolConfig
    from megatron_deadpool.devices.base import Device
    from megatron_deadpool.errors import OutOfRedundancyError
    from megatron_deadpool.hotswap.worker.driver import Driver

    driver = Driver(
        DeadpoolConfig(), Device("cpu", "gloo"), coordinator="-", token=TEST_SECRET, member="a1"
    )
    assert not driver.is_peer_failure(ValueError("a bug"))
    driver.plan_watch.fired = "a plan for generation 1"
    assert driver.is_peer_failure(ValueError("whatever the aborted group raised"))
    recoveries: list[BaseException] = []

    def recover(exc: BaseException, *, target: int | None = None) -> int:
        recoveries.append(exc)
        raise OutOfRedundancyError("out of redundancy: no spare left to replace rank(s) [0]")

    def attempt(restored: int | None) -> None:
        raise RuntimeError("Connection closed by peer")

    driver.recover = recover  # type: ignore[method-assign]
    with pytest.raises(OutOfRedundancyError):
        driver.recovering(attempt)
    assert [str(e) for e in recoveries] == ["Connection closed by peer"]
