"""Megatron-LM's own checkpoint save on a full disk, end to end: `deadpool megatron-lm` runs the
tag's unmodified `pretrain_gpt.py` (CPU, TP2 x DP2 + 1 spare) with `--save` on a filesystem with
room for one checkpoint (a 4 MiB tmpfs in a private mount namespace: tests/small_disk.py).

The checkpoint of iteration 1 fits; those of iterations 2 (`--save-interval`) and 3 (the last
iteration's) do not. Each failed save is one line, on every rank and from the launcher (the
`[deadpool]` line and `checkpoints_not_saved` in summary.json), its partial folder is removed,
the marker keeps naming iteration 1, no rank dies, no spare is spent, and the run ends with exit
code 0, bit for bit as the same run on an ordinary disk (the failed saves changed nothing in
training). `--load` then resumes from iteration 1, bit for bit as from that run's checkpoint of
iteration 1.

One tag runs here: both supported tags reach Megatron's `save_checkpoint` through the same hook
and, on a disk this small, fail in the same place (torch's sharded write, reported on every rank
by torch); what differs between them (core_v0.16.1 writes `common.pt` on rank 0 alone, core_v0.19.0
inside the sharded write) is guarded by the same agreement, tested in tests/replication/test_failed_save.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import deadpool_command
from mlm import NEWEST, RUN_TIMEOUT, Run, launch, megatron_args, megatron_lm_tree
from small_disk import left_files, on_small_disk

ITERS = 3
ROOM_FOR_ONE = "4m"
"""A checkpoint of tests/mlm.py's GPT (TP 2 x DP 2, distributed optimizer) takes 2.5 MB."""
TRACKER = "latest_checkpointed_iteration.txt"
DEADPOOL_ARGS = ["--deadpool", "--deadpool-ranks-per-node", "2"]


def _on_small_disk(tree: Path, tmp_path: Path) -> tuple[Run, Path]:
    """The run with `--save` on the small filesystem, and the folder its files were copied to."""
    save, keep, pidfile = tmp_path / "save", tmp_path / "keep", tmp_path / "pid"
    save.mkdir()
    keep.mkdir()
    run_dir = tmp_path / "run"
    cmd = [*deadpool_command(), "megatron-lm", "--nproc-per-node", "4", "--run-dir",
           str(run_dir), "--timeout", str(RUN_TIMEOUT), str(tree / "pretrain_gpt.py"),
           *megatron_args(ITERS), "--use-distributed-optimizer", "--save", str(save),
           "--save-interval", "1", *DEADPOOL_ARGS, "--deadpool-spares", "1"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.Popen(
        on_small_disk(ROOM_FOR_ONE, save, keep, pidfile, cmd),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,  # every process it starts, and the mount with them, ends here
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT + 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    summary = json.loads((run_dir / "summary.json").read_text())
    return Run(proc.returncode, out, summary, run_dir), keep


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_a_checkpoint_that_does_not_fit_warns_and_training_goes_on(tmp_path: Path) -> None:
    tree = megatron_lm_tree(NEWEST)
    run, keep = _on_small_disk(tree, tmp_path)
    assert run.returncode == 0, run.describe()
    assert "Traceback" not in run.text and "OUT OF REDUNDANCY" not in run.text, run.describe()
    assert sorted(run.iterations()) == [1, 2, 3], run.describe()
    save = tmp_path / "save"
    ends = {
        2: "; training goes on (its state is protected in memory)",
        3: "; training is complete: its final state (iteration 3) is not saved",
    }
    for t, end in ends.items():
        said = f"[deadpool] checkpoint of iteration {t} not saved to {save}/iter_{t:07d} (rank "
        line = next(x for x in run.text.splitlines() if x.startswith(said))
        # The system's words, or - where torch's file writer hides them - the full disk's.
        assert "No space left on device" in line or "no space left on its file system" in line
        assert "); its partial files were removed; " in line, line
        assert line.endswith(
            f"--load {save} resumes from the newest complete checkpoint, iteration 1 "
            f"({save}/iter_0000001){end}"
        ), line
        for rank in range(4):  # and in every rank's log, as a warning
            log = (run.run_dir / f"a{rank}.log").read_text(errors="replace")
            assert f"WARNING {line.removeprefix('[deadpool] ')}" in log, log[-3000:]
        assert run.summary["checkpoints_not_saved"][str(t)] == line.removeprefix("[deadpool] ")
    assert sorted(run.summary["checkpoints_not_saved"]) == ["2", "3"]
    assert run.summary["recoveries"] == [] and run.summary["out_of_redundancy"] is None
    assert run.summary["spares_left"] == ["s0"]
    assert not [f for f in left_files(keep) if f.endswith(".tmp") or "probe" in f]
    assert sorted(p.name for p in keep.iterdir()) == ["iter_0000001", TRACKER]
    assert (keep / TRACKER).read_text().strip() == "1"
    assert (keep / "iter_0000001" / "metadata.json").is_file()
    assert not list(save.iterdir())  # it all went to the private mount

    # The failed saves changed nothing: the same run on an ordinary disk, every save written.
    base = [*megatron_args(ITERS), "--use-distributed-optimizer", *DEADPOOL_ARGS]
    ckpt = tmp_path / "ckpt"
    reference = launch(tmp_path, "reference", tree / "pretrain_gpt.py",
                       [*base, "--save", str(ckpt), "--save-interval", "1"])  # fmt: skip
    assert reference.returncode == 0, reference.describe()
    assert run.iterations() == reference.iterations(), run.describe()
    assert run.summary["param_digests"] == reference.summary["param_digests"]
    # --load resumes from iteration 1, bit for bit as from that run's checkpoint of iteration 1
    # (a resumed run is compared with a resumed run: Megatron's own resume is not bitwise equal
    # to an uninterrupted run, test_pretrain_gpt.py).
    resumed = launch(tmp_path, "resumed", tree / "pretrain_gpt.py", [*base, "--load", str(keep)])
    theirs = launch(tmp_path, "resumed-reference", tree / "pretrain_gpt.py",
                    [*base, "--load", str(ckpt), "--ckpt-step", "1"])  # fmt: skip
    for r in (resumed, theirs):
        assert r.returncode == 0 and sorted(r.iterations()) == [2, 3], r.describe()
    assert resumed.iterations() == theirs.iterations(), resumed.describe()
    assert resumed.summary["param_digests"] == theirs.summary["param_digests"]
