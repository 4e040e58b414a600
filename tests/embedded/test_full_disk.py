"""A persistent checkpoint that cannot be written, end to end: `deadpool train --save` on a
filesystem with room for one checkpoint (a 4 MiB tmpfs in a private mount namespace, as the
out-of-redundancy save's test in test_hotswap.py uses).

A periodic checkpoint that fails warns in one line (which rank, why, what `--load` resumes
from) and training goes on, bitwise the failure-free run; the preemption's checkpoint that
fails ends the run with exit code 143 and that line. Neither leaves a temporary or partial file,
and `--load` resumes from the newest complete checkpoint - never from a partial one - bitwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import FAILURE_FREE_ARGS, FAST_HEARTBEAT, TrainRun, deadpool_command, train_case
from small_disk import left_files, on_small_disk

ROOM_FOR_ONE = "4m"
"""A CPU demo checkpoint (TP 2 x DP 2) takes 2.6 MB: the first fits, the next does not."""


def _small_disk(tmp_path: Path, args: list[str]) -> tuple[subprocess.Popen, Path, Path]:
    """`deadpool train ARGS --save SAVE` with SAVE on a small filesystem: the process, the
    folder its files are copied to when it ends, and the file of its PID."""
    save, keep, pidfile = tmp_path / "save", tmp_path / "keep", tmp_path / "pid"
    save.mkdir()
    keep.mkdir()
    cmd = [*deadpool_command(), "train", *FAILURE_FREE_ARGS, *args, "--save", str(save),
           *FAST_HEARTBEAT, "--json-log", str(tmp_path / "run.jsonl"), "--run-dir",
           str(tmp_path / "logs")]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.Popen(
        on_small_disk(ROOM_FOR_ONE, save, keep, pidfile, cmd),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    return proc, keep, pidfile


def _assert_left_clean(tmp_path: Path, keep: Path) -> None:
    """Nothing but the complete checkpoint of iteration 2 and the marker naming it: no
    temporary file, no partial checkpoint, nothing written outside the private mount."""
    files = left_files(keep)
    assert not [f for f in files if f.endswith(".tmp") or "probe" in f], files
    assert sorted(p.name for p in keep.iterdir()) == ["iter_0000002", TRACKER]
    assert (keep / TRACKER).read_text() == "2\n"
    assert (keep / "iter_0000002" / "metadata.json").is_file()
    assert not list((tmp_path / "save").iterdir())
    for log in (tmp_path / "logs").glob("a*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), log


TRACKER = "latest_checkpointed_iteration.txt"


def _not_saved(iteration: int, save: Path) -> str:
    return f"checkpoint of iteration {iteration} not saved to {save}/iter_{iteration:07d} (rank "


def _resume_bitwise(tmp_path: Path, keep: Path, iters: int, reference: TrainRun) -> None:
    """`--load` the kept files, a partial checkpoint of a later iteration planted beside them
    (a save cut off where nobody could remove it): it resumes from iteration 2, the newest
    complete one, and ends bitwise as the failure-free run."""
    partial = keep / "iter_0000004"
    shutil.copytree(keep / "iter_0000002", partial)
    (partial / "metadata.json").unlink()
    (partial / ".metadata").unlink()
    proc, records, summary = train_case(
        tmp_path / "resumed", [*FAILURE_FREE_ARGS, "--load", str(keep)], str(iters)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _, _, ref = reference
    assert [r["iteration"] for r in records] == list(range(3, iters + 1))
    assert summary["losses"] == ref["losses"][2:]
    assert summary["final_param_digest"] == ref["final_param_digest"]


@pytest.mark.timeout(400)
def test_a_periodic_checkpoint_that_does_not_fit_warns_and_training_goes_on(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    """Iteration 2's checkpoint fits, 4's and 6's do not: two lines, exit code 0, the
    failure-free losses and digest, iteration 2 kept, and `--load` resumes from it."""
    proc, keep, _ = _small_disk(tmp_path, ["--iters", "6", "--save-interval", "2"])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err
    save = tmp_path / "save"
    for t in (4, 6):
        line = next(x for x in out.splitlines() if _not_saved(t, save) in x)
        assert line.startswith("  !! checkpoint of iteration "), line
        # The system's words, or - where torch's file writer hides them - the full disk's.
        assert "No space left on device" in line or "no space left on its file system" in line
        assert "); its partial files were removed; " in line
        assert line.endswith(
            f"--load {save} resumes from the newest complete checkpoint, iteration 2 "
            f"({save}/iter_0000002); training goes on (its state is protected in memory)"
        ), line
        for rank in range(4):  # and in every rank's log, as a warning
            log = (tmp_path / "logs" / f"a{rank}.log").read_text()
            assert f"WARNING {line[5:]}" in log, log[-2000:]
    summary = json.loads((tmp_path / "run.jsonl").read_text().splitlines()[-1])
    assert sorted(summary["checkpoints_not_saved"]) == ["4", "6"]
    reference = failure_free(6)
    assert summary["losses"] == reference[2]["losses"]
    assert summary["final_param_digest"] == reference[2]["final_param_digest"]
    _assert_left_clean(tmp_path, keep)
    _resume_bitwise(tmp_path, keep, 6, reference)


@pytest.mark.timeout(400)
def test_a_preemption_checkpoint_that_does_not_fit_ends_with_143_and_says_what_is_saved(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    """SIGTERM after iteration 3 or later: every rank stops, the checkpoint of that iteration
    does not fit (iteration 2's takes the room): exit code 143, one line naming what was not
    saved and what `--load` resumes from, and `--load` resumes bitwise from iteration 2."""
    proc, keep, pidfile = _small_disk(tmp_path, ["--iters", "8", "--save-interval", "2"])
    log = tmp_path / "run.jsonl"
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not (
            log.exists() and len(log.read_text().splitlines()) >= 3
        ):
            time.sleep(0.2)
        os.kill(int(pidfile.read_text()), signal.SIGTERM)
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err
    summary = json.loads(log.read_text().splitlines()[-1])
    stopped = summary["preempted"]["iteration"]
    assert 3 <= stopped < 8 and not summary["preempted"]["saved"], summary["preempted"]
    save = tmp_path / "save"
    line = next(
        x for x in out.splitlines() if f"preempted: stopping after iteration {stopped};" in x
    )
    assert line == "  !! " + summary["preempted"]["unsaved"], line
    assert _not_saved(stopped, save) in line
    # The system's words, or - where torch's file writer hides them ("unexpected pos ...",
    # depending on which write met the full disk) - the full disk's (failed_save.py).
    assert "No space left on device" in line or "no space left on its file system" in line
    assert line.endswith(
        f"--load {save} resumes from the newest complete checkpoint, iteration 2 "
        f"({save}/iter_0000002)"
    ), line
    _assert_left_clean(tmp_path, keep)
    reference = failure_free(8)
    assert summary["losses"] == reference[2]["losses"][:stopped]
    _resume_bitwise(tmp_path, keep, 8, reference)
