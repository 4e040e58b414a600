"""The fault matrix: what redundancy covers costs seconds and changes nothing; what it does not
cover loses nothing that survives and says exactly what happened.

Real processes and real signals on CPU. Cases already covered in `test_hotswap.py` (crash,
hang, whole node, out of redundancy) are not repeated here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    REPO_ROOT,
    TrainRun,
    assert_out_of_redundancy,
    deadpool_command,
    run_deadpool,
    train_case,
)
from procs import free_port, kill_sessions

ITERS = "6"
CASES: dict[str, list[str]] = {
    # TP2 x DP2 cases compare against the session's shared failure-free run (`tp_reference`).
    "ref_dp3": ["--tp", "1", "--dp", "3"],
    # Rank 1 holds replicas of ranks 0 and 2 (k=2); rank 0 dies and every copy rank 1 holds
    # rots just before agreement: checksums must catch it and rank 2's copy be used instead.
    "flip_fallback": [
        "--tp", "1", "--dp", "3", "--deadpool-replicas", "2", "--spares", "1", "--fail", "0@4",
        "--fail", "1@recovery:flip",
    ],
    # k=1: rank 0 holds the only copy of rank 2's shard; rank 2 dies and that copy rots.
    # (flipped as recovery starts: an earlier flip can miss the in-flight round's copy, which
    # then arrives intact and is rightly used)
    "flip_lost": [
        "--tp", "2", "--dp", "2", "--spares", "1", "--fail", "2@4", "--fail", "0@recovery:flip",
    ],
    # A second failure while the first is being recovered.
    "during_recovery": [
        "--tp", "2", "--dp", "2", "--spares", "2", "--fail", "2@4", "--fail", "1@recovery",
    ],
    # The spare a recovery picks dies once it built its objects, before it claims the slot:
    # the survivors must not wait for it in a rendezvous (they did, from the spare's pick on,
    # until the claim moved after the build); the coordinator gives the slot up and the next
    # spare takes it.
    "newcomer_lost": [
        "--tp", "2", "--dp", "2", "--spares", "2", "--fail", "2@4", "--fail", "spare:0@recovery",
    ],
    # A waiting spare dies; the next failure uses the other one.
    "spare_dies": [
        "--tp", "2", "--dp", "2", "--spares", "2", "--fail", "spare:0@2", "--fail", "2@4",
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("faults"))


@cache
def run(case: str, root: str) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    proc, _, summary = train_case(Path(root) / case, CASES[case], ITERS)
    return proc, summary


@pytest.fixture(scope="module")
def tp_reference(failure_free: Callable[[int], TrainRun]) -> dict[str, Any]:
    """The summary of the failure-free TP2 x DP2 run of ITERS iterations (conftest: shared with
    test_hotswap, test_frozen_peer and test_train)."""
    return failure_free(int(ITERS))[2]


def _same_as(case: str, reference: dict[str, Any], root: str) -> dict[str, Any]:
    proc, summary = run(case, root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["losses"] == reference["losses"]
    assert summary["final_param_digest"] == reference["final_param_digest"]
    for rec in summary["recoveries"]:
        assert rec["recomputed_iterations"] <= 1 and rec["stale_group_refs"] == 0, rec
    return summary


@pytest.mark.timeout(600)
def test_corrupt_replica_is_caught_and_another_copy_used(root: str) -> None:
    summary = _same_as("flip_fallback", run("ref_dp3", root)[1], root)
    assert [r["dead_ranks"] for r in summary["recoveries"]] == [[0]]
    logs = "".join(p.read_text() for p in (Path(root) / "flip_fallback" / "logs").glob("a1.log"))
    assert "dropping a corrupt copy before recovery" in logs
    assert "checksum mismatch in replica of rank 0" in logs
    events = (Path(root) / "flip_fallback" / "logs" / "events.jsonl").read_text()
    agreed = next(json.loads(x) for x in events.splitlines() if '"agreed"' in x)
    assert agreed["sources"] == {"0": 2}  # rank 2's copy, not rank 1's rotten one


@pytest.mark.timeout(600)
def test_only_copy_corrupt_ends_the_run_naming_the_shard(root: str) -> None:
    proc, summary = run("flip_lost", root)
    report = summary["out_of_redundancy"]
    assert_out_of_redundancy(proc, report, Path(root) / "flip_lost", survivors=[0, 1, 3])
    assert report["lost_ranks"] == [2] and report["lost_shards_holders"] == {"2": [0]}
    assert summary["final_param_digest"] is None


@pytest.mark.timeout(600)
def test_second_failure_during_recovery_starts_over(
    root: str, tp_reference: dict[str, Any]
) -> None:
    summary = _same_as("during_recovery", tp_reference, root)
    (rec,) = summary["recoveries"]
    assert rec["dead_ranks"] == [1, 2] and rec["generation"] == 2  # re-planned once
    assert sorted(rec["replaced_by"].values()) == ["s0", "s1"]


@pytest.mark.timeout(600)
def test_spare_lost_before_it_joins_is_replaced_by_the_next(
    root: str, tp_reference: dict[str, Any]
) -> None:
    """Without the slot claim the survivors waited in generation 1's rendezvous for s0 until
    the process groups' timeout, and the coordinator took them for dead (out of redundancy)."""
    summary = _same_as("newcomer_lost", tp_reference, root)
    (rec,) = summary["recoveries"]
    assert rec["dead_ranks"] == [2] and rec["replaced_by"] == {"2": "s1"}
    assert rec["generation"] == 2  # generation 1 (rank 2 <- s0) never formed
    logs = Path(root) / "newcomer_lost" / "logs"
    assert "before claiming it" in (logs / "s0.log").read_text()
    events = [json.loads(x) for x in (logs / "events.jsonl").read_text().splitlines()]
    # Generation 1 was decided before s0 died (a survivor then sees s0's slot given up, or -
    # reading the decision later - that generation 2 superseded it).
    assert [e["generation"] for e in events if e["event"] == "agreed"] == [1, 2]


