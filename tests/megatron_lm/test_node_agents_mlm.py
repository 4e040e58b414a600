"""Megatron-LM's unmodified pretrain_gpt.py under cluster node agents (`deadpool agent`), on
loopback: the coordinator and one agent per node as deadpool_launch.sh starts them with
DEADPOOL_RESPAWN_LIMIT and DEADPOOL_MODE=megatron-lm (`agents_job`: two spares, two respawns per
node). Three failures, more than the spares: rank 2's process SIGKILLed as iteration 6 starts,
rank 1's stopped (SIGSTOP: hung) at 9, rank 0's SIGKILLed at 12. Each node's agent replaces its
process in place (the hung one killed first), each newcomer restores from its predecessor's
snapshot in the node's memory, no spare is spent, and the final weights and every logged
iteration are those of the failure-free run on one machine (conftest).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from agents_job import agents_job, describe, events, log_of
from conftest import MegatronLMReference
from mlm import logged_iterations, megatron_args, megatron_lm_tree
from procs import free_port

ITERS = 16  # the failure-free reference of the Slurm lab's Megatron-LM job


@pytest.mark.timeout(600)
def test_killed_and_hung_megatron_lm_ranks_are_respawned_by_their_nodes_agents(
    tmp_path: Path, megatron_lm_failure_free: Callable[[int], MegatronLMReference]
) -> None:
    tree = megatron_lm_tree()  # the oldest supported tag MEGATRON_LM_PATH lists
    expected = megatron_lm_failure_free(ITERS)
    worker = [sys.executable, "-m", "megatron_deadpool.megatron_lm", str(tree / "pretrain_gpt.py"),
              *megatron_args(ITERS), "--use-distributed-optimizer", "--deadpool",
              "--deadpool-fail", "2@6", "--deadpool-fail", "1@9:hang",
              "--deadpool-fail", "0@12"]  # fmt: skip
    env = {"WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    logs = tmp_path / "logs"
    with agents_job(logs, worker, [], env) as job:
        assert job.procs[0].wait(timeout=500) == 0, describe(logs)
    seen = events(logs)
    recoveries = [e for e in seen if e["event"] == "recovered"]
    assert [rec["dead_ranks"] for rec in recoveries] == [[2], [1], [0]], describe(logs)
    respawned = {r: n for rec in recoveries for r, n in rec["respawned"].items()}
    assert respawned == {"2": 1, "1": 0, "0": 0}, describe(logs)
    replaced_by = {r: m for rec in recoveries for r, m in rec["replaced_by"].items()}
    assert replaced_by == {"2": "s2", "1": "s3", "0": "s4"}  # s0 and s1 stay in the pool
    assert "killed a1 (named dead while still running)" in log_of(logs, "agent0.out")
    coordinator = log_of(logs, "coordinator.out")  # the crashes, as their agents reported them
    assert "process a2 exited with code -9" in coordinator, coordinator
    assert "process a0 exited with code -9" in coordinator, coordinator
    (finished,) = [e for e in seen if e["event"] == "finished"]
    assert finished["rank_digests"] == expected.digests, describe(logs)
    text = "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob("task-*.log")))
    for rank in (2, 1, 0):
        restored = rf"\[deadpool r{rank} g\d\] INFO restored iteration \d+ \(from local"
        assert re.search(restored, text), text
    logged = logged_iterations(text)
    assert logged == {it: expected.iterations.get(it) for it in logged}, describe(logs)
    assert len(set(expected.iterations) - set(logged)) <= 1, describe(logs)


@pytest.mark.timeout(900)
def test_deadpool_megatron_lm_with_node_agents_respawns_a_killed_rank_by_default(
    tmp_path: Path, megatron_lm_failure_free: Callable[[int], MegatronLMReference]
) -> None:
    """`deadpool megatron-lm --node-agents` on this machine, no spare and no respawn flag:
    rank 2's process SIGKILLed is respawned by its node's agent (in-place respawn is on by
    default) and the run ends with the failure-free run's weights; the processes' output
    reaches the launcher's from their logs."""
    from megatron_deadpool.megatron_lm.launch import MegatronLauncher

    tree = megatron_lm_tree()
    expected = megatron_lm_failure_free(8)
    args = [*megatron_args(8), "--use-distributed-optimizer", "--deadpool",
            "--deadpool-spare-ranks", "0", "--deadpool-ranks-per-node", "2",
            "--deadpool-fail", "2@4"]  # fmt: skip
    out = tmp_path / "run.out"
    with open(out, "w") as stream:
        rc = MegatronLauncher(str(tree / "pretrain_gpt.py"), args, 4, run_dir=str(tmp_path / "run"),
                              timeout_s=600, stream=stream, node_agents=True).run()  # fmt: skip
    text = out.read_text(errors="replace")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert rc == 0, text[-4000:]
    assert [rec["respawned"] for rec in summary["recoveries"]] == [{"2": 1}], summary
    assert summary["param_digests"] == expected.digests, summary
    logged = logged_iterations(text)  # Megatron's lines, followed in the last rank's log
    assert sorted(logged) == list(range(1, 9)), text[-4000:]
    assert logged == {it: expected.iterations.get(it) for it in logged}
