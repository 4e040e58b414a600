"""No node whose loss ends the job: a standby coordinator takes over from a lost primary.

Real processes on loopback, as a cluster runs them: a primary and a standby `deadpool
coordinator`, and the embedded job's workers (`python -m megatron_deadpool.embedded.worker
--deadpool-coordinator PRIMARY,STANDBY`), TP2 x DP2, two ranks per node (node 0: ranks 0 and 1
with the primary coordinator, node 1: ranks 2 and 3, node 2: the spares s0 and s1). Failures are
real SIGKILLs; every run's final parameter digest is compared with `deadpool train`'s for the same
config. Each test prints its timeline (`-s` shows it).
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import TrainRun, run_deadpool
from standby_job import StandbyJob

ITERS = 30
KILL_AT = 8  # the iteration after which the failure strikes
HEARTBEAT = ["--deadpool-heartbeat-timeout", "4", "--deadpool-heartbeat-interval", "0.5"]
JOB_TIMEOUT = 600.0  # the machine may be shared: start-up alone can take minutes under load


def _config(folder: Path, spares: int = 2, **train: Any) -> Path:
    path = folder / "job.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "parallel": {"tp": 2, "pp": 1, "dp": 2},
                "train": {"iters": ITERS, **train},
                "deadpool": {"spare_ranks": spares, "replicas": 1, "ranks_per_node": 2},
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def reference(failure_free: Callable[[int], TrainRun]) -> dict[str, Any]:
    """`deadpool train` of the same model and layout on one machine, without failures: its
    summary (conftest: shared with the Slurm lab's tests)."""
    return failure_free(ITERS)[2]


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StandbyJob]:
    """The job; parametrized indirectly with {"spares": S, "save": True, "connect_timeout": T}
    to change it."""
    options = getattr(request, "param", {})
    spares = options.get("spares", 2)
    save = {"save": str(tmp_path / "save")} if options.get("save") else {}
    config = _config(tmp_path, spares, **save)
    settings = [*HEARTBEAT]
    if "connect_timeout" in options:
        settings += ["--deadpool-connect-timeout", str(options["connect_timeout"])]
    job = StandbyJob(
        tmp_path,
        world_size=4,
        spares=spares,
        settings=["--config", str(config), *settings],
        timeout_s=JOB_TIMEOUT,
    )

    def worker(member: str, task: int, coordinators: str) -> tuple[list[str], dict[str, str]]:
        return [
            sys.executable,
            "-m",
            "megatron_deadpool.embedded.worker",
            "--config",
            str(config),
            "--member",
            member,
            "--deadpool-coordinator",
            coordinators,
            *settings,
        ], {}

    try:
        job.start(worker)
        yield job
    finally:
        job.close()


def _at_iteration(job: StandbyJob, iteration: int) -> None:
    job.wait_for_line("a0", f"iteration {iteration}/{ITERS}")


