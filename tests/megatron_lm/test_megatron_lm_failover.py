"""Megatron-LM's pretrain_gpt.py under a primary and a standby coordinator: the primary's node
(the coordinator, ranks 0 and 1) dies, the standby takes over, spares replace the lost ranks, and
the final parameters equal those of a failure-free `deadpool megatron-lm` run.

Runs on the oldest supported tag MEGATRON_LM_PATH lists (skipped without one, as the other
Megatron-LM tests: README, "Tested combinations").
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlm import megatron_lm_tree
from standby_job import StandbyJob, free_port
from test_pretrain_gpt import MEGATRON_ARGS, RUN_TIMEOUT, _launch

ITERS = 12
KILL_AT = 4
ARGS = [*MEGATRON_ARGS, "--use-distributed-optimizer"]
ARGS[ARGS.index("--train-iters") + 1] = str(ITERS)
HEARTBEAT = ["--deadpool-heartbeat-timeout", "4", "--deadpool-heartbeat-interval", "0.5"]
JOB_TIMEOUT = 2 * RUN_TIMEOUT


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each rank's final parameter digest of a failure-free run (the local launcher)."""
    tree = megatron_lm_tree()
    tmp = tmp_path_factory.mktemp("mlm-reference")
    deadpool = ["--deadpool", "--deadpool-spares", "0", "--deadpool-ranks-per-node", "2"]
    run = _launch(tmp, "reference", tree / "pretrain_gpt.py", [*ARGS, *deadpool])
    assert run.returncode == 0, run.describe()
    return run.summary["param_digests"]


@pytest.fixture
def job(tmp_path: Path) -> Iterator[StandbyJob]:
    tree = megatron_lm_tree()
    job = StandbyJob(tmp_path, world_size=4, spares=2, settings=HEARTBEAT, timeout_s=JOB_TIMEOUT)
    master_port = str(free_port())

    def worker(pid: str, task: int, coordinators: str) -> tuple[list[str], dict[str, str]]:
        cmd = [sys.executable, "-m", "megatron_deadpool.megatron_lm", str(tree / "pretrain_gpt.py"),
               *ARGS, "--deadpool", "--deadpool-spares", "2", "--deadpool-ranks-per-node", "2",
               "--deadpool-coordinator", coordinators, *HEARTBEAT]  # fmt: skip
        env = {"RANK": str(task), "LOCAL_RANK": str(task), "WORLD_SIZE": "4",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port,
               "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
        return cmd, env

    try:
        job.start(worker)
        yield job
    finally:
        job.close()


@pytest.mark.timeout(3 * JOB_TIMEOUT)
def test_primary_node_lost_in_megatron_lm(job: StandbyJob, reference: dict[str, str]) -> None:
    job.wait_for_line("a3", f"iteration {KILL_AT:>8}/{ITERS:>8} |")  # the last rank logs
    t_kill = job.kill("primary", "a0", "a1")
    codes = job.wait(["standby", "a2", "a3", "s0", "s1"])
    assert set(codes.values()) == {0}, job.describe()
    rebuilt = job.event("standby", "rebuilt")
    assert rebuilt is not None and rebuilt["missing"] == [0, 1], job.describe()
    recovered = job.event("standby", "recovered")
    assert recovered is not None and recovered["replaced_by"] == {"0": "s0", "1": "s1"}
    finished = job.event("standby", "finished")
    assert finished is not None, job.describe()
    assert finished["rank_digests"] == reference
    # Every iteration was logged once by the last rank, with the recomputed one at most twice.
    logged = [int(n) for n in re.findall(r" iteration +(\d+)/ +\d+ \|", job.log("a3"))]
    assert sorted(set(logged)) == list(range(1, ITERS + 1)), logged
    print(f"\nMegatron-LM, primary node lost: {job.timeline(t_kill)}; recovery phases "
          f"{recovered['phases_s']}")  # fmt: skip
