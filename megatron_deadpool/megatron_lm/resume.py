"""Resume a Megatron-LM run from the snapshot set DeadPool saved when it ran out of redundancy.

Out of redundancy (no spare left, or a shard with no surviving copy) the survivors cannot call
Megatron's `save_checkpoint`: it is collective over the whole world - every data-parallel rank
writes its own distributed-optimizer shard and rank 0 gathers every rank's save plan - and
some ranks are dead. So they write DeadPool's snapshot set instead (`recovery.salvage`):
`SAVE/deadpool/iter_T/rank_*.snap`, every rank's optimizer shard, LR-scheduler and RNG states
of iteration T, checksummed, plus `manifest.json` with Megatron's sample and FLOP counters
after T. That is exactly what the in-memory hot swap restores from, now on disk.

The next launch of the same command with `--load SAVE` resumes from it when the set is complete
and newer than Megatron's latest checkpoint there (and no `--ckpt-step` asks for a specific
one). Now the full world exists again, so each rank, right after Megatron built its model and
optimizer (without loading its older checkpoint), loads its own snapshot (checksum-verified),
re-derives the weights from the main params, takes Megatron's counters of T (the data
iterators are built from them next), and - with `--save` - writes iteration T through
Megatron's own `save_checkpoint`, so from then on the state is a Megatron checkpoint that
Megatron-LM's own `--load` and tools read. The RNG states of T are put back just before the
first training step (building the data iterators in between may draw random numbers), so the
iterations after T are those of the run without the failure.

Megatron's own `load_checkpoint` runs under `torch.no_grad()` here: with fp32 parameters and
the distributed optimizer it copies the loaded state into views of leaf parameters, which
autograd refuses otherwise, so `--load` of such a checkpoint (the one written above, or any
`--save-interval` one) would fail.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..errors import ConfigError
from ..replication import snapshot_set as salvage
from ..replication.save_dir import Agree, choose_resume, latest_iteration, world_agrees

log = logging.getLogger("megatron_deadpool.megatron_lm")

COUNTERS = ("consumed_train", "consumed_valid", "skipped_train", "flops")


def build_without_loading(a: Any, real: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Megatron's `setup_model_and_optimizer` (`real`) with `--load` and
    `--pretrained-checkpoint` switched off for the call: the state comes from elsewhere."""
    saved = (a.load, a.pretrained_checkpoint)
    a.load = a.pretrained_checkpoint = None
    try:
        return real(*args, **kwargs)
    finally:
        a.load, a.pretrained_checkpoint = saved


@dataclass(frozen=True)
class SnapshotResume:
    """A complete snapshot set to resume from: its iteration and Megatron's counters after it."""

    root: Path
    iteration: int
    counters: dict[str, float]


def snapshot_to_resume(
    load: str | None,
    ckpt_step: int | None,
    world_size: int,
    *,
    rank: int | None = None,
    agree: Agree | None = None,
) -> SnapshotResume | None:
    """The snapshot set under `load` a launch resumes from, or None for Megatron's own load.

    None when there is no `--load`, `--ckpt-step` names a Megatron checkpoint, there is no
    complete set that verifies (`save_dir.choose_resume`, by this `rank` with the others
    through `agree`, or every file here; a damaged newer one is passed over, in one warning
    line), or Megatron's latest checkpoint there is as new. Raises `ConfigError` when the set
    does not fit this run (another world size, no Megatron counters).
    """
    if not load or ckpt_step is not None:
        return None
    resume = choose_resume(load, rank=rank, agree=agree)
    fallback = resume.fallback(load)
    if fallback:
        log.warning("%s", fallback)
    if resume.kind != "snapshots":
        return None
    t = resume.iteration
    megatron = latest_iteration(load)
    if megatron is not None and megatron >= t:
        return None
    manifest = salvage.read_manifest(load, t)
    where = salvage.set_dir(load, t)
    if manifest.get("world_size") != world_size:
        raise ConfigError(
            f"load: the DeadPool snapshot set {where} was saved by {manifest.get('world_size')} "
            f"ranks, this run has {world_size}; run with the same parallel layout to resume"
        )
    counters = manifest.get("megatron")
    if not isinstance(counters, dict) or any(k not in counters for k in COUNTERS):
        raise ConfigError(
            f"load: the DeadPool snapshot set {where} has no Megatron counters (it was written by "
            "`deadpool train`, not by a Megatron-LM run)"
        )
    return SnapshotResume(Path(load), t, {k: counters[k] for k in COUNTERS})


