"""Megatron-LM's unmodified pretrain_gpt.py under cluster node agents (`deadpool agent`), on
loopback: the coordinator and one agent per node as deadpool_launch.sh starts them with
DEADPOOL_RESPAWN_LIMIT and DEADPOOL_MODE=megatron-lm (`agents_job`). Rank 2's process is
SIGKILLed as iteration 6 starts: its node's agent respawns it in place, it restores from its
predecessor's snapshot in the node's memory, no spare is spent, and the final weights and every
logged iteration are those of the failure-free run on one machine (conftest).
"""

from __future__ import annotations

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
def test_a_killed_megatron_lm_rank_is_respawned_by_its_nodes_agent(
    tmp_path: Path, megatron_lm_failure_free: Callable[[int], MegatronLMReference]
) -> None:
    tree = megatron_lm_tree()  # the oldest supported tag MEGATRON_LM_PATH lists
    expected = megatron_lm_failure_free(ITERS)
    worker = [sys.executable, "-m", "megatron_deadpool.megatron_lm", str(tree / "pretrain_gpt.py"),
              *megatron_args(ITERS), "--use-distributed-optimizer", "--deadpool",
              "--deadpool-fail", "2@6"]  # fmt: skip
    env = {"WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    logs = tmp_path / "logs"
    with agents_job(logs, worker, [], env) as job:
        assert job.procs[0].wait(timeout=500) == 0, describe(logs)
    seen = events(logs)
    (recovered,) = [e for e in seen if e["event"] == "recovered"]
    assert recovered["dead_ranks"] == [2] and recovered["respawned"] == {"2": 1}, describe(logs)
    assert recovered["replaced_by"] == {"2": "s2"}  # s0 and s1 stay in the pool
    (finished,) = [e for e in seen if e["event"] == "finished"]
    assert finished["rank_digests"] == expected.digests, describe(logs)
    text = "\n".join(log_of(logs, f"task-{t}.log") for t in range(7))
    assert re.search(r"\[deadpool r2 g1\] INFO restored iteration \d+ \(from local", text), text
    logged = logged_iterations(text)
    assert logged == {it: expected.iterations.get(it) for it in logged}, describe(logs)
    assert len(set(expected.iterations) - set(logged)) <= 1, describe(logs)
