"""Cluster node agents (`deadpool agent`), end to end on loopback: real processes, real signals.

A job as deadpool_launch.sh starts it with DEADPOOL_RESPAWN_LIMIT (`agents_job`): nodes 0 and 1
hold ranks 0-3 of the CPU demo, node 2 the two spares. A crashed and a hung process are replaced
in place by their nodes' agents (no spare spent) and training ends with the failure-free run's
digest; an agent lost with its processes (a node lost) condemns its node: the spares take its
ranks; a node that joins with its agent takes a lost node's ranks and respawns them. Then the
coordinator's side of the store protocol, on an in-memory store.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from agents_job import agents_job, describe, events, kill_node, log_of, started_pid
from conftest import REPO_ROOT, TrainRun, run_deadpool
from procs import free_port, kill_sessions, wait_until
from stores import SEAL

from megatron_deadpool.hotswap.coordinator.liveness import AgentExits
from megatron_deadpool.hotswap.coordinator.node_agents import BEATS_AWAITED, UNKNOWN, StoreAgents
from megatron_deadpool.hotswap.launch.forkserver import Preload
from megatron_deadpool.hotswap.launch.node_agent import NodeAgent
from megatron_deadpool.hotswap.launch.warm_start import ForkedProcess
from megatron_deadpool.hotswap.protocol.connection import BoundedStore, open_client
from megatron_deadpool.hotswap.protocol.membership import Membership, host_store
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.hotswap.protocol.messages import (
    AGENT_NODE_ENV,
    Keys,
    ProcessExit,
    RespawnOrder,
)

CONFIG = str(REPO_ROOT / "configs" / "cpu-demo.yaml")
ITERS = 6
JOIN_ITERS = 400  # as the Slurm lab's revive test: one failure-free reference for both
# As test_failover and the Slurm lab (training waits while a standby takes over).
TAKEOVER_ITERS = 30


def _worker(iters: int, *fail: str) -> list[str]:
    return [sys.executable, "-m", "megatron_deadpool.embedded.worker", "--config", CONFIG,
            "--iters", str(iters), *fail]  # fmt: skip


@pytest.mark.timeout(400)
def test_a_crashed_and_a_hung_process_are_respawned_on_their_nodes_no_spare_spent(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    logs = tmp_path / "logs"
    fail = ["--deadpool-fail", "2@3", "--deadpool-fail", "1@5:hang"]
    with agents_job(logs, _worker(ITERS, *fail), ["--config", CONFIG]) as job:
        procs = job.procs
        assert procs[0].wait(timeout=330) == 0, describe(logs)
        for agent in procs[1:]:
            assert agent.wait(timeout=60) == 0, describe(logs)
        # Each agent deleted its node's memory folder (the one it named as it started; here,
        # before the job's clean-up would delete what an agent killed with its node leaves).
        for node in range(3):
            text = log_of(logs, f"agent{node}.out")
            folder = text.split("memory in ", 1)[1].split()[0]
            assert not Path(folder).exists(), text
    seen = events(logs)
    recoveries = [e for e in seen if e["event"] == "recovered"]
    respawned = {r: n for rec in recoveries for r, n in rec["respawned"].items()}
    assert respawned == {"2": 1, "1": 0}, describe(logs)
    assert all(set(rec["replaced_by"].values()) <= {"s2", "s3"} for rec in recoveries), recoveries
    (finished,) = [e for e in seen if e["event"] == "finished"]
    _, _, reference = failure_free(ITERS)
    assert finished["final_param_digest"] == reference["final_param_digest"], describe(logs)
    # Every process was forked from its agent's fork server, the respawned ones too.
    for node in range(3):
        assert "fresh interpreter" not in log_of(logs, f"agent{node}.out")
    # The crash was known from its agent's report of the exit, not from a silence.
    assert "process a2 exited with code -9" in log_of(logs, "coordinator.out")
    # The hung process was killed by its agent; the spares s0 and s1 never took a rank.
    assert "killed a1 (named dead while still running)" in log_of(logs, "agent0.out")
    assert "spare s0] INFO released" in log_of(logs, "task-4.log"), describe(logs)


@pytest.mark.timeout(400)
def test_an_agent_lost_with_its_processes_condemns_its_node_the_spares_take_over(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    """A node fault at iteration 3 (`node:1@3`): ranks 2 and 3 SIGKILL themselves, and node 1's
    agent, seeing it, kills the rest of its node and itself with SIGKILL (a node lost whole, at
    a chosen iteration: killed from here, it raced the job's last iterations). Its agent no
    longer beats, so ranks 2 and 3 take the spares of node 2, not a respawn."""
    logs = tmp_path / "logs"
    with agents_job(
        logs, _worker(ITERS, "--deadpool-fail", "node:1@3"), ["--config", CONFIG]
    ) as job:
        assert job.procs[0].wait(timeout=330) == 0, describe(logs)
        assert job.procs[2].wait(timeout=30) == -signal.SIGKILL, describe(logs)
    assert "a node fault struck" in log_of(logs, "agent1.out")
    seen = events(logs)
    (recovered,) = [e for e in seen if e["event"] == "recovered"]
    assert recovered["dead_ranks"] == [2, 3], describe(logs)
    # (which spare takes which rank: whichever of the two was found dead first takes s0)
    assert sorted(recovered["replaced_by"].values()) == ["s0", "s1"]
    assert recovered["respawned"] == {}
    refused = [e for e in seen if e["event"] == "respawn_refused"]
    assert {e["rank"] for e in refused} == {2, 3} and all(e["node"] == 1 for e in refused)
    (finished,) = [e for e in seen if e["event"] == "finished"]
    _, _, reference = failure_free(ITERS)
    assert finished["final_param_digest"] == reference["final_param_digest"], describe(logs)


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
    assert seen == 1 and orders == [RespawnOrder("s2", "a3", 3)]
    assert agent.respawn_orders(1, seen) == (1, [])
    assert agent.respawn_orders(0, 0) == (0, [])  # another node's orders are its own
    # A stranger bumps the counter (no order behind it) and forges the next order.
    raw = agent.store
    raw.add(Keys.AGENT_ORDERS.format(node=1), 1)
    raw.set(Keys.AGENT_ORDER.format(node=1, n=3), RespawnOrder("s9", "a2", 2).encode())
    assert agent.respawn_orders(1, seen) == (1, [])  # nothing written behind number 2 yet
    raw.add(Keys.AGENT_ORDERS.format(node=1), 1)
    agents.respawn(2, "s2", 1)  # the respawned process fails in turn: same node, same GPU
    seen, orders = agent.respawn_orders(1, seen)
    assert seen == 4 and orders == [RespawnOrder("s3", "s2", 2)]


def test_exits_the_agents_report_reach_the_coordinator_once_and_forged_ones_are_dropped() -> None:
    coord, agent = _memberships()
    exits = AgentExits(coord)
    assert exits.exits() == {} and exits.exited("a2") is None
    agent.report_exit(ProcessExit("a2", -9, 1))
    agent.report_exit(ProcessExit("s0", 0, 2))
    assert exits.exits() == {"a2": -9, "s0": 0} and exits.exited("a2") == -9
    assert exits.seen == 2 and exits.exits() == {"a2": -9, "s0": 0}  # nothing new
    # A stranger's exit (not sealed with the job's secret) names no one dead.
    agent.store.add(Keys.AGENT_EXITS, 1)
    agent.store.set(Keys.AGENT_EXIT.format(n=3), ProcessExit("a0", -9, 0).encode())
    assert exits.exits() == {"a2": -9, "s0": 0} and exits.exited("a0") is None
    assert not exits.kill("a2")  # a hung process is killed by its agent, on an order


def test_a_joined_agents_node_is_numbered_after_the_jobs_and_its_processes_found_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    coord, agent = _memberships()
    agents = StoreAgents(coord, world_size=4, processes=6, ranks_per_node=2, beat_s=1.0)
    assert agent.claim_agent_node() == 3  # after nodes 0-2 (the actives' and the spares')
    monkeypatch.setenv(AGENT_NODE_ENV, "3")  # as the agent of node 3 starts its processes
    Membership(coord.store, "s7", SEAL).announce()  # one that joined the job
    monkeypatch.delenv(AGENT_NODE_ENV)
    Membership(coord.store, "s8", SEAL).announce()  # one no agent started
    assert [agents.node_of(m) for m in ("s7", "s8", "s9")] == [3, UNKNOWN, UNKNOWN]
    StoreAgents(coord, world_size=4, processes=6, ranks_per_node=2, beat_s=1.0)
    assert agent.claim_agent_node() == 4  # a second coordinator (a standby) numbers nothing anew


def test_a_process_that_died_before_it_announced_here_is_placed_by_its_exit() -> None:
    """A standby that took the job over never saw s5 (respawned for the lost coordinator, dead
    before it re-registered): its agent's exit report names its node, so it is respawned
    there, not replaced by a spare."""
    coord, agent = _memberships()
    exits = AgentExits(coord)
    agents = StoreAgents(
        coord, world_size=4, processes=6, ranks_per_node=2, beat_s=1.0, exits=exits
    )  # fmt: skip
    assert agents.node_of("s5") == UNKNOWN
    agent.report_exit(ProcessExit("s5", -9, 1))
    assert exits.exits() == {"s5": -9} and agents.node_of("s5") == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "forked"])
def test_an_agent_reports_an_exit_as_it_happens_and_wakes_the_coordinator(
    tmp_path: Path, warm: bool
) -> None:
    """A beat of 30 s: the agent's pause between looks ends when one of its processes ends
    (its pidfd; a forked process's a copy of the one its fork server passed), the next look
    reports the exit and wakes the coordinator (its inbox); a pause with nothing ending lasts
    its time. Fresh interpreters and processes forked from a fork server alike."""
    store = host_store("127.0.0.1", 0)
    coord = Membership(store, "coordinator", SEAL)
    coord.set_token()
    agent = NodeAgent(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        place=0, per_node=2, world_size=2, processes=2, seal=SEAL, log_dir=tmp_path,
        coordinators=[f"127.0.0.1:{store.port}"], beat_s=30.0, connect_timeout=10.0,
        preload=Preload(("time",)) if warm else None,
    )  # fmt: skip
    try:
        agent.start()
        procs = {name: s.proc for name, s in agent.started.items()}
        assert set(procs) == {"a0", "a1"}
        assert all(isinstance(p, ForkedProcess) == warm for p in procs.values())
        t0 = time.monotonic()
        agent._pause(0.3)  # nothing ends: the whole pause
        assert time.monotonic() - t0 >= 0.3
        assert store.queue_len(Keys.INBOX) == 0
        os.kill(procs["a1"].pid, signal.SIGKILL)
        t0 = time.monotonic()
        agent._pause(30.0)
        assert time.monotonic() - t0 < 10.0  # the exit, not the beat
        assert agent._look()
        assert coord.process_exits(0)[1] == [ProcessExit("a1", -9, 0)]
        assert store.queue_len(Keys.INBOX) == 1  # the coordinator woken
        assert agent.exits.watching() == 1  # a0 only
        t0 = time.monotonic()
        agent._pause(0.3)  # a1's exit, reported, no longer ends a pause
        assert time.monotonic() - t0 >= 0.3
    finally:
        agent.close()
    assert agent.exits.watching() == 0  # every descriptor closed


@pytest.mark.timeout(60)
def test_an_agent_tells_a_standby_that_took_the_job_over_what_the_lost_coordinator_knew(
    tmp_path: Path,
) -> None:
    """Real processes and stores: the primary orders a respawn (s0 in a1's place), s0 dies,
    the primary's store is lost. The agent follows the job to the standby and tells it, before
    its first beat there, both exits with their node, that it respawned once (and when), and
    that s0 is taken; the standby's first order (numbered afresh) is carried out."""
    port = free_port()
    serve = (
        "import time, torch.distributed as d; "
        f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
        "print('up', flush=True); time.sleep(60)"
    )
    primary = subprocess.Popen(
        [sys.executable, "-c", serve], stdout=subprocess.PIPE, start_new_session=True
    )
    standby_store = host_store("127.0.0.1", 0)
    standby = Membership(standby_store, "coordinator", SEAL.for_store(1))  # entry 1
    agent = NodeAgent(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        place=0, per_node=2, world_size=2, processes=2, seal=SEAL, log_dir=tmp_path,
        coordinators=[f"127.0.0.1:{port}", f"127.0.0.1:{standby_store.port}"],
        beat_s=0.2, connect_timeout=10.0,
    )  # fmt: skip
    try:
        assert primary.stdout is not None and primary.stdout.readline() == b"up\n"
        first = Membership(BoundedStore(open_client(f"127.0.0.1:{port}", 5.0), 5.0), "c", SEAL)
        first.set_token()
        agent.start()
        first.number_spares_from(0)
        first.order_respawn(0, RespawnOrder(first.claim_spare_name(), "a1", 1))
        assert agent._look() and set(agent.started) == {"a0", "a1", "s0"}
        wait_until(lambda: agent.started["a1"].proc.poll() is not None, 10, "a1 killed")
        assert agent._look() and [e.member for e in first.process_exits(0)[1]] == ["a1"]
        os.kill(agent.started["s0"].proc.pid, signal.SIGKILL)  # before it re-registered
        wait_until(lambda: agent.started["s0"].proc.poll() is not None, 10, "s0 gone")
        kill_sessions([primary])
        standby.set_token()  # the standby took the job over
        assert not agent._look()  # the lost store ...
        assert agent._look()  # ... then the standby's
        assert standby.process_exits(0)[1] == [ProcessExit("a1", -9, 0), ProcessExit("s0", -9, 0)]
        history = standby.respawn_history(0)
        assert history is not None and len(history.ages) == 1 and 0 <= history.ages[0] < 30
        assert standby.spare_names_claimed() == 1 and standby.agent_beat_count(0) == 1
        exits = AgentExits(standby)
        agents = StoreAgents(
            standby, world_size=2, processes=2, ranks_per_node=2, beat_s=0.2, exits=exits
        )  # fmt: skip
        exits.exits()
        assert agents.node_of("s0") == 0 and agents.respawn(1, "s0", 0) == "s1"
        assert agent._look() and agent.running() == ["a0", "s1"]
    finally:
        agent.close()
        kill_sessions([primary])


@pytest.mark.timeout(600)
def test_a_standby_that_took_over_respawns_through_the_agents_within_each_nodes_budget(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    """One respawn per node: a2 SIGKILLed -> node 1's agent respawns it (s2) for the primary;
    the primary coordinator lost -> the standby takes the job over, the agents follow it;
    a0 SIGKILLed -> node 0's agent respawns it for the standby; s2 SIGKILLed -> node 1 has
    respawned once already (for the primary, as its agent told the standby): a spare takes
    rank 2."""
    logs = tmp_path / "logs"
    standby = logs / "standby"

    def count(folder: Path, kind: str) -> int:
        return sum(e["event"] == kind for e in events(folder))

    def kill_task(node: int, task: int) -> None:
        os.kill(started_pid(log_of(logs, f"agent{node}.out"), task), signal.SIGKILL)

    worker, settings = _worker(TAKEOVER_ITERS), ["--config", CONFIG]
    with agents_job(logs, worker, settings, standby=True, respawn_limit=1) as job:
        wait_until(lambda: "iteration 3/" in log_of(logs, "task-0.log"), 240, "iteration 3")
        kill_task(1, 2)  # a2
        wait_until(lambda: count(logs, "recovered") == 1, 120, "the primary's recovery")
        os.killpg(job.procs[0].pid, signal.SIGKILL)  # the primary coordinator
        wait_until(lambda: count(standby, "rebuilt") == 1, 120, "the standby's takeover")
        followed = "following the job to the coordinator"
        wait_until(lambda: all(followed in log_of(logs, f"agent{n}.out") for n in range(3)), 60,
                   "the agents following the job")  # fmt: skip
        kill_task(0, 0)  # a0
        wait_until(lambda: count(standby, "recovered") == 1, 120, "the standby's first recovery")
        kill_task(1, 6)  # s2 (task 4 + 2), which took rank 2 for the primary
        assert job.procs[1].wait(timeout=400) == 0, describe(logs)
    first = [e for e in events(logs) if e["event"] == "recovered"]
    assert first[0]["respawned"] == {"2": 1}, first
    recoveries = [e for e in events(standby) if e["event"] == "recovered"]
    assert [r["dead_ranks"] for r in recoveries] == [[0], [2]], describe(logs)
    assert recoveries[0]["respawned"] == {"0": 0}, describe(logs, standby)
    assert recoveries[1]["respawned"] == {} and recoveries[1]["replaced_by"]["2"] in ("s0", "s1")
    refused = [e for e in events(standby) if e["event"] == "respawn_refused"]
    assert [(e["node"], e["why"]) for e in refused] == [(1, "respawn limit reached")], refused
    (finished,) = [e for e in events(standby) if e["event"] == "finished"]
    _, _, reference = failure_free(TAKEOVER_ITERS)
    assert finished["final_param_digest"] == reference["final_param_digest"], describe(logs)


@pytest.mark.timeout(600)
def test_a_node_that_joins_with_its_agent_takes_a_lost_nodes_ranks_and_respawns_them(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    """More node losses than spare nodes, then a crash on the node that joined: a node of
    another allocation joins with its agent (node 3; its processes take the spare names s2 and
    s3); node 1 lost whole -> node 2's spares take ranks 2 and 3; node 2 lost whole -> node 3's
    processes take them; the one holding rank 2 crashes -> node 3's agent respawns it in place.
    400 iterations (the failure-free reference of the Slurm lab's revive test)."""
    logs, joined = tmp_path / "logs", tmp_path / "joined"

    def count(kind: str) -> int:
        return sum(e["event"] == kind for e in events(logs))

    with agents_job(logs, _worker(JOIN_ITERS), ["--config", CONFIG]) as job:
        job.join(joined)
        wait_until(lambda: count("spare_joined") == 2, 240, "the joined node's spares")
        wait_until(lambda: "iteration 3/" in log_of(logs, "task-0.log"), 240, "iteration 3")
        kill_node(job.procs[2])
        wait_until(lambda: count("recovered") == 1, 120, "the first recovery")
        kill_node(job.procs[3])
        wait_until(lambda: count("recovered") == 2, 120, "the second recovery")
        holder = next(
            t for t in (0, 1) if "[deadpool r2 " in log_of(joined, f"task-{t}.log")
        )  # the joined node's process that took rank 2 (its task log)
        os.kill(started_pid(log_of(joined, "agent.out"), holder), signal.SIGKILL)
        assert job.procs[0].wait(timeout=400) == 0, describe(logs, joined)
    recoveries = [e for e in events(logs) if e["event"] == "recovered"]
    assert [r["dead_ranks"] for r in recoveries] == [[2, 3], [2, 3], [2]], describe(logs, joined)
    assert sorted(recoveries[0]["replaced_by"].values()) == ["s0", "s1"]
    assert sorted(recoveries[1]["replaced_by"].values()) == ["s2", "s3"]
    assert recoveries[2]["respawned"] == {"2": 3}, recoveries
    (finished,) = [e for e in events(logs) if e["event"] == "finished"]
    _, _, reference = failure_free(JOIN_ITERS)
    assert finished["final_param_digest"] == reference["final_param_digest"], describe(logs)
    assert "takes rank 2 in place of" in log_of(joined, "agent.out")
    # Its crash was reported by its agent, which found the name it took from the store.
    assert re.search(r"process s[23] exited with code -9", log_of(logs, "coordinator.out"))


@pytest.mark.timeout(60)
def test_an_agent_with_no_coordinator_says_so_in_one_line_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEADPOOL_JOB_TOKEN", "agents-test")
    proc = run_deadpool(
        "agent", "--world-size", "4", "--node", "0", "--deadpool-ranks-per-node", "2",
        "--deadpool-coordinator", f"127.0.0.1:{free_port()}", "--deadpool-connect-timeout", "2",
        "--deadpool-log-dir", str(tmp_path), "--", sys.executable, "-c", "print('started')",
        timeout=50,
    )  # fmt: skip
    assert proc.returncode == 4, proc.stderr
    assert proc.stderr.startswith("deadpool agent: error: coordinator 127.0.0.1:"), proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.glob("task-*.log"))
