"""The job's own error on a cluster: `deadpool coordinator` ends the job without a spare.

A cluster coordinator sees no process exit, only heartbeats and what processes report. A rank
that raises an exception of its own reports it before it exits (`Driver.report_error`); the
report names it dead at once - no heartbeat timeout is waited for - and an error in the rank's
start-up (before anything was replicated) is the job's own: the coordinator prints `JOB ERROR:`
with the end of the rank's traceback, lets the waiting spare go, and exits 9, the code
`scripts/slurm/deadpool_coordinator.sh` ends the Slurm job on.

Real processes on loopback: the coordinator and five embedded workers (the CPU demo, 4 ranks
and a spare), as a Slurm job would start them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from coordinated_job import coordinated_job

TIMING = [
    "--deadpool-heartbeat-interval", "0.5", "--deadpool-heartbeat-timeout", "30",
    "--deadpool-agree-timeout", "60", "--deadpool-pg-timeout", "150",
]  # fmt: skip
"""A heartbeat timeout far longer than the decision may take."""


@pytest.mark.timeout(300)
def test_a_start_up_error_ends_the_cluster_job_at_once_with_exit_code_9(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    out = logs / "coordinator.out"
    with coordinated_job(logs, "job-error-test", "4", "0@1:raise", TIMING, "240") as procs:
        assert procs[0].wait(timeout=240) == 9, out.read_text()[-3000:]
        spare_left = procs[-1].wait(timeout=30)  # the shutdown lets the waiting spare go
    text = out.read_text()
    message = "fault injection: rank 0 raises at iteration 1"
    assert f"JOB ERROR: rank 0 start-up: InjectedError: {message}\n" in text, text[-3000:]
    assert "a0's traceback ends:" in text and f"a0| {_qualified(message)}" in text, text[-3000:]
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    assert [e for e in events if e["event"] == "plan"] == []  # the spare never got a slot
    (reported,) = [e for e in events if e["event"] == "error_reported"]
    (decided,) = [e for e in events if e["event"] == "job_error"]
    assert reported["member"] == "a0" and decided["report"]["phase"] == "start-up"
    assert decided["t"] - reported["t"] < 1.0  # the report decided it: no timeout waited for
    assert spare_left == 0
    assert "released: the job ended without needing this spare" in (logs / "task4.out").read_text()


def _qualified(message: str) -> str:
    """The last line Python prints for the injected error."""
    return f"megatron_deadpool.hotswap.worker.injection.InjectedError: {message}"
