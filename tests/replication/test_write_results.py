"""`write_results.keep_in_process` on two gloo ranks with megatron-core's real torch_dist save:
the save's results pass through a queue of the rank's own process, so no manager's server is
started (one is without it: the control), and what was saved loads back equal."""

from __future__ import annotations

from typing import Any

import pytest
from mp import run_world


def _save_and_load(rank: int, world_size: int, store: Any, tmp: str, in_process: bool) -> Any:
    import multiprocessing

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    from megatron_deadpool.replication import write_results

    kept = write_results.keep_in_process() if in_process else False
    weight = torch.arange(4, dtype=torch.float32) + 10 * rank  # this rank's half of a tensor

    def state(tensor: torch.Tensor) -> dict[str, Any]:
        return {"w": ShardedTensor.from_rank_offsets("w", tensor, (0, rank, world_size))}

    dist_checkpointing.save(state(weight), tmp, get_default_save_sharded_strategy("torch_dist"))
    helpers = [p.name for p in multiprocessing.active_children()]
    loaded = dist_checkpointing.load(state(torch.zeros(4)), tmp)["w"]
    return {"kept": kept, "helpers": helpers, "equal": torch.equal(loaded, weight)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "control"])
def test_a_synchronous_save_starts_no_helper_process(tmp_path, in_process: bool) -> None:
    kwargs = {"tmp": str(tmp_path), "in_process": in_process}
    results = run_world("test_write_results:_save_and_load", 2, kwargs=kwargs, timeout=180)
    for r in results:
        assert r["equal"] and r["kept"] == in_process, results
        if in_process:
            assert r["helpers"] == [], results
        else:  # megatron-core's own queue: a manager's server, started at the first save
            assert [name.split("-")[0] for name in r["helpers"]] == ["SyncManager"], results
