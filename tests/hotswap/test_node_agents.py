"""Cluster node agents (`deadpool agent`), end to end on loopback: real processes, real signals.

A job as deadpool_launch.sh starts it with DEADPOOL_RESPAWN_LIMIT: `deadpool coordinator` and
one `deadpool agent` per node - nodes 0 and 1 hold ranks 0-3 of the CPU demo (two per node),
node 2 the two spares - each agent starting its node's embedded workers. A crashed and a hung
process are replaced in place by their nodes' agents (no spare spent) and training ends with
the failure-free run's digest; an agent lost with its processes (a node lost) condemns its
node: the spares take its ranks. Every process runs in a session of its own and is killed by
PID at the end, whatever happened (the agents' workers by the agents, or here).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import REPO_ROOT, TrainRun, deadpool_command
from procs import free_port, kill_sessions, spawn_logged, wait_until
from stores import SEAL

from megatron_deadpool.hotswap.membership import Membership
from megatron_deadpool.hotswap.memory_store import MemoryStore
from megatron_deadpool.hotswap.messages import Keys, RespawnOrder
from megatron_deadpool.hotswap.node_agents import BEATS_AWAITED, UNKNOWN, StoreAgents

CONFIG = str(REPO_ROOT / "configs" / "cpu-demo.yaml")
ITERS = 6
TIMING = [
    "--deadpool-heartbeat-interval", "0.5", "--deadpool-heartbeat-timeout", "4",
    "--deadpool-agree-timeout", "60", "--deadpool-pg-timeout", "150",
]  # fmt: skip


@contextmanager
def agents_job(logs: Path, fail: list[str]) -> Iterator[list[subprocess.Popen]]:
    """The coordinator (logs/coordinator.out, events.jsonl) and the agents of nodes 0-2
    (logs/agent{n}.out; the workers' logs/task-{t}.log); yields [coordinator, agent 0, 1, 2]."""
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEADPOOL_JOB_TOKEN": "agents-test"}
    settings = [
        "--config", CONFIG, "--deadpool-coordinator", address, "--deadpool-log-dir", str(logs),
        "--deadpool-spares", "2", "--deadpool-ranks-per-node", "2",
        "--deadpool-respawn-limit", "2", *TIMING,
    ]  # fmt: skip
    worker = [
        sys.executable, "-m", "megatron_deadpool.embedded.worker", "--config", CONFIG,
        "--iters", str(ITERS), "--deadpool-coordinator", address, *fail, *TIMING,
    ]  # fmt: skip
    logs.mkdir()
    procs: list[subprocess.Popen] = []
    coordinator = [*deadpool_command(), "coordinator", "--world-size", "4", *settings,
                   "--max-wait", "300"]  # fmt: skip
    agent = [*deadpool_command(), "agent", "--world-size", "4", *settings]
    try:
        procs.append(spawn_logged(coordinator, logs / "coordinator.out", env))
        for node in range(3):
            cmd = [*agent, "--node", str(node), "--", *worker]
            procs.append(spawn_logged(cmd, logs / f"agent{node}.out", env))
        yield procs
    finally:
        workers = [c for p in procs if psutil.pid_exists(p.pid) for c in _children(p.pid)]
        kill_sessions(procs)
        for pid in workers:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def _events(logs: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]


def _describe(logs: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
        for p in sorted(logs.glob("*.out")) + sorted(logs.glob("task-*.log"))
    )


@pytest.mark.timeout(400)
def test_a_crashed_and_a_hung_process_are_respawned_on_their_nodes_no_spare_spent(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    logs = tmp_path / "logs"
    fail = ["--deadpool-fail", "2@3", "--deadpool-fail", "1@5:hang"]
    with agents_job(logs, fail) as procs:
        assert procs[0].wait(timeout=330) == 0, _describe(logs)
        for agent in procs[1:]:
            assert agent.wait(timeout=60) == 0, _describe(logs)
    events = _events(logs)
    recoveries = [e for e in events if e["event"] == "recovered"]
    respawned = {r: n for rec in recoveries for r, n in rec["respawned"].items()}
    assert respawned == {"2": 1, "1": 0}, _describe(logs)
    assert all(set(rec["replaced_by"].values()) <= {"s2", "s3"} for rec in recoveries), recoveries
    (finished,) = [e for e in events if e["event"] == "finished"]
    _, _, reference = failure_free(ITERS)
    assert finished["final_param_digest"] == reference["final_param_digest"], _describe(logs)
    # The hung process was killed by its agent; the spares s0 and s1 never took a rank.
    assert "killed a1 (named dead while still running)" in (logs / "agent0.out").read_text()
    assert "spare s0] INFO released" in (logs / "task-4.log").read_text(), _describe(logs)
    # Each agent deleted its node's memory folder (the one it named as it started).
    for node in range(3):
        text = (logs / f"agent{node}.out").read_text()
        folder = text.split("memory in ", 1)[1].split()[0]
        assert not Path(folder).exists(), text


@pytest.mark.timeout(400)
def test_an_agent_lost_with_its_processes_condemns_its_node_the_spares_take_over(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    """Node 1's agent and both its processes SIGKILLed at iteration 3 (a node lost whole): its
    agent no longer beats, so ranks 2 and 3 take the spares of node 2, not a respawn."""
    logs = tmp_path / "logs"
    with agents_job(logs, []) as procs:
        task0 = logs / "task-0.log"
        wait_until(
            lambda: task0.exists() and "iteration 3/" in task0.read_text(errors="replace"),
            240,
            "iteration 3",
            poll_s=0.05,
        )
        node1 = [procs[2].pid, *_children(procs[2].pid)]
        for pid in node1:
            os.killpg(pid, signal.SIGKILL)
        assert procs[0].wait(timeout=330) == 0, _describe(logs)
    events = _events(logs)
    (recovered,) = [e for e in events if e["event"] == "recovered"]
    assert recovered["dead_ranks"] == [2, 3], _describe(logs)
    assert recovered["replaced_by"] == {"2": "s0", "3": "s1"} and recovered["respawned"] == {}
    refused = [e for e in events if e["event"] == "respawn_refused"]
    assert {e["rank"] for e in refused} == {2, 3} and all(e["node"] == 1 for e in refused)
    (finished,) = [e for e in events if e["event"] == "finished"]
    _, _, reference = failure_free(ITERS)
    assert finished["final_param_digest"] == reference["final_param_digest"], _describe(logs)


# ---------------------------------------------------------------------- the store's side
def _memberships() -> tuple[Membership, Membership]:
    store = MemoryStore()
    return Membership(store, "coordinator", SEAL), Membership(store, "agent1", SEAL)


class _Clock:
    """A monotonic clock that the test's `sleep` moves; the agent beats on each sleep when
    `beating`."""

    def __init__(self, agent: Membership, node: int) -> None:
        self.now, self.agent, self.node, self.beating = 0.0, agent, node, True

    def sleep(self, s: float) -> None:
        self.now += s
        if self.beating:
            self.agent.agent_beat(self.node)


def test_a_node_is_alive_while_its_agent_beats_and_unknown_nodes_never_are() -> None:
    coord, agent = _memberships()
    clock = _Clock(agent, 1)
    agents = StoreAgents(
        coord, world_size=4, processes=6, ranks_per_node=2, beat_s=1.0,
        clock=lambda: clock.now, sleep=clock.sleep,
    )  # fmt: skip
    assert [agents.node_of(m) for m in ("a0", "a3", "s0", "s1", "s2")] == [0, 1, 2, 2, UNKNOWN]
    assert agents.alive(1)
    clock.beating = False
    assert agents.alive(1)  # the verdict holds for BEATS_AWAITED intervals ...
    clock.now += BEATS_AWAITED
    assert not agents.alive(1)  # ... then a silent agent is lost
    assert clock.now >= BEATS_AWAITED * 2  # (it waited that long for a beat)
    assert not agents.alive(UNKNOWN)


def test_orders_reach_their_node_once_and_forged_or_missing_ones_hold_nothing_up() -> None:
    coord, agent = _memberships()
    agents = StoreAgents(coord, world_size=4, processes=6, ranks_per_node=2, beat_s=1.0)
    coord.number_spares_from(2)
    member = agents.respawn(3, "a3", 1)
    assert member == "s2" and agents.node_of("s2") == 1
    seen, orders = agent.respawn_orders(1, 0)
    assert seen == 1 and orders == [RespawnOrder("s2", "a3", 3, 1)]
    assert agent.respawn_orders(1, seen) == (1, [])
    assert agent.respawn_orders(0, 0) == (0, [])  # another node's orders are its own
    # A stranger bumps the counter (no order behind it) and forges the next order.
    raw = agent.store
    raw.add(Keys.AGENT_ORDERS.format(node=1), 1)
    raw.set(Keys.AGENT_ORDER.format(node=1, n=3), RespawnOrder("s9", "a2", 2, 0).encode())
    assert agent.respawn_orders(1, seen) == (1, [])  # nothing written behind number 2 yet
    raw.add(Keys.AGENT_ORDERS.format(node=1), 1)
    agents.respawn(2, "s2", 1)  # the respawned process fails in turn: same node, same GPU
    seen, orders = agent.respawn_orders(1, seen)
    assert seen == 4 and orders == [RespawnOrder("s3", "s2", 2, 1)]
