"""Megatron-LM's pretrain_gpt.py under a primary and a standby coordinator: the primary's node
(the coordinator, ranks 0 and 1) dies, the standby takes over, spares replace the lost ranks, and
the final parameters equal those of a failure-free `deadpool megatron-lm` run. One of the two
spares is not the job's own: it joins the running job (`--deadpool-join`).

Runs on the oldest supported tag MEGATRON_LM_PATH lists (skipped without one, as the other
Megatron-LM tests: README, "Tested combinations").
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import MegatronLMReference
from mlm import RUN_TIMEOUT, launch, megatron_args, megatron_lm_tree
from procs import free_port
from standby_job import StandbyJob

ITERS = 16
KILL_AT = 4
ARGS = [*megatron_args(ITERS), "--use-distributed-optimizer"]
HEARTBEAT = ["--deadpool-heartbeat-timeout", "4", "--deadpool-heartbeat-interval", "0.5"]
JOB_TIMEOUT = 2 * RUN_TIMEOUT


@pytest.fixture(scope="module")
def reference(megatron_lm_failure_free: Callable[[int], MegatronLMReference]) -> dict[str, str]:
    """Each rank's final parameter digest of a failure-free run (the local launcher; conftest:
    shared with the Slurm lab's Megatron-LM job)."""
    return megatron_lm_failure_free(ITERS).digests


@pytest.fixture
def job(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StandbyJob]:
    """The job; parametrized indirectly with more worker arguments ({tmp}: the test's folder)."""
    tree = megatron_lm_tree()
    more = [a.format(tmp=tmp_path) for a in getattr(request, "param", [])]
    # s1 is not the job's own: it joins the running job (`--deadpool-join`), as a repaired
    # node would, and has no task index; the standby must find it when it re-registers.
    job = StandbyJob(
        tmp_path, world_size=4, spares=2, joining=1, settings=HEARTBEAT, timeout_s=JOB_TIMEOUT
    )
    master_port = str(free_port())

    def worker(member: str, task: int, coordinators: str) -> tuple[list[str], dict[str, str]]:
        cmd = [sys.executable, "-m", "megatron_deadpool.megatron_lm", str(tree / "pretrain_gpt.py"),
               *ARGS, *more, "--deadpool", "--deadpool-spares", "2",
               "--deadpool-ranks-per-node", "2", "--deadpool-coordinator", coordinators,
               *HEARTBEAT]  # fmt: skip
        env = {"RANK": str(task), "LOCAL_RANK": str(task), "WORLD_SIZE": "4",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port,
               "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
        if member in job.joiners:
            cmd.append("--deadpool-join")
            del env["RANK"], env["LOCAL_RANK"]
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
    joined = job.event("primary", "spare_joined")
    assert joined is not None and joined["member"] == "s1", job.describe()
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


SAVE = ["--save", "{tmp}/ckpt", "--save-interval", "100", "--deadpool-connect-timeout", "8"]


@pytest.mark.parametrize("job", [SAVE], indirect=True)
@pytest.mark.timeout(3 * JOB_TIMEOUT)
def test_both_coordinators_nodes_lost_in_megatron_lm_survivors_save(
    job: StandbyJob, reference: dict[str, str], tmp_path: Path
) -> None:
    """The primary's node (ranks 0 and 1) and the standby's node (the spares) die together:
    the survivors save what they hold without a coordinator - a complete snapshot set with
    Megatron's counters - exit 4, and `--load` resumes it to the failure-free parameters."""
    from megatron_deadpool.replication import save_dir, snapshot_set

    job.wait_for_line("a3", f"iteration {KILL_AT:>8}/{ITERS:>8} |")
    job.kill("primary", "a0", "a1", "standby", "s0", "s1")
    codes = job.wait(["a2", "a3"])
    assert codes == {"a2": 4, "a3": 4}, job.describe()
    assert all("saved what this rank held" in job.log(p) for p in ("a2", "a3")), job.describe()
    ckpt = tmp_path / "ckpt"
    point = save_dir.resume_point(str(ckpt))
    assert point is not None and point[0] == "snapshots" and point[1] >= KILL_AT - 1, point
    manifest = snapshot_set.read_manifest(ckpt, point[1])
    assert manifest["complete"] and manifest["megatron"]["consumed_train"] == 8 * point[1]
    tree = megatron_lm_tree()
    args = [*ARGS, "--save", str(ckpt), "--save-interval", "100", "--load", str(ckpt),
            "--deadpool", "--deadpool-spares", "0", "--deadpool-ranks-per-node", "2"]  # fmt: skip
    resumed = launch(tmp_path, "resumed", tree / "pretrain_gpt.py", args)
    assert resumed.returncode == 0, resumed.describe()
    assert f"resumed from DeadPool's snapshot set of iteration {point[1]}" in resumed.text
    assert resumed.summary["param_digests"] == reference
