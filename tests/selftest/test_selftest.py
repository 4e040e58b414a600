"""`deadpool selftest`: the whole command on CPU (4 gloo ranks + 1 spare), its bad input, and
the verdicts that decide its rows (each shown to fail on the evidence it exists to catch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, deadpool_command

from megatron_deadpool.devices.base import Device
from megatron_deadpool.devices.memory import ReplicaMemory
from megatron_deadpool.errors import ConfigError
from megatron_deadpool.hotswap.launch.srun_job import srun_command
from megatron_deadpool.replication import pack
from megatron_deadpool.selftest import device_checks, judge
from megatron_deadpool.selftest.slurm import Allocation
from megatron_deadpool.selftest.table import EXIT_INCOMPLETE, Row, exit_code, render, verdict

CHECKS = ["settings", "replication", "peer killed", "peer frozen", "replica memory", "pack kernel"]
CUDA = torch.cuda.is_available() and torch.cuda.device_count() > 0


def _kill_leftovers(marker: str) -> None:
    """SIGKILL every process whose command line names `marker` (this test's own run dir)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _selftest(
    tmp_path: Path, *args: str, timeout: float, **environ: str
) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)
    env.pop("TORCH_GLOO_LAZY_INIT", None)
    env.update(environ)
    try:
        return subprocess.run(
            [*deadpool_command(), "selftest", *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=str(REPO_ROOT),
            env=env,
        )
    finally:
        _kill_leftovers(f"{tmp_path}/")


@pytest.mark.timeout(420)
def test_selftest_on_cpu_passes_and_reports(tmp_path: Path) -> None:
    report_path = tmp_path / "selftest.json"
    run_dir = tmp_path / "runs"
    proc = _selftest(
        tmp_path,
        "--nproc",
        "4",
        "--json",
        str(report_path),
        "--run-dir",
        str(run_dir),
        "--timeout",
        "330",
        timeout=360,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    rows = {name: line for line in lines for name in CHECKS if line.startswith(name + " ")}
    assert list(rows) == CHECKS, proc.stdout
    for name in CHECKS[:4]:
        assert " PASS " in rows[name], rows[name]
    report = json.loads(report_path.read_text())
    checks = report["checks"]
    assert list(checks) == CHECKS
    assert report["exit_code"] == 0
    assert report["verdict"] == lines[-1]
    for name in CHECKS[:4]:
        assert checks[name]["status"] == "pass", checks[name]
        assert checks[name]["seconds"] >= 0
    if not CUDA:
        for name in CHECKS[4:]:
            assert checks[name] == {
                "status": "skipped",
                "seconds": 0.0,
                "detail": "skipped: no CUDA",
            }
            assert "SKIPPED" in rows[name] and "skipped: no CUDA" in rows[name]
    repl = checks["replication"]["data"]
    assert repl["iterations"] == repl["committed_iteration"] == 5
    assert repl["bytes_per_round_per_rank"] > 0
    assert repl["holders"] == {"0": [1], "1": [2], "2": [3], "3": [0]}  # each on another node
    digest = repl["final_param_digest"]
    assert len(digest) == 64
    for name, fault in (("peer killed", "1@3:kill"), ("peer frozen", "1@3:hang")):
        data = checks[name]["data"]
        assert data["fault"] == fault
        assert data["final_param_digest"] == digest
        (rec,) = data["recoveries"]
        assert rec["dead_ranks"] == [1] and rec["replaced_by"] == {"1": "s0"}
        assert f"{rec['total_s']:.2f} s" in checks[name]["detail"]
    # Its own logs: the summary of each run agrees with the report.
    for name in ("replication", "peer-killed", "peer-frozen"):
        summary = json.loads((run_dir / name / "run.jsonl").read_text().splitlines()[-1])
        assert summary["event"] == "summary" and summary["final_param_digest"] == digest
    env = report["environment"]
    assert env["torch"] == torch.__version__
    assert env["megatron_core"] and env["python"] and env["host"]
    assert env["device"].startswith("cuda" if CUDA else "cpu")


@pytest.mark.timeout(180)
def test_a_check_that_fails_makes_exit_1(tmp_path: Path) -> None:
    """Too short a --timeout: the first run is stopped at its limit, the others cannot start;
    each is a failed row, the verdict says so and the exit code is 1."""
    report_path = tmp_path / "selftest.json"
    proc = _selftest(
        tmp_path,
        *("--nproc", "2", "--timeout", "3", "--json", str(report_path)),
        *("--run-dir", str(tmp_path / "runs")),
        timeout=150,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    checks = json.loads(report_path.read_text())["checks"]
    assert checks["settings"]["status"] == "pass"
    assert checks["replication"]["status"] == "fail"
    assert "ran past its time limit" in checks["replication"]["detail"]
    for name in ("peer killed", "peer frozen"):
        assert checks[name] == {
            "status": "fail",
            "seconds": 0.0,
            "detail": "not run: --timeout (3 s) spent",
        }
    assert proc.stdout.splitlines()[-1].startswith("selftest FAILED: 1 passed, 3 failed")


@pytest.mark.timeout(120)
def test_a_refused_setting_fails_and_nothing_runs(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs"
    proc = _selftest(
        tmp_path, "--nproc", "2", "--run-dir", str(run_dir), timeout=90, TORCH_GLOO_LAZY_INIT="1"
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    (settings,) = [line for line in lines if line.startswith("settings ")]
    assert " FAIL " in settings and "TORCH_GLOO_LAZY_INIT=1" in settings and "unset it" in settings
    for name in ("replication", "peer killed", "peer frozen"):
        (row,) = [line for line in lines if line.startswith(name + " ")]
        assert "skipped: not run, the settings check failed" in row
    assert list(run_dir.iterdir()) == []  # no training run started


@pytest.mark.timeout(120)
def test_one_rank_runs_the_device_checks_and_skips_the_runs(tmp_path: Path) -> None:
    """`--nproc 1` (one GPU): no peer to hold a replica, so no training run; the settings and
    device checks still run, and skipped rows do not fail the selftest - but a selftest that
    checked nothing across ranks does not say OK: INCOMPLETE, its own exit code."""
    run_dir = tmp_path / "runs"
    proc = _selftest(tmp_path, "--nproc", "1", "--run-dir", str(run_dir), timeout=90)
    assert proc.returncode == EXIT_INCOMPLETE, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("selftest INCOMPLETE: 1 passed, 0 failed, ")
    assert lines[-1].endswith(
        "not checked across ranks: replication, peer killed, peer frozen (give --nproc 2 or "
        "more, or --slurm across nodes)"
    )
    (settings,) = [line for line in lines if line.startswith("settings ")]
    assert " PASS " in settings
    for name in ("replication", "peer killed", "peer frozen"):
        (row,) = [line for line in lines if line.startswith(name + " ")]
        assert "SKIPPED" in row and "one rank has no peer to hold its replica" in row
    assert list(run_dir.iterdir()) == []


def test_allocation_is_read_from_slurm_and_checked() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "SLURM_NTASKS_PER_NODE": "2(x4)",
           "SLURM_JOB_NODELIST": "n[1-4]", "SRUN_EXTRA_ARGS": "--mpi=none  --exclusive"}  # fmt: skip
    a = Allocation.from_env(env, None, 1)
    assert (a.nodes, a.tasks_per_node, a.actives, a.spares) == (4, 2, 6, 2)
    assert a.srun_args == ("--mpi=none", "--exclusive")
    assert Allocation.from_env(env, 4, 2).actives == 8  # --nproc-per-node, --spare-nodes
    assert Allocation.from_env({"SLURM_JOB_ID": "7", "SLURM_NNODES": "3"}, None, 1).actives == 2
    for bad_env, per_node, spare_nodes, flag in [
        ({}, None, 1, "--slurm"),
        (env, None, 3, "--spare-nodes"),  # 1 active node: no peer node for a replica
        (env, None, 0, "--spare-nodes"),
        (env, 0, 1, "--nproc-per-node"),
    ]:
        with pytest.raises(ConfigError, match=flag):
            Allocation.from_env(bad_env, per_node, spare_nodes)


def test_the_job_step_is_the_launch_scripts_srun(tmp_path: Path) -> None:
    """One task per GPU in blocks, survivors kept alive, RANK/LOCAL_RANK from Slurm - as
    scripts/slurm/deadpool_launch.sh starts a job."""
    cmd = srun_command(["python", "-m", "w", "--x"], nodes=3, tasks_per_node=2, name="dp-1",
                       output=tmp_path / "task-%t.log", cpus_per_task="8", extra=["--mpi=none"])  # fmt: skip
    launch = (REPO_ROOT / "scripts/slurm/deadpool_launch.sh").read_text()
    for fixed in ("--distribution=block", "--kill-on-bad-exit=0", "--no-kill", "--wait=0"):
        assert fixed in cmd and fixed in launch
    assert cmd[1:4] == ["--nodes=3", "--ntasks=6", "--ntasks-per-node=2"]
    assert "--cpus-per-task=8" in cmd and "--job-name=dp-1" in cmd
    wrapper = cmd.index("bash")
    assert cmd[wrapper - 1] == "--mpi=none" and cmd[wrapper + 2] in launch
    assert cmd[-5:] == ["deadpool-task", "python", "-m", "w", "--x"]


# ------------------------------------------------------------------ the verdicts, one by one
def _records(iters: int, late: int | None = None) -> list[dict]:
    return [
        {
            "iteration": it,
            "committed_iteration": (it - 1 if it != late else it - 2) if it > 1 else None,
            "replica_bytes_sent": 1024,
            "replication_s": 0.001,
            "replication_parts_s": {"capture": 0.0005},
        }
        for it in range(1, iters + 1)
    ]


SUMMARY = {
    "committed_iteration": 5,
    "dp_replicas_identical": True,
    "final_param_digest": "ab" * 32,
    "losses": [2.0, 1.9, 1.8, 1.7, 1.6],
    "median_iter_time_s": 0.2,
}


@pytest.mark.timeout(30)
def test_replication_verdict() -> None:
    holders = [[1], [0]]
    assert judge.replication(1.0, 0, SUMMARY, _records(5), 5, holders).status == "pass"
    late = judge.replication(1.0, 0, SUMMARY, _records(5, late=3), 5, holders)
    assert late.status == "fail" and "[3]" in late.detail
    unfinished = judge.replication(
        1.0, 0, {**SUMMARY, "committed_iteration": 4}, _records(5), 5, holders
    )
    assert unfinished.status == "fail" and "final committed iteration 4" in unfinished.detail
    differ = judge.replication(
        1.0, 0, {**SUMMARY, "dp_replicas_identical": False}, _records(5), 5, holders
    )
    assert differ.status == "fail"
    hung = judge.replication(9.0, 124, {}, [], 5, holders)
    assert hung.status == "fail" and "time limit" in hung.detail


def _recovered(**changes: object) -> dict:
    rec = {
        "dead_ranks": [1],
        "replaced_by": {"1": "s0"},
        "recomputed_iterations": 1,
        "phases_s": {"detect": 2.9, "agree": 0.1},
        "total_s": 4.0,
    }
    return {**SUMMARY, "recoveries": [{**rec, **changes}]}


@pytest.mark.timeout(30)
def test_hot_swap_verdict() -> None:
    ok = judge.hot_swap("peer frozen", 1.0, 0, _recovered(), SUMMARY, 1, 3.5)
    assert ok.status == "pass" and "spare s0" in ok.detail
    cases = {
        "differs": {**_recovered(), "final_param_digest": "cd" * 32},
        "losses differ": {**_recovered(), "losses": [2.0]},
        "detected after 3.90": _recovered(phases_s={"detect": 3.9}),
        "2 iterations recomputed": _recovered(recomputed_iterations=2),
        "expected rank 1 by a spare": _recovered(dead_ranks=[2], replaced_by={"2": "s0"}),
        "0 recoveries": {**SUMMARY, "recoveries": []},
    }
    for words, summary in cases.items():
        row = judge.hot_swap("peer frozen", 1.0, 0, summary, SUMMARY, 1, 3.5)
        assert row.status == "fail" and words in row.detail, (words, row.detail)
    no_ref = judge.hot_swap("peer killed", 1.0, 0, _recovered(), None, 1)
    assert no_ref.status == "fail" and "failure-free digest" in no_ref.detail
    lost = judge.hot_swap(
        "peer killed", 1.0, 1, {"out_of_redundancy": {"reason": "no spare left"}}, SUMMARY, 1
    )
    assert lost.status == "fail" and "code 1 (no spare left)" in lost.detail


@pytest.mark.timeout(30)
def test_settings_verdict() -> None:
    assert device_checks.settings(cuda=False, environ={}).status == "pass"
    lazy = device_checks.settings(cuda=False, environ={"TORCH_GLOO_LAZY_INIT": "1"})
    assert lazy.status == "fail" and "TORCH_GLOO_LAZY_INIT=1" in lazy.detail
    # The NCCL rules work on a copy of the environment, so they are checked without a GPU.
    nccl = device_checks.settings(cuda=True, environ={"TORCH_NCCL_ENABLE_MONITORING": "1"})
    assert nccl.status == "pass"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (required; applied by DeadPool)" in nccl.detail
    assert "TORCH_NCCL_ENABLE_MONITORING=1 (your value, kept)" in nccl.detail
    refused = device_checks.settings(cuda=True, environ={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert refused.status == "fail" and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in refused.detail
    # Judged on a copy: this process's own environment is left as it was.
    before = dict(os.environ)
    device_checks.settings(cuda=True)
    assert dict(os.environ) == before


@pytest.mark.timeout(60)
def test_capture_on_the_host_and_a_flipped_bit() -> None:
    """The replica check's own logic, on host memory (what CUDA adds: the device and pinning)."""
    memory = ReplicaMemory(setting="cpu", device=Device("cpu", "gloo"))
    problems, nbytes, backend = device_checks.capture(memory, "host")
    assert problems == [] and nbytes % 16 == 0 and backend == "numpy"
    tensors = device_checks.sample_shard(torch.device("cpu"))
    reference = torch.zeros(pack.packed_nbytes(tensors), dtype=torch.uint8)
    expected = pack.pack(tensors, reference)
    rotten = reference.clone()
    rotten[100] ^= 4
    found = device_checks.verify(rotten, reference, expected, "replica")
    assert len(found) == 2 and "checksum" in found[0] and "bytes differ" in found[1]


@pytest.mark.timeout(30)
def test_table_and_exit_code() -> None:
    rows = [Row("settings", "pass", 0.01, "a\nb"), Row("pack kernel", "skipped", 0, "x")]
    assert exit_code(rows) == 0
    assert exit_code([*rows, Row("replication", "fail", 1, "y")]) == 1
    lines = render(rows[0]).splitlines()
    assert lines[0].startswith("settings") and "PASS" in lines[0]
    assert lines[1].strip() == "b" and lines[1].index("b") == lines[0].index("a")
    with pytest.raises(ValueError, match="status"):
        Row("x", "ok", 0, "")  # type: ignore[arg-type]


def test_a_selftest_that_checked_nothing_across_ranks_is_incomplete_not_ok() -> None:
    """Issue 41: every cross-rank check skipped (one rank) is not OK; a failure still wins;
    one cross-rank check that ran makes the verdict OK again."""
    skipped = [Row(name, "skipped", 0, "one rank") for name in judge.CROSS_RANK]
    rows = [Row("settings", "pass", 0.01, "a"), *skipped]
    assert exit_code(rows) == 0  # without naming the cross-rank checks: as before
    assert exit_code(rows, judge.CROSS_RANK) == EXIT_INCOMPLETE
    assert verdict(rows, judge.CROSS_RANK).startswith("selftest INCOMPLETE: 1 passed, 0 failed")
    failed = [*rows, Row("pack kernel", "fail", 1, "no kernel")]
    assert exit_code(failed, judge.CROSS_RANK) == 1
    assert verdict(failed, judge.CROSS_RANK).startswith("selftest FAILED")
    ran = [rows[0], Row(judge.REPLICATION, "pass", 1, "ok"), *skipped[1:]]
    assert exit_code(ran, judge.CROSS_RANK) == 0
    assert verdict(ran, judge.CROSS_RANK) == "selftest OK: 2 passed, 0 failed, 2 skipped"
