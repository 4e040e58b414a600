"""The life of one `deadpool train` process: the embedded job's loop over the hot-swap driver.

Survivors keep their Python objects for the whole run; a spare builds its own when it is
assigned a slot. The training loop is Megatron's (`gpt.train_step`: forward/backward through
`get_forward_backward_func`, the distributed optimizer's step, the LR scheduler); around each
step the driver (`hotswap.worker.driver`: `Driver.step`) fires injected faults and replicates,
and on a peer failure recovers in place (`Driver.train`); its start-up is the driver's
(`Driver.start`: connect, wait or join, a newcomer's private build). What is particular to this
job is here: the `JobAdapter` answers (its objects; its groups), persistent checkpoints,
preemption, and the per-iteration records the launcher renders.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state as ps

from ..config.job import JobConfig
from ..devices import select_device
from ..errors import (
    CheckpointSaveError,
    CoordinatorUnreachableError,
    DeadpoolRuntimeError,
    ExitCode,
    OutOfRedundancyError,
)
from ..hotswap.protocol.messages import IterationRecord
from ..hotswap.worker.adapter import JobAdapter
from ..hotswap.worker.driver import Driver
from ..hotswap.worker.weights import sync_params_from_main
from ..replication import save_dir, snapshot_set
from ..replication.snapshot import RankState, Snapshotter
from . import gpt

log = logging.getLogger("megatron_deadpool.embedded")

Saver = Callable[["EmbeddedJob", int], Any]
"""How a persistent checkpoint of an iteration is written (default: `checkpoint.save`)."""


def save_checkpoint(job: EmbeddedJob, iteration: int) -> Path:
    """The default `Saver`: a Megatron torch_dist checkpoint under `--save`."""
    from . import checkpoint

    assert job.spec.train.save is not None
    return checkpoint.save(job.objs, iteration, job.spec.train.save)


class EmbeddedJob(JobAdapter):
    """One process of the embedded job (an active rank, or a spare waiting for a slot)."""

    def __init__(
        self,
        spec: JobConfig,
        *,
        member: str | None,
        coordinator: str,
        token: str,
        saver: Saver = save_checkpoint,
        on_finish: Callable[[], None] = lambda: None,
    ) -> None:
        """`saver` writes persistent checkpoints; `on_finish` runs once training is over,
        before the final barrier (e.g. to complete asynchronous saves)."""
        self.spec = spec
        self.saver = saver
        self.on_finish = on_finish
        self.driver = Driver(
            spec.deadpool,
            select_device("auto"),
            coordinator=coordinator,
            token=token,
            member=member,
        )
        self._objs: gpt.TrainingObjects | None = None
        self.preempted_at: int | None = None
        self.preempt_unsaved = ""
        """Why the preemption's checkpoint is not saved (a full disk): the one line ("" saved)."""

    @property
    def objs(self) -> gpt.TrainingObjects:
        """What this rank trains with (built once it holds a slot)."""
        if self._objs is None:
            raise DeadpoolRuntimeError("this rank has not built its model and optimizer yet")
        return self._objs

    # ------------------------------------------------------------------ JobAdapter
    def roots(self) -> list[Any]:
        o = self._objs
        return [o.model, o.optimizer, o.scheduler, o.config] if o else []

    def rank_state(self) -> RankState:
        return RankState(self.objs.optimizer, self.objs.scheduler, self.objs.model)

    def model(self) -> list[Any]:
        return self.objs.model

    def init_model_parallel(self) -> None:
        p = self.spec.parallel
        ps.initialize_model_parallel(
            tensor_model_parallel_size=p.tp,
            pipeline_model_parallel_size=p.pp,
            expert_model_parallel_size=p.ep,
            expert_tensor_parallel_size=p.etp,
        )

    def build(self) -> None:
        """The model and optimizer; RNG states come back with a restored snapshot, and the data
        of iteration t is a function of t (`data.iteration_batches`): nothing else to restore."""
        self._objs = gpt.build(self.spec)

    def discard(self) -> None:
        self._objs = None

    def salvage_target(self, iteration: int) -> tuple[str | None, dict[str, Any] | None]:
        return self.spec.train.save, None

    # ------------------------------------------------------------------ life
    def run(self) -> ExitCode:
        """The process's life; its exit code (0 done, 3 out of redundancy, 4 coordinator lost).
        Any other error is reported to the coordinator (`Driver.report_error`: is it the job's
        own?) and ends the process with its traceback."""
        try:
            return self._run()
        except OutOfRedundancyError as exc:
            log.error("%s", exc)
            return ExitCode.OUT_OF_REDUNDANCY
        except (dist.DistStoreError, dist.DistNetworkError) as exc:
            log.error("%s", self.driver.coordinator_lost(str(exc)))
        except CoordinatorUnreachableError as exc:
            log.error("%s", exc)
        except Exception as exc:
            self.driver.report_error(exc)
            raise
        self.driver.without_coordinator()
        return ExitCode.NO_COORDINATOR

    def _run(self) -> ExitCode:
        d, load = self.driver, self.spec.train.load
        # Slurm's time limit and preemption send SIGTERM: finish the iteration, agree on it
        # with every rank, save (with --save), and exit cleanly.
        d.catch_sigterm()
        roster = d.start(self, self.spec.parallel.world_size)
        if roster is None:
            return ExitCode.OK
        start = self._load(load) + 1 if load and roster.generation == 0 else 1
        d.train(lambda restored: self._train_to_end(start if restored is None else restored + 1))
        d.training_over()
        self._finish()
        return ExitCode.OK

    def _train_to_end(self, start: int) -> None:
        """Iterations `start`.. to the end, then the last one's replication committed."""
        self.driver.finish_training(self._train(start))

    def _train(self, start: int) -> int:
        """Iterations `start`.. to the end (or a preemption); returns the last one done."""
        d, spec = self.driver, self.spec
        it = start - 1
        for it in range(start, spec.train.iters + 1):
            with d.step(it, carries_verdict=True) as s:
                step = gpt.train_step(spec, self.objs, it, d.stop_requested(), s.settle)
                s.verdict = step.replicas_ok
                compute_s = time.perf_counter() - s.started
            self._report(it, step, time.perf_counter() - s.started, compute_s, s.committed)
            if self._after_step(it, stop=step.stop):
                break
        return it

    def _after_step(self, it: int, *, stop: bool) -> bool:
        """After iteration `it`: a periodic checkpoint, or (`stop`: every rank voted to stop,
        a preemption) the last one; True when training stops here."""
        train = self.spec.train
        unsaved = ""
        if (train.save_interval and it % train.save_interval == 0) or (stop and train.save):
            unsaved = self._save(it, go_on=not stop)
        if stop:
            self.preempted_at = it
            saved = " (checkpoint saved)" if train.save else ""
            said = f"preempted: stopping after iteration {it}" + (
                f"; {unsaved}" if unsaved else saved
            )
            self.preempt_unsaved = said if unsaved else ""
            log.warning("%s", said)
        return stop

    def _report(
        self,
        it: int,
        step: gpt.StepResult,
        iter_s: float,
        compute_s: float,
        committed: int | None,
    ) -> None:
        d = self.driver
        log.info(
            "iteration %d/%d | loss %.6f | %.3f s/it | committed %s",
            it,
            self.spec.train.iters,
            step.loss,
            iter_s,
            committed,
        )
        if d.rank != 0:
            return
        repl = d.replicator
        d.report_iteration(
            IterationRecord(
                iteration=it,
                time=time.time(),
                loss=step.loss,
                grad_norm=step.grad_norm,
                lr=self.objs.optimizer.param_groups[0]["lr"],
                iter_time_s=iter_s,
                replication_s=iter_s - compute_s,
                generation=d.generation,
                committed_iteration=committed,
                replica_bytes_sent=repl.bytes_per_round if repl else 0,
                replication_parts_s=dict(repl.timings) if repl else {},
            )
        )

    def _finish(self) -> None:
        """Training is complete: the final reports, then leave the groups together. A peer
        lost now costs no recovery: what it held survives in its holders' memory."""
        d, at = self.driver, self.preempted_at
        saved = bool(self.spec.train.save) and not self.preempt_unsaved
        d.report_end(None if at is None else (at, saved, self.preempt_unsaved))
        self.on_finish()
        try:
            dist.barrier()
        except Exception as exc:
            if not d.is_peer_failure(exc):
                raise
            log.warning("%s", d.end_failure(exc, "the final barrier"))
        else:
            dist.destroy_process_group()
        digest = d.finish()
        log.info("done: parameter digest %s", (digest or "")[:16])

    # ------------------------------------------------------------------ persistent checkpoints
    def _save(self, iteration: int, *, go_on: bool) -> str:
        """Save `iteration`'s checkpoint: "" when saved, else the line saying what was not
        (every rank alike: `CheckpointSaveError`). A periodic checkpoint that cannot be written
        (`go_on`: a full disk, a read-only folder) does not stop training, which DeadPool
        protects in memory: each failed one is a warning (rank 0 also tells the launcher), and
        the next interval tries again. Stopping (preemption), the line goes with the stop."""
        t0 = time.perf_counter()
        try:
            path = self.saver(self, iteration)
        except CheckpointSaveError as exc:
            if not go_on:
                return str(exc)
            kept = (
                "its state is protected in memory"
                if self.driver.cfg.enabled
                else ("nothing protects its state until a checkpoint is saved: DeadPool is off")
            )
            line = f"{exc}; training goes on ({kept})"
            log.warning("%s", line)
            self.driver.report_checkpoint_failure(iteration, line)
            return line
        log.info("saved checkpoint %s in %.2fs", path, time.perf_counter() - t0)
        return ""

    def _load(self, root: str) -> int:
        from . import checkpoint

        rank = self.driver.roster.rank_of(self.driver.member)
        assert rank is not None
        resume = save_dir.choose_resume(root, rank=rank, agree=save_dir.world_agrees)
        fallback = resume.fallback(root)
        if fallback:
            log.warning("%s", fallback)
        if resume.kind is None:
            log.info("no checkpoint in %s: starting from iteration 1", root)
            return 0
        if resume.kind == "snapshots":  # the set survivors saved when memory could not recover
            t = resume.iteration
            path = snapshot_set.rank_file(root, t, rank)
            flat = snapshot_set.read_flat(path, owner=rank, iteration=t)
            Snapshotter.restore_into(self.rank_state(), flat, owner=rank, iteration=t)
            sync_params_from_main(self.objs.model, self.objs.optimizer)
            log.info("resumed from DeadPool snapshot set of iteration %d", t)
            return t
        t0 = time.perf_counter()
        iteration = checkpoint.load(self.objs, root)
        self.driver.report_load_time(time.perf_counter() - t0)
        log.info("loaded checkpoint of iteration %d in %.2fs", iteration, time.perf_counter() - t0)
        return iteration