class Resumer:
    """The hooks that resume from a snapshot set (inert when there is none to resume)."""

    def __init__(self) -> None:
        self.rng: list[torch.Tensor] | None = None  # RNG states of T, for the first step
        self.resumed: SnapshotResume | None = None

    def setup_model_and_optimizer(self, real: Any, *args: Any, **kwargs: Any) -> Any:
        """Megatron's `setup_model_and_optimizer`, then the snapshot of T when one is due."""
        import torch.distributed as dist
        from megatron.training import get_args

        a = get_args()
        point = snapshot_to_resume(
            a.load, a.ckpt_step, dist.get_world_size(), rank=dist.get_rank(), agree=world_agrees
        )
        if point is None:
            return real(*args, **kwargs)
        out = build_without_loading(a, real, *args, **kwargs)  # the state: the snapshot set
        model, optimizer, scheduler = out
        self._restore(point, model, optimizer, scheduler, dist.get_rank())
        a.iteration = point.iteration
        a.consumed_train_samples = int(point.counters["consumed_train"])
        a.consumed_valid_samples = int(point.counters["consumed_valid"])
        a.skipped_train_samples = int(point.counters["skipped_train"])
        a.num_floating_point_operations_so_far = point.counters["flops"]
        self.resumed = point
        log.info(
            "resumed from DeadPool's snapshot set of iteration %d in %s",
            point.iteration,
            salvage.set_dir(point.root, point.iteration),
        )
        if a.save:
            self._save(a, model, optimizer, scheduler)
        return out

    def _restore(
        self, point: SnapshotResume, model: Any, optimizer: Any, scheduler: Any, rank: int
    ) -> None:
        from ..hotswap.worker.weights import sync_params_from_main
        from ..replication.snapshot import RankState, Snapshotter, rng_tensors

        flat = salvage.read_flat(
            salvage.rank_file(point.root, point.iteration, rank),
            owner=rank,
            iteration=point.iteration,
        )
        state = RankState(optimizer, scheduler, model)
        Snapshotter.restore_into(state, flat, owner=rank, iteration=point.iteration)
        self.rng = [t.clone() for t in rng_tensors()]
        sync_params_from_main(model, optimizer)

    @staticmethod
    def _save(a: Any, model: Any, optimizer: Any, scheduler: Any) -> None:
        """Iteration T through Megatron's own `save_checkpoint` (as its format conversion)."""
        from megatron.training import training as tr

        tr.save_checkpoint(
            a.iteration,
            model,
            optimizer,
            scheduler,
            a.num_floating_point_operations_so_far,
            preprocess_common_state_dict_fn=tr.preprocess_common_state_dict,
        )
        log.info("wrote iteration %d as a Megatron checkpoint to %s", a.iteration, a.save)

    @staticmethod
    def load_checkpoint(real: Any, *args: Any, **kwargs: Any) -> Any:
        """Megatron's `load_checkpoint` under `torch.no_grad()`: with fp32 parameters the
        distributed optimizer's main params are views of the (leaf) model parameters, and
        Megatron copies the loaded state into them in place, which autograd refuses outside
        no_grad (what is loaded does not change)."""
        with torch.no_grad():
            return real(*args, **kwargs)

    def train_step(self, real: Any, *args: Any, **kwargs: Any) -> Any:
        """The first step starts from T's RNG states."""
        if self.rng is not None:
            from ..replication.snapshot import set_rng_tensors

            set_rng_tensors(self.rng)
            self.rng = None
        return real(*args, **kwargs)


HOOKED = ("setup_model_and_optimizer", "load_checkpoint", "train_step")


def install(training: ModuleType | None) -> Resumer | None:
    """Hook a `Resumer` into `training`, the module of the `pretrain` being wrapped
    (`megatron.training.training`), under any hooks installed after it; None when that module
    is not Megatron's training loop (it lacks the functions hooked)."""
    if training is None or not all(callable(getattr(training, n, None)) for n in HOOKED):
        return None
    resumer = Resumer()
    for name in HOOKED:
        real = getattr(training, name)
        if getattr(real, "_deadpool_resume", False):
            continue
        hook = functools.wraps(real)(functools.partial(getattr(resumer, name), real))
        hook._deadpool_resume = True  # type: ignore[attr-defined]
        setattr(training, name, hook)
    return resumer