@pytest.mark.timeout(600)
def test_dead_spare_shrinks_the_pool_and_the_next_one_is_used(
    root: str, tp_reference: dict[str, Any]
) -> None:
    summary = _same_as("spare_dies", tp_reference, root)
    assert summary["recoveries"][0]["replaced_by"] == {"2": "s1"}
    events = [
        json.loads(x)
        for x in (Path(root) / "spare_dies" / "logs" / "events.jsonl").read_text().splitlines()
    ]
    # s0 died while waiting: it leaves the pool (spare_lost), or - if it was picked for the slot
    # in the same instant - the plan is redone with s1. Either way it is never used.
    assert any(e["event"] == "process_dead" and e["member"] == "s0" for e in events)
    assert not any(e["event"] == "recovered" and "s0" in e["replaced_by"].values() for e in events)


def _worker(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    """`python -m megatron_deadpool.embedded.worker` as rank 0 of the CPU demo."""
    import sys

    return subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_deadpool.embedded.worker",
            "--config",
            str(REPO_ROOT / "configs" / "cpu-demo.yaml"),
            "--member",
            "a0",
            *args,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.timeout(120)
def test_unreachable_coordinator_is_a_clear_error_in_bounded_time() -> None:
    """Exit code 4 and one clear line. That the worker gives up after its connect timeout is
    timed without the worker's start-up (imports take most of a minute on a loaded machine) in
    test_failover_link's refused-connections test; here the pytest timeout bounds the run."""
    proc = _worker(
        "--deadpool-coordinator", f"127.0.0.1:{free_port()}", "--deadpool-connect-timeout", "3"
    )
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "coordinator 127.0.0.1" in proc.stderr and "unreachable after 3s" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
def test_coordinator_address_that_does_not_resolve_is_refused() -> None:
    proc = _worker("--deadpool-coordinator", "no-such-host.invalid:29400")
    assert proc.returncode == 2
    assert "deadpool-coordinator" in proc.stderr and "does not resolve" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(180)
def test_process_from_another_job_is_refused(tmp_path: Path) -> None:
    port = free_port()
    coord = subprocess.Popen(
        [
            *deadpool_command(),
            "coordinator",
            "--deadpool-coordinator",
            f"127.0.0.1:{port}",
            "--world-size",
            "4",
            "--deadpool-job-token",
            "job-A",
            "--max-wait",
            "120",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        proc = _worker(
            "--deadpool-coordinator",
            f"127.0.0.1:{port}",
            "--deadpool-connect-timeout",
            "60",
            env={"DEADPOOL_JOB_TOKEN": "job-B"},
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "deadpool-job-token" in proc.stderr and "does not match" in proc.stderr
        assert "Traceback" not in proc.stderr
    finally:
        kill_sessions([coord])


@pytest.mark.timeout(300)
def test_sigterm_saves_a_checkpoint_and_resumes_exactly(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    ckpt, log = tmp_path / "ckpt", tmp_path / "pre.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    job = ["--tp", "2", "--dp", "2", "--iters", "8"]
    proc = subprocess.Popen(
        [
            *deadpool_command(),
            "train",
            *job,
            "--save",
            str(ckpt),
            "--json-log",
            str(log),
            "--quiet",
        ],
        cwd=REPO_ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not (
            log.exists() and len(log.read_text().splitlines()) >= 3
        ):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    summary = json.loads(log.read_text().splitlines()[-1])
    stopped = summary["preempted"]["iteration"]
    assert summary["preempted"]["saved"] and 3 <= stopped < 8
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
    resumed = run_deadpool(
        "train", *job, "--load", str(ckpt), "--json-log", str(tmp_path / "post.jsonl"), timeout=240
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    post = json.loads((tmp_path / "post.jsonl").read_text().splitlines()[-1])
    _, _, ref = failure_free(8)  # the same run without SIGTERM (shared: conftest)
    assert summary["losses"][:stopped] == ref["losses"][:stopped]
    assert post["losses"] == ref["losses"][stopped:]
    assert post["final_param_digest"] == ref["final_param_digest"]


@pytest.mark.timeout(60)
def test_store_listens_on_loopback_only() -> None:
    from megatron_deadpool.hotswap.protocol.membership import host_store

    store = host_store("127.0.0.1", 0)
    port = store.port
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.split(":")[1], 16) == port:  # 0A: LISTEN
                listening.append(local.split(":")[0])
    assert listening == ["0100007F"], listening  # 127.0.0.1, nothing else
    store.set("k", "v")
    assert store.get("k") == b"v"
