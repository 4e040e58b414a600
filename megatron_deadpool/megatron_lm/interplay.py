"""Megatron-LM's own resilience features next to `--deadpool`: which combine, which cannot.

Read in Megatron-LM core_v0.19.0 (and core_v0.16.1 where it has them):

- In-process restart (`--inprocess-restart`, nvidia-resiliency-ext's `inprocess.Wrapper`
  around `pretrain`): on a failure it aborts every rank's groups and restarts `pretrain` in all
  surviving processes on a fresh store prefix, with a reserve of ranks. DeadPool also owns
  that moment (its survivors stay inside the training step; spares take the failed slots), and
  Megatron then hands `init_process_group` a store of its own, which DeadPool must replace by
  the coordinator's. They cannot share a job: refused, before the script creates that store.
- The rerun state machine (`--rerun-mode`, default `validate_results`): it re-runs a step in
  place inside `train_step` when a loss looks wrong (replaying that step's batches from its
  own buffer, above DeadPool's recorder) and, when the result is reproducible, saves a
  checkpoint and ends the job on every rank with exit code 16 or 17. Combines: DeadPool
  replicates after the (re-)run step, resets the machine on a rollback, and takes such an
  exit as the end of the job, not as failed ranks (the hooks mark each rank done first).
- `--verify-integrity` (0.18+): SHA-256 manifest of a `torch_dist` checkpoint on save,
  checked on `--load`. Combines: it concerns Megatron's persistent checkpoints only (a
  checkpoint written after a hot swap or by the resume from DeadPool's snapshot set gets its
  manifest); DeadPool's in-memory replicas and snapshot sets carry their own checksums.
- Asynchronous checkpoint saves (`--async-save` with `--use-persistent-ckpt-worker`, which
  Megatron requires for it: without it Megatron turns `--async-save` off, in both tags): a
  background writer writes the files while training goes on; a later step's
  `maybe_finalize_async_save` (inside `train`, in no hooked function) collects every rank's
  result with collectives on the world and raises on every rank when a write failed (a full
  disk; seen on core_v0.19.0 with `--async-strategy mcore`: every rank died, exit code 1, the
  partial folders stayed): the coordinator can only take that for failed ranks. A save still in
  flight during a hot swap also holds the generation's groups that the swap replaces. Refused:
  DeadPool guards Megatron's synchronous save (`save.py`: a failed save is one line and
  training goes on).
- Megatron's fault injector (`--fault-injector-*`, 0.18+, needs nvidia-resiliency-ext): a
  fault it injects (a crash, a hang, an exception) is a failure like any other to DeadPool.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config.deadpool import DeadpoolConfig
from ..errors import ConfigError

REFUSED: dict[tuple[str, ...], str] = {
    ("--inprocess-restart",): (
        "Megatron's in-process restart restarts every rank after a failure and DeadPool "
        "replaces the failed rank by a spare: one job can use only one of them; drop "
        "--inprocess-restart (or --deadpool)"
    ),
    ("--async-save", "--use-persistent-ckpt-worker"): (
        "an asynchronous save's failure (a full disk) is raised on every rank at a later step, "
        "outside any step DeadPool can recover, and a save in flight spans a hot swap; drop "
        "--async-save: DeadPool guards Megatron's synchronous save (a save that fails is one "
        "warning and training goes on)"
    ),
}
"""Megatron-LM flags that cannot be combined with `--deadpool` (each set: all of its flags
given), and why. `--async-save` alone is no asynchronous save: Megatron turns it off without
`--use-persistent-ckpt-worker` (both tags), and the save is the synchronous one."""


def check_megatron_flags(argv: Sequence[str], cfg: DeadpoolConfig) -> None:
    """Refuse (`ConfigError`, naming the flag and the fix) a Megatron-LM flag that cannot be
    combined with `--deadpool`; call before the script's own start-up acts on it."""
    if not cfg.enabled:
        return
    given = {arg.split("=", 1)[0] for arg in argv}
    for flags, why in REFUSED.items():
        if given.issuperset(flags):
            raise ConfigError(f"{' with '.join(flags)}: {why}")
