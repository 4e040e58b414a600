"""Snapshot sets on disk when the survivors write them with no coordinator: the manifest that
stays tells what is on disk, and the newest complete set is found from the manifests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_deadpool.replication import snapshot_set


def _write_rank(root: Path, t: int, rank: int) -> None:
    snapshot_set.write_flat(
        snapshot_set.rank_file(root, t, rank), torch.arange(8, dtype=torch.uint8)
    )


def test_a_stale_manifest_landing_last_is_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Survivor A lists the set (rank 0 only), survivor B then writes rank 1 and the complete
    manifest, and only then A's listing lands as the manifest: A looks again and rewrites it."""
    _write_rank(tmp_path, 5, 0)
    real = snapshot_set.write_manifest
    order = []

    def write(root: Path, manifest: dict) -> Path:
        if not order:  # A's first write: B overtakes it
            order.append("B")
            _write_rank(tmp_path, 5, 1)
            real(root, {**manifest, "ranks_present": [0, 1], "complete": True})
        order.append(manifest["ranks_present"])
        return real(root, manifest)

    monkeypatch.setattr(snapshot_set, "write_manifest", write)
    seen = snapshot_set.publish_manifest(tmp_path, 5, 2, {"reason": "test"})
    assert order == ["B", [0], [0, 1]]  # the stale listing landed, then the true one
    assert seen["complete"] and snapshot_set.read_manifest(tmp_path, 5)["complete"]
    assert snapshot_set.latest_complete(tmp_path) == 5


def test_the_newest_complete_set_wins_over_a_newer_incomplete_one(tmp_path: Path) -> None:
    for t, ranks in ((6, [0, 1]), (7, [1])):
        for r in ranks:
            _write_rank(tmp_path, t, r)
        snapshot_set.publish_manifest(tmp_path, t, 2, {})
    assert not snapshot_set.read_manifest(tmp_path, 7)["complete"]
    assert snapshot_set.latest_complete(tmp_path) == 6
    assert snapshot_set.latest_complete(tmp_path / "nothing-here") is None


# ---------------------------------------------------------------------- durable writes
def test_set_files_are_fsynced_file_and_folder_under_unique_temporary_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before a rank file or a manifest counts, its bytes and its folder entry are on disk;
    its temporary name carries host, PID and a random part (two writers never share one)."""
    import os
    import socket

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    renamed: list[str] = []
    real_replace = os.replace

    def replace(src: str, dst: str) -> None:
        renamed.append(Path(src).name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = snapshot_set.rank_file(tmp_path, 5, 0)
    snapshot_set.write_flat(path, torch.arange(8, dtype=torch.uint8))
    snapshot_set.write_flat(path, torch.arange(8, dtype=torch.uint8))
    snapshot_set.publish_manifest(tmp_path, 5, 1, {})
    folder = str(snapshot_set.set_dir(tmp_path, 5))
    assert synced.count(folder) >= 3  # after each rename
    assert any(s.startswith(folder + "/.rank_00000.snap.") for s in synced)  # the file itself
    assert any(s.startswith(folder + "/.manifest.json.") for s in synced)
    host = socket.gethostname().split(".")[0]
    first, second = renamed[:2]
    assert first != second and f".{host}.{os.getpid()}." in first, renamed
    assert not list(snapshot_set.set_dir(tmp_path, 5).glob("*.tmp"))


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    path = snapshot_set.rank_file(tmp_path, 5, 0)
    snapshot_set.write_flat(path, torch.arange(8, dtype=torch.uint8))

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        snapshot_set.write_flat(path, torch.full((16,), 7, dtype=torch.uint8))
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert path.read_bytes() == bytes(range(8))


# ---------------------------------------------------------------------- reading
def test_a_crafted_header_is_refused_before_anything_is_allocated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A header claiming 1 TiB (its check word right) in a small file, or a file longer than
    its header says: a clear error, and the payload is never read."""
    import numpy as np
    from flats import flat

    from megatron_deadpool.replication.snapshot import HEADER_BYTES, CorruptReplicaError, Header

    good = flat(0, 5)
    crafted = Header(owner=0, iteration=5, nbytes=1 << 40, checksum=0, meta_nbytes=16)
    path = tmp_path / "rank_00000.snap"
    path.write_bytes(bytes(good[:-HEADER_BYTES].numpy()) + crafted.encode())
    read: list[object] = []
    monkeypatch.setattr(np, "fromfile", lambda *a, **k: read.append(a) or np.zeros(0, np.uint8))
    with pytest.raises(CorruptReplicaError, match="inconsistent.*1099511627776"):
        snapshot_set.read_flat(path)
    path.write_bytes(bytes(100) + bytes(good.numpy()))  # longer than the header says
    with pytest.raises(CorruptReplicaError, match="inconsistent"):
        snapshot_set.read_flat(path)
    path.write_bytes(bytes(10))
    with pytest.raises(CorruptReplicaError, match="truncated"):
        snapshot_set.read_flat(path)
    assert read == []


