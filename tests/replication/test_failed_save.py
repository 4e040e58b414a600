"""`failed_save.save_agreeing`, which guards Megatron-LM's `save_checkpoint` and the embedded
job's save, on two gloo ranks: wherever a write fails - on one rank alone or on all of them -
every rank leaves the save with the same error and none is left in a collective. Stand-ins for
the save make the calls megatron-core and Megatron-LM make, in their order (a write on rank 0
alone, then `torch.distributed.barrier()`; core_v0.16.1's `common.pt` before the sharded
write's collectives; torch's report of a failed sharded write on every rank)."""

from __future__ import annotations

import errno
from typing import Any

import pytest
from mp import run_world


def _cases(tmp: str) -> dict[str, Any]:
    """name -> a stand-in for Megatron's `save_checkpoint` (run on every rank)."""
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies import common
    from torch.distributed.checkpoint.api import CheckpointException

    def marker_fails() -> None:  # the marker: rank 0 writes it alone, then the last barrier
        torch.distributed.barrier()
        if dist.get_rank() == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        torch.distributed.barrier()

    def common_pt_fails() -> None:  # core_v0.16.1's common.pt, then the sharded write
        common.TorchCommonSaveStrategy("torch", 1).save_common({}, f"{tmp}/missing/iter_0000001")
        dist.all_reduce(torch.zeros(1))  # the sharded write's collectives
        torch.distributed.barrier()
        torch.distributed.barrier()

    def sharded_write_fails() -> None:  # torch reports it on every rank
        raise CheckpointException("write", {1: OSError(errno.ENOSPC, "No space left on device")})

    def saved() -> None:
        torch.distributed.barrier()
        torch.distributed.barrier()

    return {
        "marker": marker_fails,
        "common.pt": common_pt_fails,
        "sharded write": sharded_write_fails,
        "saved": saved,
    }


def _guarded_saves(rank: int, world_size: int, store: Any, tmp: str) -> dict[str, Any]:
    from pathlib import Path

    import torch.distributed as dist

    from megatron_deadpool.replication.failed_save import prepare, save_agreeing

    real_barrier = dist.barrier
    (Path(tmp) / "a-file").touch()
    out: dict[str, Any] = {"unwritable": prepare(Path(tmp) / "a-file" / "iter_0000001")}
    for name, stand_in in _cases(tmp).items():
        out[name] = save_agreeing(stand_in, Path(tmp) / "iter_0000001")
        assert dist.barrier is real_barrier  # put back
    return out


@pytest.mark.timeout(180)
def test_every_rank_leaves_a_failed_save_together_with_the_same_error(tmp_path) -> None:
    results = run_world(
        "test_failed_save:_guarded_saves", 2, kwargs={"tmp": str(tmp_path)}, timeout=120
    )
    assert results[0] == results[1], results
    said = results[0]
    assert said["unwritable"] == "rank 0: [Errno 20] Not a directory"  # --save not a folder
    assert said["marker"] == "rank 0: [Errno 28] No space left on device"
    assert (
        said["common.pt"].startswith("rank 0: Parent directory ") and "missing" in said["common.pt"]
    ), said
    assert said["sharded write"].startswith("rank 1: [Errno 28] No space left on device"), said
    assert said["saved"] is None
