"""The first contact with one GPU (`scripts/gpu_first_contact.py`) under ``pytest -m gpu``.

The first test is skipped without CUDA; the second checks, anywhere, that the script skips
cleanly where no device is visible. The first runs every row of the script within its ten-minute budget, prints its
table, and fails when a row failed (the figures go to ``DEADPOOL_GPU_REPORT``/first_contact.json
when that is set).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_first_contact.py"

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(720)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_first_contact_reports_no_failed_row() -> None:
    args = [sys.executable, str(SCRIPT), "--budget", "600"]
    where = os.environ.get("DEADPOOL_GPU_REPORT")
    if where:
        os.makedirs(where, exist_ok=True)
        args += ["--json", os.path.join(where, "first_contact.json")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=700, check=False)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


ITEMS = {
    "1-abort-off-the-heartbeat-thread": "plan_watch",
    "2-aborts-started-together": "abort_deadpool,abort_torch",
    "3-gpu-hang-seen": "device_watch,versions",
    "4-auto-stays-on-the-gpu": "auto_rebuilt",
    "5-exact-pinned-size": "pinned_size",
    "6-7-pinned-replicas-verified-off-the-main-thread": "pinned_repl",
    "9-communicators-per-generation": "gens_split,gens_warm",
}
"""Issue 26's items and the first-contact rows that check each on one GPU."""


@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("item", sorted(ITEMS))
def test_each_item_of_issue_26_on_one_gpu(item: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", ITEMS[item], "--no-build", "--budget", "500"],
        capture_output=True, text=True, timeout=560, check=False,
    )  # fmt: skip
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_script_skips_cleanly_without_cuda() -> None:
    """Also on a GPU machine: with no device visible every row says skip and it exits 0."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "versions,pinned_size", "--no-build"],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" skip ") == 2


def test_the_new_rows_skip_cleanly_without_cuda() -> None:
    """Issue 39's rows (round cost with the kernel and the fallback, N2's probe, the heartbeat
    with the device watch, the threads' devices) are known to the script and skip, not crash,
    where no device is visible."""
    rows = "round_cost,round_cost_torch,overlap_conn1,n2_probe,heartbeat_dw,thread_devices"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", rows, "--no-build"],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" skip ") == 6, proc.stdout