# ---------------------------------------------------------------------- choosing what to resume
def test_load_passes_over_a_truncated_newest_set_for_the_previous_good_one(tmp_path: Path) -> None:
    from flats import write_set

    from megatron_deadpool.replication import save_dir

    write_set(tmp_path, 5, 2)
    write_set(tmp_path, 7, 2)
    assert save_dir.resume_point(tmp_path) == ("snapshots", 7)
    newest = snapshot_set.rank_file(tmp_path, 7, 1)
    newest.write_bytes(newest.read_bytes()[:-100])  # its node lost while it was written
    assert save_dir.resume_point(tmp_path) == ("snapshots", 5)
    line = save_dir.choose_resume(tmp_path).fallback(tmp_path)
    assert line is not None and "\n" not in line
    assert f"passed over the damaged snapshot set {snapshot_set.set_dir(tmp_path, 7)}" in line
    assert "rank_00001.snap" in line and "resuming from the snapshot set of iteration 5" in line


def test_load_passes_over_a_set_whose_file_fails_its_checksum_on_every_rank_alike(
    tmp_path: Path,
) -> None:
    """One process deciding reads every file; ranks deciding together each read their own and
    agree: both pass over the set whose rank-1 file has one flipped bit, for the Megatron
    checkpoint."""
    from flats import write_set

    from megatron_deadpool.replication import save_dir

    (tmp_path / "iter_0000003").mkdir()
    (tmp_path / save_dir.TRACKER).write_text("3\n")
    write_set(tmp_path, 7, 2)
    damaged = snapshot_set.rank_file(tmp_path, 7, 1)
    data = bytearray(damaged.read_bytes())
    data[40] ^= 1 << 2
    damaged.write_bytes(bytes(data))
    assert save_dir.resume_point(tmp_path) == ("megatron", 3)
    verdicts = {r: snapshot_set.rank_problem(tmp_path, 7, r, checksum=True) is None for r in (0, 1)}
    assert verdicts == {0: True, 1: False}
    for rank in (0, 1):
        choice = save_dir.choose_resume(tmp_path, rank=rank, agree=lambda _: all(verdicts.values()))
        assert choice.point() == ("megatron", 3)
        line = choice.fallback(tmp_path)
        assert line is not None and "resuming from the Megatron checkpoint of iteration 3" in line
    assert "checksum mismatch" in (save_dir.choose_resume(tmp_path).fallback(tmp_path) or "")


def test_a_set_without_its_manifest_is_completed_or_refused_never_passed_over(
    tmp_path: Path,
) -> None:
    """The writers of the newest set ended before its manifest: `--load` (one process deciding
    for a job of 2 ranks) completes it when every file verifies; the ranks of a world, or
    without a file, refuse in one line naming what is missing - never the older set."""
    from flats import write_set

    from megatron_deadpool.errors import CheckpointError
    from megatron_deadpool.replication import save_dir

    write_set(tmp_path, 3, 2)
    write_set(tmp_path, 5, 2)
    manifest = snapshot_set.set_dir(tmp_path, 5) / "manifest.json"
    manifest.unlink()
    with pytest.raises(CheckpointError, match="holds the rank files of ranks \\[0, 1\\]"):
        save_dir.choose_resume(tmp_path, rank=0, agree=lambda ok: ok)
    with pytest.raises(CheckpointError, match="world size it was saved by is unknown"):
        save_dir.choose_resume(tmp_path)
    assert save_dir.choose_resume(tmp_path, world_size=2).point() == ("snapshots", 5)
    assert snapshot_set.read_manifest(tmp_path, 5)["complete"]
    manifest.unlink()
    snapshot_set.rank_file(tmp_path, 5, 1).unlink()
    with pytest.raises(CheckpointError, match="missing: the files of ranks \\[1\\]"):
        save_dir.choose_resume(tmp_path, world_size=2)
