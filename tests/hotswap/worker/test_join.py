"""A process that joins a running job as a spare (`--deadpool-join`) and then takes a failed
rank's slot: real processes on loopback, as a cluster runs them.

`deadpool coordinator` of a job with no spare of its own (4 ranks of the CPU demo,
`--deadpool-spares 0`); an embedded worker started with `--deadpool-join` and the job's secret,
no SLURM_PROCID (a node from elsewhere); then the four ranks, rank 1 killed at iteration 3.
Without the joined spare that kill would end the job out of redundancy; with it, the joined
process takes rank 1's slot and the run ends bitwise equal to the failure-free one. Every
process runs in a session of its own and is killed by PID when the test ends, whatever happens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT, TrainRun, deadpool_command
from procs import free_port, kill_sessions, spawn_logged

CONFIG = str(REPO_ROOT / "configs" / "cpu-demo.yaml")
ITERS = "6"
TIMING = [
    "--deadpool-heartbeat-interval", "0.5", "--deadpool-heartbeat-timeout", "6",
    "--deadpool-agree-timeout", "60", "--deadpool-pg-timeout", "150",
]  # fmt: skip


def _events(logs: Path) -> list[dict[str, Any]]:
    path = logs / "events.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.timeout(400)
def test_a_joined_spare_takes_a_failed_ranks_slot_bitwise(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEADPOOL_JOB_TOKEN": "join-test"}
    env.pop("SLURM_PROCID", None)
    worker = [
        sys.executable, "-m", "megatron_deadpool.embedded.worker", "--config", CONFIG,
        "--iters", ITERS, "--deadpool-coordinator", address, "--deadpool-spares", "0", *TIMING,
    ]  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        coordinator = [
            *deadpool_command(), "coordinator", "--world-size", "4", "--config", CONFIG,
            "--deadpool-coordinator", address, "--deadpool-log-dir", str(logs),
            "--deadpool-spares", "0", "--max-wait", "300", *TIMING,
        ]  # fmt: skip
        procs.append(spawn_logged(coordinator, logs / "coordinator.out", env))
        procs.append(spawn_logged([*worker, "--deadpool-join"], logs / "joiner.out", env))
        deadline = time.monotonic() + 120
        while not any(e["event"] == "spare_joined" for e in _events(logs)):
            assert time.monotonic() < deadline, (logs / "joiner.out").read_text()[-3000:]
            assert procs[1].poll() is None, (logs / "joiner.out").read_text()[-3000:]
            time.sleep(0.2)
        for task in range(4):
            procs.append(
                spawn_logged(
                    [*worker, "--deadpool-fail", "1@3"],
                    logs / f"task{task}.out",
                    {**env, "SLURM_PROCID": str(task)},
                )
            )
        assert procs[0].wait(timeout=330) == 0, (logs / "coordinator.out").read_text()[-3000:]
    finally:
        kill_sessions(procs)
    events = _events(logs)
    (joined,) = [e for e in events if e["event"] == "spare_joined"]
    assert joined["member"] == "s0"  # the job had no spare: the joiner is the first
    (recovered,) = [e for e in events if e["event"] == "recovered"]
    assert recovered["dead_ranks"] == [1] and recovered["replaced_by"] == {"1": "s0"}
    assert "joined the running job as spare s0" in (logs / "joiner.out").read_text()
    (finished,) = [e for e in events if e["event"] == "finished"]
    _, _, reference = failure_free(int(ITERS))  # the CPU demo without the failure (conftest)
    assert finished["final_param_digest"] == reference["final_param_digest"]