def _assert_saved_set_resumes_exactly(tmp_path: Path, reference: dict[str, Any]) -> None:
    """The job's save folder holds a complete snapshot set from before the failure, and
    `deadpool train --load` resumes it to the failure-free run's final parameters."""
    from megatron_deadpool.replication import save_dir, snapshot_set

    point = save_dir.resume_point(str(tmp_path / "save"))
    assert point is not None and point[0] == "snapshots" and point[1] >= KILL_AT - 1, point
    manifest = snapshot_set.read_manifest(tmp_path / "save", point[1])
    assert manifest["complete"] and manifest["ranks_present"] == [0, 1, 2, 3], manifest
    log = tmp_path / "resumed.jsonl"
    resumed = run_deadpool(
        "train", "--config", str(tmp_path / "job.yaml"), "--load", str(tmp_path / "save"),
        "--json-log", str(log), "--run-dir", str(tmp_path / "resumed"), timeout=JOB_TIMEOUT,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    summary = json.loads(log.read_text().splitlines()[-1])
    assert summary["final_param_digest"] == reference["final_param_digest"]


@pytest.mark.timeout(3 * JOB_TIMEOUT)
def test_primary_node_lost_standby_takes_over_and_spares_replace_its_ranks(
    cluster: StandbyJob, reference: dict[str, Any]
) -> None:
    """Node 0 dies whole (the primary coordinator, ranks 0 and 1): the standby takes over from
    what the survivors re-register, s0 and s1 replace ranks 0 and 1, and training ends exactly
    as without the failure."""
    _at_iteration(cluster, KILL_AT)
    t_kill = cluster.kill("primary", "a0", "a1")
    codes = cluster.wait(["standby", "a2", "a3", "s0", "s1"])
    assert codes == {"standby": 0, "a2": 0, "a3": 0, "s0": 0, "s1": 0}, cluster.describe()
    rebuilt = cluster.event("standby", "rebuilt")
    assert rebuilt is not None and rebuilt["missing"] == [0, 1], cluster.describe()
    assert rebuilt["generation"] == 0 and rebuilt["spares"] == ["s0", "s1"]
    assert set(rebuilt["registered"]) == {"a2", "a3", "s0", "s1"}
    recovered = cluster.event("standby", "recovered")
    assert recovered is not None, cluster.describe()
    assert recovered["dead_ranks"] == [0, 1]
    assert recovered["replaced_by"] == {"0": "s0", "1": "s1"}
    assert recovered["generation"] == rebuilt["next_generation"] >= 1
    assert recovered["recomputed_iterations"] <= 1
    finished = cluster.event("standby", "finished")
    assert finished is not None and finished["final_param_digest"], cluster.describe()
    assert finished["final_param_digest"] == reference["final_param_digest"]
    timeline = cluster.timeline(t_kill)
    resumed = recovered["t"] - t_kill  # the coordinator saw rank 0's first iteration
    print(
        f"\nprimary node lost: {timeline}; recovery phases {recovered['phases_s']}; "
        f"resumed training by +{resumed:.2f}s"
    )
    assert timeline["taking_over"] < timeline["rebuilt"] < timeline["agreed"]


@pytest.mark.timeout(3 * JOB_TIMEOUT)
def test_primary_coordinator_alone_lost_training_goes_on_without_recovery(
    cluster: StandbyJob, reference: dict[str, Any]
) -> None:
    """Only the primary coordinator's process dies: every process re-registers with the
    standby, nothing is recovered, and training ends exactly as without the failure."""
    _at_iteration(cluster, KILL_AT)
    t_kill = cluster.kill("primary")
    codes = cluster.wait(["standby", "a0", "a1", "a2", "a3", "s0", "s1"])
    assert set(codes.values()) == {0}, cluster.describe()
    rebuilt = cluster.event("standby", "rebuilt")
    assert rebuilt is not None and rebuilt["missing"] == [], cluster.describe()
    kinds = {e["event"] for e in cluster.events("standby")}
    assert not kinds & {"plan", "process_dead", "recovered", "out_of_redundancy"}, kinds
    finished = cluster.event("standby", "finished")
    assert finished is not None, cluster.describe()
    assert finished["final_param_digest"] == reference["final_param_digest"]
    print(f"\nprimary coordinator alone lost: {cluster.timeline(t_kill)}")


@pytest.mark.timeout(3 * JOB_TIMEOUT)
def test_frozen_primary_coordinator_is_taken_over(
    cluster: StandbyJob, reference: dict[str, Any]
) -> None:
    """The primary coordinator freezes (SIGSTOP: its connections stay open, nothing answers,
    as on a hung node): no process waits on it longer than the bound on a store operation, the
    standby takes over, and training ends as without the failure."""
    _at_iteration(cluster, KILL_AT)
    t_stop = cluster.kill("primary", sig=signal.SIGSTOP)
    codes = cluster.wait(["standby", "a0", "a1", "a2", "a3", "s0", "s1"])
    assert set(codes.values()) == {0}, cluster.describe()
    rebuilt = cluster.event("standby", "rebuilt")
    assert rebuilt is not None and rebuilt["missing"] == [], cluster.describe()
    finished = cluster.event("standby", "finished")
    assert finished is not None, cluster.describe()
    assert finished["final_param_digest"] == reference["final_param_digest"]
    print(f"\nprimary coordinator frozen: {cluster.timeline(t_stop)}")


@pytest.mark.timeout(3 * JOB_TIMEOUT)
def test_standby_lost_changes_nothing(cluster: StandbyJob, reference: dict[str, Any]) -> None:
    """The standby's process dies while the primary lives: the primary notes it and the job
    goes on and ends as without the failure."""
    _at_iteration(cluster, KILL_AT)
    t_kill = cluster.kill("standby")
    codes = cluster.wait(["primary", "a0", "a1", "a2", "a3", "s0", "s1"])
    assert set(codes.values()) == {0}, cluster.describe()
    kinds = [e["event"] for e in cluster.events("primary")]
    assert not {"plan", "process_dead", "recovered"} & set(kinds), kinds
    finished = cluster.event("primary", "finished")
    assert finished is not None, cluster.describe()
    assert finished["final_param_digest"] == reference["final_param_digest"]
    lost = cluster.event("primary", "standby_lost")
    if lost is None:  # the primary notes it after the heartbeat timeout: had the job ended?
        assert finished["t"] - t_kill < 4 + 2 * 0.5 + 1, "the lost standby went unnoticed"
    else:
        print(f"\nstandby lost: noted by the primary at +{lost['t'] - t_kill:.2f}s")


@pytest.mark.parametrize("cluster", [{"spares": 0, "save": True}], indirect=True)
@pytest.mark.timeout(3 * JOB_TIMEOUT)
def test_primary_node_lost_without_spares_survivors_save_and_load_resumes_exactly(
    cluster: StandbyJob, reference: dict[str, Any], tmp_path: Path
) -> None:
    """No spare to replace ranks 0 and 1: out of redundancy, decided by the standby. The
    survivors save their own state and the replicas they hold of ranks 0 and 1 through the
    standby's store (a complete snapshot set), exit 3, and `--load` resumes bit for bit."""
    _at_iteration(cluster, KILL_AT)
    cluster.kill("primary", "a0", "a1")
    codes = cluster.wait(["standby", "a2", "a3"])
    assert codes == {"standby": 3, "a2": 3, "a3": 3}, cluster.describe()
    aborted = cluster.event("standby", "out_of_redundancy")
    assert aborted is not None and aborted["dead_ranks"] == [0, 1], cluster.describe()
    assert aborted["lost_ranks"] == [] and aborted["save"]["complete"]
    _assert_saved_set_resumes_exactly(tmp_path, reference)


@pytest.mark.parametrize("cluster", [{"save": True, "connect_timeout": 8}], indirect=True)
@pytest.mark.timeout(3 * JOB_TIMEOUT)
def test_both_coordinators_nodes_lost_survivors_save_what_they_hold(
    cluster: StandbyJob, reference: dict[str, Any], tmp_path: Path
) -> None:
    """Node 0 (the primary, ranks 0 and 1) and the standby's node (the spares) die together:
    nothing can recover or agree any more. The survivors, finding no coordinator within the
    connect timeout (8 s here), each save what they hold - their own snapshots and their
    replicas of ranks 0 and 1 - without a coordinator, say so, and exit 4; the set is complete
    and `--load` resumes bit for bit."""
    _at_iteration(cluster, KILL_AT)
    cluster.kill("primary", "a0", "a1", "standby", "s0", "s1")
    codes = cluster.wait(["a2", "a3"])
    assert codes == {"a2": 4, "a3": 4}, cluster.describe()
    for name in ("a2", "a3"):
        log = cluster.log(name)
        assert "found none of" in log and "saved what this rank held" in log, cluster.describe()
    _assert_saved_set_resumes_exactly(tmp_path, reference)
