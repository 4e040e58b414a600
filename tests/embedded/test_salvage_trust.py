"""An out-of-redundancy save completes whoever dies or lies.

`deadpool train --tp 2 --dp 2 --spares 1 --fail 1@4 --fail 2@8 --save S`: the spare takes rank
1's slot, then rank 2 dies with no spare left and the survivors save every rank's state of
the newest iteration every one of them committed (exit 3). Two things once lost that save - all four rank files on disk, no
manifest, and a `--load S` that trained from iteration 1 over it:

- a stranger's `add` on the job's store (a plain `TCPStore` client, no secret) took the
  one-writer manifest claim (a counter) before any survivor did;
- the survivor holding that claim died while it waited for the others' files.

Each run must still end with exit 3 and a complete set, and `--load S` resume from the saved iteration
and end with the failure-free run's losses and parameter digest. And a folder whose manifest is
missing is never trained over: `--load` completes it when every rank's file is there and
verifies, else refuses in one line naming what is missing.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from conftest import TrainRun, run_deadpool, train_case
from test_forged_store import MAC_CHARS, _store_address

from megatron_deadpool.replication import snapshot_set

ITERS = 8
ARGS = ["--tp", "2", "--dp", "2", "--spares", "1", "--fail", "1@4", "--fail", "2@8"]
RANK_OF = {"a0": 0, "s0": 1, "a3": 3}
"""The survivors after both failures: the spare holds rank 1."""


def _client(run_dir: Path) -> dist.TCPStore:
    host, port = _store_address(run_dir).rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))


class Outsider(threading.Thread):
    """A plain store client on the running job: `act(client)` once the job has started."""

    def __init__(self, run_dir: Path, act: Callable[[dist.TCPStore], Any]) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.act = run_dir, act
        self.error: BaseException | None = None
        self.result: Any = None

    def run(self) -> None:
        try:
            client = _client(self.run_dir)
            client.wait(["gen0/roster"], datetime.timedelta(seconds=120))
            self.result = self.act(client)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def _forge_claims(client: dist.TCPStore) -> None:
    """Take every claim a counter could hold on the save: the old manifest claim first."""
    for key in ("salvage/manifest", "salvage/manifest/claim"):
        client.add(key, 1)


def _kill_first_salvager(client: dist.TCPStore) -> str:
    """SIGKILL the first survivor that marks its part saved (the one that used to claim the
    manifest and then wait for the others' files); its member name."""
    pids = {}
    for member in RANK_OF:
        key = f"proc/{member}/ready"
        client.wait([key], datetime.timedelta(seconds=120))
        pids[member] = json.loads(client.get(key)[MAC_CHARS:])["os_pid"]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for member, rank in RANK_OF.items():
            if client.check([f"salvaged/{rank}"]):
                os.kill(pids[member], signal.SIGKILL)
                return member
        time.sleep(0.005)
    raise AssertionError("no survivor marked its part saved")


def _run_with(tmp_path: Path, act: Callable[[dist.TCPStore], Any]) -> tuple[Path, int, Any]:
    """The run with `act` on its store: its save folder, the iteration saved, what `act` said."""
    outsider = Outsider(tmp_path / "logs", act)
    outsider.start()
    proc, _, summary = train_case(tmp_path, [*ARGS, "--save", "{ckpt}"], str(ITERS), timeout=400)
    outsider.join(60)
    assert outsider.error is None, repr(outsider.error)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    save = summary["out_of_redundancy"]["save"]
    assert save["complete"] and save["iteration"] >= 6, save  # rank 2 dies as 8 starts
    return tmp_path / "ckpt", save["iteration"], outsider.result


def _resume(tmp_path: Path, ckpt: Path, saved: int, reference: dict[str, Any]) -> None:
    """`--load ckpt` resumes from the saved iteration, bitwise the failure-free run."""
    log = tmp_path / "resume.jsonl"
    proc = run_deadpool(
        "train", "--tp", "2", "--dp", "2", "--iters", str(ITERS), "--load", str(ckpt),
        "--json-log", str(log), "--run-dir", str(tmp_path / "resume"), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(log.read_text().splitlines()[-1])
    assert summary["losses"] == reference["losses"][saved:]
    assert summary["final_param_digest"] == reference["final_param_digest"]


def _assert_complete(ckpt: Path, saved: int) -> None:
    manifest = snapshot_set.read_manifest(ckpt, saved)
    assert manifest["complete"] and manifest["ranks_present"] == [0, 1, 2, 3], manifest


@pytest.mark.timeout(900)
def test_a_strangers_counter_cannot_lose_the_save(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    reference = failure_free(ITERS)[2]
    ckpt, saved, _ = _run_with(tmp_path, _forge_claims)
    _assert_complete(ckpt, saved)
    _resume(tmp_path, ckpt, saved, reference)


@pytest.mark.timeout(900)
def test_a_survivor_killed_during_the_save_cannot_lose_it(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    reference = failure_free(ITERS)[2]
    ckpt, saved, killed = _run_with(tmp_path, _kill_first_salvager)
    assert killed in RANK_OF
    _assert_complete(ckpt, saved)
    _resume(tmp_path, ckpt, saved, reference)

    # The same save with its manifest gone (every writer died before writing it): --load
    # completes it from the verified files, and resumes from it exactly.
    (snapshot_set.set_dir(ckpt, saved) / "manifest.json").unlink()
    _resume(tmp_path, ckpt, saved, reference)
    assert "completed by --load" in snapshot_set.read_manifest(ckpt, saved)["reason"]

    # Without one rank's file it refuses in one line, naming what is missing: never iteration 1.
    partial = tmp_path / "partial"
    shutil.copytree(ckpt, partial)
    (snapshot_set.set_dir(partial, saved) / "manifest.json").unlink()
    snapshot_set.rank_file(partial, saved, 2).unlink()
    proc = run_deadpool("train", "--tp", "2", "--dp", "2", "--iters", str(ITERS),
                        "--load", str(partial))  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "no complete manifest" in line and "missing: the files of ranks [2]" in line, line
