"""Megatron-LM's own `save_checkpoint` on a full disk or an unwritable `--save` folder.

Unguarded, a save that cannot be written kills every rank: the rank whose write failed raises
alone (rank 0 writes `common.pt` in core_v0.16.1, `metadata.json` and the marker
`latest_checkpointed_iteration.txt` in both supported tags, each alone), the others wait in
the next collective until they time out, a partial `iter_*` folder stays, and the launcher
takes the dead ranks for failures ("out of redundancy"). Guarded (`wrap_save_checkpoint`, hooked
into `megatron.training.training`, which calls it for `--save-interval`, the exit conditions,
the final save and the resume from a snapshot set; `--deadpool` only), every rank learns of a
failed save together, as the embedded job's save does (`replication/failed_save.py`):

1. Before Megatron's save: the iteration's folder is made and rank 0 probes it with a write of
   `failed_save.PROBE_BYTES` (`failed_save.prepare`, agreed): a disk that is already full or a
   read-only folder fails here, and Megatron's save does not run.
2. During it, every barrier of the world (`torch.distributed.barrier()`, which Megatron calls
   after the sharded write, after `metadata.json` and after the marker) is an agreement
   (`failed_save.save_agreeing`): a rank whose write failed alone meets the others there with
   its error, and all of them leave Megatron's save at that barrier together. A write rank 0
   makes alone with no barrier after it (core_v0.16.1's `common.pt`: the sharded write's
   collectives follow) is kept from raising; its error goes to the next agreement. A failed
   sharded write is reported on every rank by torch itself (`CheckpointException`).
3. After a failure: rank 0 puts the marker back as it was (Megatron rewrites it in place, so a
   full disk can leave it empty), removes the partial folder, and every rank logs the same one
   line (what was and was not saved, what `--load` resumes from); rank 0 hands it to the
   launcher (`checkpoints_not_saved` in summary.json). Training goes on: DeadPool protects its
   state in memory, and the next interval tries again.

Only Megatron's default format, `torch_dist`, is guarded (`GUARDED_FORMAT`); other formats,
`release` checkpoints and non-persistent local ones are saved as Megatron saves them.
An asynchronous save (`--async-save` with `--use-persistent-ckpt-worker`) is refused with
`--deadpool` (`interplay.py` says why); `--async-save` alone Megatron turns off itself.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..durable import write_durably
from ..errors import CheckpointError
from ..replication import write_results
from ..replication.failed_save import attempt, not_saved, prepare, save_agreeing
from ..replication.save_dir import TRACKER, iteration_dir, latest_iteration

log = logging.getLogger("megatron_deadpool.megatron_lm")

GUARDED_FORMAT = "torch_dist"
"""The `--ckpt-format` whose saves are guarded (Megatron-LM's default)."""


def wrap_save_checkpoint(real: Any, session: Any) -> Any:
    """Megatron's `save_checkpoint` (`real`), guarded as the module docstring says; `session`
    (`MegatronSession`) learns of each checkpoint not saved."""
    sig = inspect.signature(real)

    @functools.wraps(real)
    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        a = get_args()
        bound = sig.bind(*args, **kwargs)
        root = _save_dir(a, bound.arguments)
        if root is None or not dist.is_initialized():
            return real(*args, **kwargs)
        iteration = int(bound.arguments["iteration"])
        path = iteration_dir(root, iteration)
        kept, marker = _kept(root), _marker_bytes(root)
        error = prepare(path)
        if error is None:
            write_results.keep_in_process()  # no helper process (the save is synchronous)
            error = save_agreeing(functools.partial(real, *args, **kwargs), path)
        if error is None:
            return None
        if dist.get_rank() == 0:
            _put_back_marker(root, marker, last_try=False)
        line = not_saved(root, iteration, kept, error)
        if dist.get_rank() == 0:  # again, with the partial folder's room free
            _put_back_marker(root, marker, last_try=True)
        session.checkpoint_not_saved(iteration, line)
        return None

    return save_checkpoint


def _save_dir(a: Any, arguments: dict[str, Any]) -> str | None:
    """The folder Megatron saves this call's checkpoint in, or None when the call is not
    guarded (another format, a release or non-persistent local checkpoint, `--async-save`)."""
    if a.ckpt_format != GUARDED_FORMAT or getattr(a, "async_save", False):
        return None
    if arguments.get("release") or not a.save:
        return None
    if not arguments.get("non_persistent_ckpt"):
        return str(a.save)
    if getattr(a, "non_persistent_ckpt_type", None) != "global":
        return None
    if a.non_persistent_global_ckpt_dir:
        return str(a.non_persistent_global_ckpt_dir)
    from megatron.training import checkpointing

    return os.path.join(a.save, checkpointing._NON_PERSISTENT_CKPT_SUBDIR)


def _kept(root: str) -> int | None:
    """The iteration the marker names before the save (None: none, or not a number)."""
    try:
        return latest_iteration(root)
    except (CheckpointError, OSError):
        return None


def _marker_bytes(root: str) -> bytes | None:
    try:
        return (Path(root) / TRACKER).read_bytes()
    except OSError:
        return None


def _put_back_marker(root: str, before: bytes | None, *, last_try: bool) -> None:
    """Rank 0 after a failed save: the marker as it was before it (Megatron rewrites it in
    place: a write that failed can leave it empty). Where even that does not fit, no marker
    until the `last_try`, after the partial folder was removed: never one naming a checkpoint
    that is not complete."""
    if _marker_bytes(root) == before:
        return
    marker = Path(root) / TRACKER
    error = attempt(
        (lambda: marker.unlink(missing_ok=True))
        if before is None
        else (lambda: write_durably(marker, before))
    )
    if error is None:
        return
    if last_try:
        log.warning("the marker %s could not be put back as it was (%s)", marker, error)
    else:
        attempt(lambda: marker.unlink(missing_ok=True))
