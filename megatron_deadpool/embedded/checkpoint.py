"""Persistent Megatron checkpoints of the embedded job (`--save`, `--save-interval`, `--load`).

DeadPool's in-memory replicas make these unnecessary for surviving a failure; they remain what
a job falls back on when redundancy runs out, what a later job starts from, and the restart
baseline `deadpool bench recovery` compares the hot swap with. They are written the way
Megatron-LM writes them (`megatron/training/checkpointing.py`, `--ckpt-format torch_dist`),
through megatron-core's own `dist_checkpointing`, so Megatron-LM's tools can read them:

    ROOT/latest_checkpointed_iteration.txt    the newest complete iteration (plain integer)
    ROOT/iter_0000005/                        one torch_dist checkpoint per saved iteration
        common.pt, metadata.json, __*.distcp, .metadata

The state dict has Megatron-LM's keys: `model` (`sharded_state_dict()` of the model chunk),
`optimizer` (the distributed optimizer's `sharded_state_dict(model_sd)` in the
`dp_reshardable` layout: every rank writes its own shard of the fp32 main params and Adam
moments, no gather), `opt_param_scheduler`, `iteration`, `checkpoint_version` and `rng_state`
(one `ShardedObject` per rank: Python, NumPy, torch and Megatron RNG-tracker states, so a
resumed run draws the same numbers as an uninterrupted one). The content metadata
(`distrib_optim_sharding_type`, ...) is stored with the checkpoint and read back on load, as
Megatron-LM does.

`save` and `load` are collective over every rank of the world; the marker file is written by
rank 0 only after every rank finished writing (barrier), so a crash mid-save leaves the previous
checkpoint as the latest one.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model

from ..devices.base import real_cuda
from ..errors import CheckpointError, CheckpointSaveError
from ..replication import write_results
from ..replication.failed_save import agreed, attempt, not_saved, prepare, save_agreeing
from ..replication.save_dir import TRACKER, iteration_dir, latest_iteration, write_tracker
from ..replication.snapshot import inner_optimizers

if TYPE_CHECKING:  # importing gpt builds Megatron's layer specs: not needed to read a marker
    from .gpt import TrainingObjects

log = logging.getLogger("megatron_deadpool.embedded.checkpoint")

CKPT_FORMAT = "torch_dist"
CHECKPOINT_VERSION = 3.0
SHARDING_TYPE = "dp_reshardable"
"""Each rank writes its distributed-optimizer buffers as they are (Megatron-LM's default for
torch_dist without `--dist-ckpt-optim-fully-reshardable`): no gather, resharding only in DP."""

_SCALAR_DTYPE = torch.float32
"""dtype of torch Adam's per-parameter `step` (a CPU float32 scalar unless capturable/fused)."""


def _metadata() -> dict[str, Any]:
    """Megatron-LM's `_build_sharded_state_dict_metadata` for torch_dist + distributed optimizer."""
    return {
        "distrib_optim_sharding_type": SHARDING_TYPE,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }


def _serialisable(metadata: dict[str, Any]) -> dict[str, Any]:
    """The content metadata without process groups (they are not stored)."""
    return {k: v for k, v in metadata.items() if not isinstance(v, dist.ProcessGroup)}


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    if real_cuda():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def _sharded_rng(state: dict[str, Any]) -> ShardedObject:
    """This rank's RNG states, one object per (pp, tp, dp) position.

    Megatron-LM keys them by (pp, tp) and keeps DP rank 0's unless
    `--data-parallel-random-init`; keeping every rank's is exact in both cases.
    """
    shape = (
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_data_parallel_world_size(with_context_parallel=True),
    )
    offset = (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_data_parallel_rank(with_context_parallel=True),
    )
    return ShardedObject("rng_state", [state], shape, offset, replica_id=0)


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and real_cuda():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker_states = state["rng_tracker_states"]
    if not tracker_states:
        raise CheckpointError("checkpoint has no Megatron RNG-tracker states")
    get_cuda_rng_tracker().set_states(tracker_states)


def _ensure_optimizer_state(optimizer: Any) -> None:
    """Give a freshly built optimizer's Adam state tensors to load into.

    Megatron's `DistributedOptimizer.sharded_state_dict(is_loading=True)` reads the inner
    optimizer's state (every parameter's `step`) before loading; torch's Adam creates that state
    only in its first `step()` (Apex/TE Adam keep `step` in the param groups, which is why
    Megatron-LM on GPUs does not hit this). Zeros of the right shapes, overwritten by the load.
    """
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if "step" in state:
                    continue
                state["step"] = torch.zeros((), dtype=_SCALAR_DTYPE)
                state.setdefault(
                    "exp_avg", torch.zeros_like(param, memory_format=torch.preserve_format)
                )
                state.setdefault(
                    "exp_avg_sq", torch.zeros_like(param, memory_format=torch.preserve_format)
                )
                if group.get("amsgrad"):
                    state.setdefault("max_exp_avg_sq", torch.zeros_like(param))


def _restore_adam_steps(optimizer: Any) -> None:
    """Give every parameter its own `step` again, the saved one.

    With torch's Adam, megatron-core 0.16.1 keeps the step count in the param groups of the
    saved state dict; its `load_state_dict` hands one shared step tensor to every parameter and
    then copies each parameter's pre-load step over it (the `dp_reshardable` layout carries
    `step` as a non-persistent object), so the count ends up wrong and shared (torch's Adam
    increments it in place, once per parameter). Rebuild it from the loaded param groups, as a
    separate tensor per parameter like torch's Adam makes, and drop the group key that an
    uninterrupted optimizer does not have.
    """
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            if "step" not in group:
                continue
            step = float(group.pop("step"))
            for param in group["params"]:
                if "step" in inner.state[param]:
                    inner.state[param]["step"] = torch.tensor(step, dtype=_SCALAR_DTYPE)


