"""The measurement core of `bench overhead` and `bench paper` (`bench/interleaved.py`) on
synthetic runs, and the launch hooks `bench recovery` times a run with (`bench/timed_launch.py`)
on real processes, without training."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from stores import SEAL

from megatron_deadpool.bench import interleaved, timed_launch
from megatron_deadpool.errors import ConfigError
from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore

pytestmark = pytest.mark.timeout(60)


def records(gaps: list[float], start: float = 100.0) -> list[dict[str, Any]]:
    """Iteration records whose iterations end `gaps` apart (iteration 1 ends at `start`)."""
    out, t = [], start
    for i, gap in enumerate([0.0, *gaps], start=1):
        t += gap
        out.append({"iteration": i, "time": t, "loss": 3.0 - 0.1 * i, "iter_time_s": 0.01})
    return out


def launched(gaps: list[float], digest: str = "d", returncode: int = 0) -> SimpleNamespace:
    summary = {"final_param_digest": digest, "wall_s": sum(gaps)}
    return SimpleNamespace(returncode=returncode, records=records(gaps), summary=summary)


def test_time_per_iteration_is_the_mean_gap_between_iteration_ends() -> None:
    # Iterations 2..7 end these gaps after the previous one; saves after iterations 3 and 6 make
    # the gaps of iterations 4 and 7 longer (the first one's start-up too).
    times = interleaved.iteration_times(records([9.0, 0.1, 0.6, 0.1, 0.1, 0.2]), 2, 3)
    assert times.gaps_s == pytest.approx((0.1, 0.6, 0.1, 0.1, 0.2))  # iterations 3..7
    assert times.amortised_s == pytest.approx(1.1 / 5)  # the saves count at their weight
    assert times.median_s == pytest.approx(0.1)
    assert times.saves_in_window == 2
    assert times.first_save_s == pytest.approx(0.5)  # the gap of iteration 4, less 0.1
    with pytest.raises(ValueError, match="no iteration after the first 7"):
        interleaved.iteration_times(records([0.1] * 6), 7)


def test_runs_interleave_and_ratios_pair_runs_of_the_same_repeat(tmp_path: Path) -> None:
    order: list[tuple[str, int]] = []
    drift = {1: 1.0, 2: 2.0, 3: 1.5, 4: 1.2, 5: 1.1, 6: 3.0}  # the machine's load, per repeat

    def run_one(config: str, repeat: int) -> interleaved.Run:
        order.append((config, repeat))
        step = 0.1 * drift[repeat] * (1.25 if config == "on" else 1.0)
        return interleaved.measured_run(
            config, repeat, launched([step] * 5), iters=6, warmup=1, what=config, run_dir=tmp_path
        )

    runs = interleaved.interleave(["off", "on"], 6, run_one)
    assert order == [(c, r) for r in range(1, 7) for c in ("off", "on")]
    on = interleaved.compare(runs["on"], runs["off"])
    assert on["ratios"] == pytest.approx([1.25] * 6)  # the drift cancels within each repeat
    assert on["ratio"]["verdict"] == "higher" and on["ratio_median"] == pytest.approx(1.25)
    assert on["amortised_s"] == pytest.approx(0.125 * 1.35)  # the median of the six runs
    assert on["losses_match"] and on["digests_match"]
    assert runs["on"][0].to_dict()["config"] == "on" and runs["on"][5].repeat == 6
    with pytest.raises(ConfigError, match="repeats"):
        interleaved.interleave(["off"], 0, run_one)


def test_a_run_that_trained_otherwise_or_failed_is_caught(tmp_path: Path) -> None:
    def run(digest: str, returncode: int = 0, gaps: int = 5) -> interleaved.Run:
        return interleaved.measured_run(
            "x",
            1,
            launched([0.1] * gaps, digest, returncode),
            iters=6,
            warmup=1,
            what="DeadPool on",
            run_dir=tmp_path,
        )

    base = [run("d")]
    assert not interleaved.compare([run("other")], base)["digests_match"]
    changed = run("d")
    changed.losses[-1] += 1e-6
    assert not interleaved.compare([changed], base)["losses_match"]
    with pytest.raises(RuntimeError, match=r"DeadPool on, repeat 1: .*exit 1, 6/6 iterations"):
        run("d", returncode=1)
    with pytest.raises(RuntimeError, match="5/6 iterations"):
        run("d", gaps=4)
    for iters, warmup in ((2, 2), (1, 0)):
        with pytest.raises(ConfigError, match=f"iters \\({iters}\\)"):
            interleaved.check_window(iters=iters, warmup=warmup)


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process `pid` ended (or is a zombie) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_launch_hooks_stamp_stop_everyone_and_read_the_store(tmp_path: Path) -> None:
    members = Membership(MemoryStore(), "launcher", SEAL)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    leaves_helper = (  # a helper in its process group, as the checkpoint writer leaves one
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(p.pid, flush=True); time.sleep(60)"
    )
    with_helper = [sys.executable, "-c", leaves_helper]
    procs = {
        m: subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, text=True)
        for m, cmd in (("a0", sleeper), ("a1", with_helper), ("s0", sleeper))
    }
    helper = int(procs["a1"].stdout.readline())  # type: ignore[union-attr]
    local = SimpleNamespace(procs=procs, members=list(procs), membership=members)
    try:
        stamps = timed_launch._Stamps(stop_on_failure=True, world_size=2)
        t0 = time.time()
        stamps.started(local)  # type: ignore[arg-type]
        Membership(members.store, "a1", SEAL).record_fault()
        members.record_load_time(0, 0.25)
        members.record_load_time(1, 0.5)
        stamps.failed(local, {"a1": 1})  # type: ignore[arg-type]
        assert all(p.poll() is not None for p in procs.values())  # every process, at once
        assert _gone(helper)  # and what it left in its process group
        stamps.ended(local)  # type: ignore[arg-type]
        assert t0 <= stamps.spawned_at <= stamps.failed_at <= stamps.detected_at  # type: ignore
        assert stamps.detected_at <= stamps.stopped_at <= time.time()  # type: ignore[operator]
        assert stamps.load_s == 0.5
        calm = timed_launch._Stamps(stop_on_failure=False, world_size=2)
        calm.failed(local, {"a1": 1})  # type: ignore[arg-type]
        assert calm.detected_at is None and calm.stopped_at is None
        # Under node agents the launcher's processes are the agents: the members' stamps count.
        by_agents = SimpleNamespace(procs={"agent0": procs["a0"]}, members=list(procs),
                                    membership=members)  # fmt: skip
        calm.ended(by_agents)  # type: ignore[arg-type]
        assert calm.failed_at == stamps.failed_at
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
