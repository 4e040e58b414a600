"""A job past its time limit says what had not finished: `deadpool train --timeout` with a rank
that hangs (SIGSTOP) and DeadPool off, so that nothing recovers it and its peers wait in their
collective with it. The launcher exits with code 124 and names every process whose exit it did
not see, each with its log's last lines - the hung rank's ending with its fault - so that a run
stopped by its limit (in CI: the job's `--timeout`) says where it stood."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FAILURE_FREE_ARGS, run_deadpool


@pytest.mark.timeout(240)
def test_a_job_past_its_limit_names_the_processes_still_running_with_their_logs_end(
    tmp_path: Path,
) -> None:
    proc = run_deadpool(
        "train", *FAILURE_FREE_ARGS, "--iters", "8", "--no-deadpool", "--fail", "1@3:hang",
        "--run-dir", str(tmp_path / "run"), "--timeout", "20", timeout=200,
    )  # fmt: skip
    assert proc.returncode == 124, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "the job exceeded its" in out and "not finished:" in out, out[-3000:]
    detail = out[out.index("not finished:") :]
    for member in ("a0", "a1", "a2", "a3"):  # the hung rank and its peers waiting on it
        assert f"{member} (no exit seen); its log (" in detail, detail
    hung = detail[detail.index("a1 (no exit seen)") :].splitlines()
    tail = [line for line in hung[1:] if line.startswith("    a1| ")]
    assert tail and "fault injection: hang at iteration 3" in "\n".join(tail), detail
    assert "Traceback" not in out
