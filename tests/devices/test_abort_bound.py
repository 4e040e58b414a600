"""The abort off the caller's thread, bounded in time (`devices.abort`), and NCCL's aborts started
together (`devices.nccl.abort_concurrently`): the logic, with stand-ins for the abort's work.

- `start_abort` returns at once while a slow abort runs; `abort_groups` waits for it, and a
  second caller joins the run in progress instead of starting another;
- an abort still running when the bound passes ends the process with exit code 7 (a real
  subprocess whose stand-in abort never returns);
- every NCCL group's abort is started before any of them returns (stand-ins that wait for each
  other would deadlock if they ran one after another, as torch's own loop does).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from megatron_deadpool.devices import abort, nccl
from megatron_deadpool.errors import ExitCode


@pytest.fixture
def slow_abort(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The abort's work replaced by one that blocks until the returned event is set."""
    release = threading.Event()
    report = abort.AbortReport(0, False, 0.0, None)

    def work() -> abort.AbortReport:
        release.wait(30)
        return report

    monkeypatch.setattr(abort, "_abort_now", work)
    abort.bound_aborts(None)
    yield release
    release.set()


@pytest.mark.timeout(60)
def test_start_abort_returns_at_once_and_callers_join_the_run_in_progress(
    slow_abort: threading.Event,
) -> None:
    count = abort.abort_count()
    t0 = time.monotonic()
    run = abort.start_abort()
    assert time.monotonic() - t0 < 0.5 and not run.done.is_set()
    assert abort.start_abort() is run and abort.abort_count() == count + 1  # joined
    waited: list[float] = []
    waiter = threading.Thread(target=lambda: (abort.abort_groups(), waited.append(1)))
    waiter.start()
    time.sleep(0.3)
    assert not waited  # abort_groups waits for the run
    slow_abort.set()
    waiter.join(10)
    assert waited == [1] and run.done.is_set()
    assert abort.start_abort() is not run  # a finished run is not joined: a new abort


@pytest.mark.timeout(60)
def test_an_abort_error_reaches_whoever_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> abort.AbortReport:
        raise RuntimeError("NCCL abort failed")

    monkeypatch.setattr(abort, "_abort_now", fail)
    with pytest.raises(RuntimeError, match="NCCL abort failed"):
        abort.abort_groups()


@pytest.mark.timeout(120)
def test_a_hung_abort_ends_the_process_with_exit_code_7_when_the_bound_passes() -> None:
    code = textwrap.dedent("""
        import threading, time
        from megatron_deadpool.devices import abort
        abort._abort_now = lambda: threading.Event().wait()  # never returns
        abort.bound_aborts(1.0)
        abort.start_abort()
        print("started", flush=True)
        time.sleep(60)
        print("still alive", flush=True)
        """)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, check=False
    )
    assert proc.returncode == ExitCode.ABORT_HUNG == 7, proc.stderr[-2000:]
    assert "started" in proc.stdout and "still alive" not in proc.stdout
    assert time.monotonic() - t0 < 45  # the bound, not the sleep, ended it
    assert "--deadpool-abort-timeout" in proc.stderr


@pytest.mark.timeout(60)
def test_an_abort_within_its_bound_does_not_end_the_process(slow_abort: threading.Event) -> None:
    abort.bound_aborts(5.0)
    try:
        run = abort.start_abort()
        time.sleep(0.2)
        slow_abort.set()
        run.result()
        time.sleep(0.1)  # the bound's watcher saw it done: this process goes on
    finally:
        abort.bound_aborts(None)


@pytest.mark.timeout(60)
def test_every_nccl_groups_abort_starts_before_any_returns() -> None:
    barrier = threading.Barrier(4, timeout=10)
    order: list[str] = []

    class Backend:
        def __init__(self, name: str) -> None:
            self.name = name

        def abort(self) -> None:
            order.append(f"start {self.name}")
            barrier.wait()  # returns only once all four aborts are running
            order.append(f"end {self.name}")

    seconds = nccl.abort_concurrently([Backend(n) for n in "abcd"])
    assert seconds < 10 and not barrier.broken
    assert all(entry.startswith("start") for entry in order[:4])


@pytest.mark.timeout(60)
def test_an_nccl_abort_error_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    done: list[str] = []

    class Bad:
        def abort(self) -> None:
            raise RuntimeError("Future for ProcessGroup abort timed out")

    class Good:
        def abort(self) -> None:
            done.append("good")

    nccl.abort_concurrently([Bad(), Good()])
    assert done == ["good"] and "timed out" in caplog.text
