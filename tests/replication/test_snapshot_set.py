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