def _state_dict(
    objs: TrainingObjects,
    *,
    metadata: dict[str, Any],
    is_loading: bool,
    iteration: int = 0,
    rng: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Megatron-LM's `generate_state_dict` for torch_dist (one model chunk or several)."""
    state: dict[str, Any] = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    for i, chunk in enumerate(unwrap_model(objs.model)):
        key = "model" if len(objs.model) == 1 else f"model{i}"
        state[key] = chunk.sharded_state_dict(metadata=metadata)
    state["optimizer"] = objs.optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata=metadata
    )
    state["opt_param_scheduler"] = objs.scheduler.state_dict()
    state["rng_state"] = _sharded_rng(rng if rng is not None else _rng_state())
    return state


def save(objs: TrainingObjects, iteration: int, root: str | os.PathLike[str]) -> Path:
    """Write iteration `iteration` of every rank under `root`; collective over the world.

    Call it after the iteration's optimizer and scheduler steps. Returns the iteration's
    directory. The marker file names it only once every rank finished writing.

    A save that cannot be written (a full disk, a read-only folder) raises `CheckpointSaveError`
    on every rank, with the same one line: which rank failed and why, what the marker still
    names. Its partial files are removed first. What fails is agreed on by every rank at each
    step (`failed_save.agreed`): the folder and a probe write (`failed_save.prepare`),
    megatron-core's save (`failed_save.save_agreeing`: its writes on rank 0 alone too) and the
    marker.
    """
    if importlib.util.find_spec("psutil") is None:
        # Megatron's torch_dist writer processes need it; without it they die and the save hangs.
        raise CheckpointError("saving a torch_dist checkpoint needs psutil: pip install psutil")
    t0 = time.perf_counter()
    path = iteration_dir(root, iteration)
    kept = latest_iteration(root)
    saved = kept == iteration and (path / "metadata.json").is_file()
    if agreed(None if saved else f"rank {dist.get_rank()}") is None:  # every rank sees it
        # A recovery recomputed the iteration saved last: its state is bitwise the one saved.
        # Writing it again could only damage the checkpoint the marker names.
        log.debug("checkpoint of iteration %d already saved to %s", iteration, path)
        return path
    error = prepare(path)
    if error is None:  # the directory exists for everyone before anyone writes into it
        write_results.keep_in_process()  # no helper process (the save is synchronous)
        metadata = _metadata()
        state = _state_dict(objs, metadata=metadata, is_loading=False, iteration=iteration)
        error = save_agreeing(  # every rank's files are complete, or the save failed
            lambda: dist_checkpointing.save(
                state,
                str(path),
                get_default_save_sharded_strategy(CKPT_FORMAT),
                content_metadata=_serialisable(metadata),
            ),
            path,
        )
    if error is None and dist.get_rank() == 0:
        error = attempt(lambda: write_tracker(root, iteration))
    error = agreed(error)
    if error is not None:
        raise CheckpointSaveError(not_saved(root, iteration, kept, error))
    log.debug(
        "saved checkpoint of iteration %d to %s in %.2fs", iteration, path, time.perf_counter() - t0
    )
    return path


def load(
    objs: TrainingObjects, root: str | os.PathLike[str], *, iteration: int | None = None
) -> int:
    """Restore model, optimizer, scheduler and RNG from `root` in place; returns the iteration.

    Loads the iteration the marker names (or `iteration`); collective over the world. Afterwards
    the parameters are bitwise those saved and the next `train_step` is the one that would have
    followed the save.
    """
    t0 = time.perf_counter()
    if iteration is None:
        iteration = latest_iteration(root)
        if iteration is None:
            raise CheckpointError(f"{root}: no {TRACKER}; nothing was saved there")
    path = iteration_dir(root, iteration)
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path}: not a complete torch_dist checkpoint (no metadata.json)")
    metadata = dist_checkpointing.load_content_metadata(str(path)) or {}
    sharding = metadata.get("distrib_optim_sharding_type", SHARDING_TYPE)
    metadata = {**_metadata(), **metadata}
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    if sharding != SHARDING_TYPE:
        log.info("checkpoint uses optimizer sharding %r", sharding)
    _ensure_optimizer_state(objs.optimizer)
    sharded = _state_dict(objs, metadata=metadata, is_loading=True)
    loaded = dist_checkpointing.load(
        sharded,
        str(path),
        get_default_load_sharded_strategy(str(path)),
        strict="assume_ok_unexpected",
    )
    if loaded.get("iteration") != iteration:
        raise CheckpointError(
            f"{path}: holds iteration {loaded.get('iteration')}, the marker names {iteration}"
        )
    for i, chunk in enumerate(objs.model):
        key = "model" if len(objs.model) == 1 else f"model{i}"
        chunk.load_state_dict(loaded[key], strict=True)
    with torch.no_grad():  # fp32 main params are views of the (leaf) model params
        objs.optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(objs.optimizer)
    # Megatron's scheduler adds the saved step count to its own: start from zero so that a
    # scheduler that already stepped lands on the saved count too.
    objs.scheduler.num_steps = 0
    objs.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    rng = loaded["rng_state"]
    _set_rng_state(rng[0] if isinstance(rng, list) else rng)
    dist.barrier()
    log.debug(
        "loaded checkpoint of iteration %d from %s in %.2fs",
        iteration,
        path,
        time.perf_counter() - t0,
    )
    return iteration
