"""DeadPool inside one Megatron-LM process: Megatron's training loop over the hot-swap driver.

The `MegatronSession` is the Megatron-LM job's adapter to `hotswap.worker.driver.Driver` (the
embedded job's is `embedded.job`), driven by Megatron's own training loop through the hooks in
`hooks.py`:

- `begin()` (before `pretrain()`): connect to the coordinator, heartbeat, and - for a spare -
  wait for a slot. A spare that gets one becomes a *newcomer*: it runs Megatron's start-up in a
  private world (`hotswap/worker/private_world.py`) positioned at the agreed iteration.
- `train_step(...)` wraps Megatron's `train_step`: after each optimizer step the driver
  replicates. When a collective fails, survivors recover *inside* the call
  (`Driver.recovering`: the driver releases every group, agrees on the restore iteration T,
  joins the next generation, rebinds and restores T), then recompute the steps after T (the
  data iterator replays their batches) and return the step Megatron asked for. Megatron's loop
  never notices: survivors never re-run `pretrain()`. A newcomer takes its slot at its first
  step (`Driver.take_slot`) and restores from the holder of its shard.
- Failures seen between steps (in `training_log`, evaluation) are deferred to the next step,
  so that every survivor resumes at the same step; survivors left one step apart by a step's
  partly completed last collective go on at the later one (`survivors.py`).

Out of redundancy (no spare left, or a shard with no surviving copy) the survivors write
DeadPool's snapshot set of one common iteration under Megatron's `--save` (with Megatron's
sample and FLOP counters of that iteration in its manifest) and exit with code 3. Megatron's
own `save_checkpoint` cannot run then: it is collective over the full world (its distributed-
optimizer state is written by every data-parallel rank, its metadata gathered across all
ranks), and the dead ranks are gone. A complete set becomes a Megatron checkpoint at the next
launch of the same command with `--load` (`resume.py`), where a full world exists again.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..config.deadpool import DeadpoolConfig
from ..config.faults import check_faults, parse_fault
from ..devices import active_device
from ..errors import ConfigError, DeadpoolRuntimeError, LostAfterTrainingError
from ..hotswap.protocol.messages import Roster
from ..hotswap.worker.driver import Driver
from ..replication.placement import RankOrder
from ..replication.snapshot import RankState
from . import report as mreport
from . import timers
from .replay import BatchRecorder, install_recorder, reset_rerun_iterators
from .startup_bound import startup_bound_problems
from .survivors import SurvivorReport, peer_ahead, resume_step
from .trackers import clear_logging_trackers, tracker_roots
from .unsnapshotted import unsnapshotted_problems

log = logging.getLogger("megatron_deadpool.megatron_lm")


def task_from_env() -> int:
    """This process's task index: RANK (torchrun, `deadpool megatron-lm`, the Slurm script)
    or SLURM_PROCID. Tasks at or beyond the coordinator's world size are spares."""
    text = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    if not text.isdigit():
        raise ConfigError(f"RANK: expected a task index (0, 1, ...), got {text!r}")
    return int(text)


@dataclass
class NewcomerPlan:
    """What a spare taking a slot must know before Megatron's start-up."""

    roster: Roster
    target: int  # the step every survivor is about to return to Megatron
    counters: dict[str, dict[str, float]]  # step -> Megatron's sample/FLOP counters after it
    flags: tuple[bool, bool, bool]  # Megatron's args.do_train, do_valid, do_test
    log_state: dict[str, Any] | None = None  # a same-position survivor's training_log sums


class MegatronSession:
    """DeadPool's state in one Megatron-LM process, and its `JobAdapter` for the driver."""

    def __init__(self, cfg: DeadpoolConfig, task: int | None, token: str) -> None:
        """`task`: this process's task index (`task_from_env`); None for a process joining a
        running job (`--deadpool-join`: its name comes from the coordinator)."""
        self.cfg = cfg
        self.task = task
        self.token = token
        self._active: Driver | None = None
        self.newcomer: NewcomerPlan | None = None
        self.joined_late = False  # a spare that took a slot after the start
        self.mp_call: tuple[Any, tuple, dict] | None = None
        self._objs: tuple[Any, Any, Any, Any] | None = None
        self.extra_roots: list[Any] = []
        self.data_iterator: Any = None
        self.recorders: list[BatchRecorder] = []
        self.next_step = 1
        self.target: int | None = None  # the step a recovery in progress returns to
        self.pending: BaseException | None = None
        self.counters: dict[int, dict[str, float]] = {}
        self.repl_seconds = 0.0
        self.reported = 0  # recoveries already printed
        self.total_loss_dict: dict[str, Any] | None = None  # Megatron's training_log sums
        self._log_state_to_load: dict[str, Any] | None = None
        self._held: list[tuple[int, str]] | None = None  # checkpoints not saved, not yet said
        self._behind: int | None = None  # the step whose between-step work this rank skips
        self._do_valid: bool | None = None  # Megatron's args.do_valid while that step skips it

    # ------------------------------------------------------------------ start-up
    def begin(self) -> bool:
        """Connect, heartbeat, wait for a slot; False when this spare was never needed."""
        d = self._connect()
        roster = d.wait_for_slot()
        if roster is None:
            return False
        assert d.rank is not None
        # What Megatron reads: the rank this process fills and the active world (not the tasks).
        os.environ["RANK"] = str(d.rank)
        os.environ["WORLD_SIZE"] = str(roster.world_size)
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
        if roster.generation > 0:
            self.newcomer = self._newcomer_plan(roster)
            self.joined_late = True
            d.build_privately(record=self._record_pg_kwargs)
            log.info(
                "taking rank %d in generation %d: Megatron start-up in a private world, "
                "joining at step %d",
                d.rank,
                roster.generation,
                self.newcomer.target,
            )
        return True

    def report_early_error(self, exc: BaseException) -> None:
        """The script raised `exc` before `pretrain()` began this session (core_v0.19.0's
        `pretrain_gpt.py` parses and validates Megatron's arguments first): an active rank
        connects, takes its slot of generation 0 and reports `exc` as its start-up error, so
        that the coordinator ends the job instead of handing the slot to a spare
        (`hotswap/coordinator/job_error.py`); a spare reports nothing (it held no slot)."""
        d = self._connect()
        if d.member.startswith("a"):
            d.wait_for_slot()  # generation 0's roster names it: at once
            d.report_error(exc)
        d.stop_heartbeat()

    def _connect(self) -> Driver:
        """This process's driver, connected to the coordinator and beating."""
        coordinator = self.cfg.coordinator or os.environ.get("DEADPOOL_COORDINATOR")
        if not coordinator:
            raise ConfigError(
                "deadpool-coordinator: --deadpool needs the coordinator's HOST:PORT; use "
                "`deadpool megatron-lm` (which hosts it) or start `deadpool coordinator`"
            )
        from . import workers

        workers.install()
        self._active = d = Driver(
            self.cfg, active_device(), coordinator=coordinator, token=self.token, task=self.task
        )
        d.connect()
        return d

    def _newcomer_plan(self, roster: Roster) -> NewcomerPlan:
        reports = self._survivor_reports(roster)
        target = resume_step(reports)
        rank = self.driver.rank
        assert rank is not None
        holder = self.driver.membership.sources(roster.generation).holders.get(rank)
        ahead = peer_ahead(reports, target, () if holder is None else (holder,))
        return NewcomerPlan(
            roster=roster,
            target=target,
            counters=ahead.counters,
            flags=ahead.flags,
            log_state=ahead.log_state,
        )

    def _survivor_reports(self, roster: Roster) -> dict[int, SurvivorReport]:
        membership = self.driver.membership
        plan = membership.plan(roster.generation)
        needy = set(plan.needy) if plan else set()
        out = {}
        for r in range(roster.world_size):
            if r not in needy:
                report = membership.holdings(roster.generation, r)
                if report is not None and "target" in report.job:
                    out[r] = SurvivorReport.from_dict(report.job)
        return out

    @property
    def driver(self) -> Driver:
        if self._active is None:
            raise DeadpoolRuntimeError("--deadpool's session has not begun (`begin`)")
        return self._active

    # ------------------------------------------------------------------ Megatron's start-up
    def init_process_group(self, real: Any, kwargs: dict[str, Any]) -> None:
        """Generation 0: Megatron's `init_process_group` on the coordinator's store."""
        if kwargs.get("store") is not None:
            raise ConfigError(
                "--deadpool cannot share Megatron's in-process restart store: turn "
                "--inprocess-restart off (DeadPool replaces failed ranks itself)"
            )
        self._record_pg_kwargs(kwargs)
        real(**{**kwargs, **self.driver.process_group_args()})

    def _record_pg_kwargs(self, kwargs: dict[str, Any]) -> None:
        """Megatron's backend and timeout, used for every later generation's default group."""
        self.driver.pg_backend = kwargs.get("backend") or "gloo"
        self.driver.groups.choose(str(self.driver.pg_backend))  # repaired in place, or rebuilt
        self.driver.pg_timeout = kwargs.get("timeout") or datetime.timedelta(minutes=10)

    def model_parallel_ready(
        self, real: Any, args: tuple, kwargs: dict[str, Any], margs: Any
    ) -> None:
        """After Megatron's `initialize_model_parallel(*args, **kwargs)` (`real`): check the
        set-up and place replicas; later generations repeat the same call."""
        self.mp_call = (real, args, kwargs)
        self._check_megatron_args(margs)
        if getattr(margs, "deadpool_job_token", None):  # Megatron saves its args in checkpoints
            margs.deadpool_job_token = "<redacted>"
        d = self.driver
        d.device = active_device()
        layout = d.place_replicas(order=rank_order(margs))
        check_faults(
            [parse_fault(spec) for spec in self.cfg.fail],
            layout.world_size,
            layout.ranks_per_node,
            margs.train_iters or 0,
        )
        if not d.building_privately():  # a newcomer's groups are made when it joins
            d.new_replication_group()
            d.plan_watch.joined(d.generation)  # generation 0's groups: Megatron made them
            d.groups.created(d.generation)

    def init_model_parallel(self) -> None:
        if self.mp_call is None:
            raise DeadpoolRuntimeError("Megatron has not created its groups yet")
        real, args, kwargs = self.mp_call
        real(*args, **kwargs)

    def _check_megatron_args(self, a: Any) -> None:
        problems = []
        peers = a.data_parallel_size * getattr(a, "context_parallel_size", 1)
        if not getattr(a, "use_distributed_optimizer", False) and peers < 2:
            problems.append(
                "without --use-distributed-optimizer every data-parallel peer holds the same "
                "optimizer state, but data-parallel size is 1: no peer can stand in for a "
                "failed rank; use data-parallel size >= 2 or run without --deadpool"
            )
        problems += unsnapshotted_problems(a)  # state a step changes outside the snapshot
        if getattr(a, "rampup_batch_size", None):
            problems.append("--rampup-batch-size: replaying steps needs a constant batch size")
        problems += startup_bound_problems(a)  # state inside the start-up communicators
        timeout_s = getattr(a, "distributed_timeout_minutes", 10) * 60
        if self.cfg.heartbeat_timeout >= timeout_s:
            problems.append(
                f"--deadpool-heartbeat-timeout ({self.cfg.heartbeat_timeout:.0f}s) must stay "
                f"below --distributed-timeout-minutes ({timeout_s:.0f}s): a hung peer must be "
                "named by the heartbeat monitor before collectives time out"
            )
        if problems:
            raise ConfigError("--deadpool cannot protect this run: " + "; ".join(problems))

    @property
    def objs(self) -> tuple[Any, Any, Any, Any]:
        """Megatron's model chunks, optimizer, scheduler and config (from its first step on)."""
        if self._objs is None:
            raise DeadpoolRuntimeError("Megatron has not run its first training step yet")
        return self._objs

    # ------------------------------------------------------------------ JobAdapter
    def roots(self) -> list[Any]:
        """Everything that holds process-group handles DeadPool must rebind: model chunks, DDP,
        optimizer, scheduler, config, Megatron's checkpointing context (its save strategy
        keeps the data-parallel group), the MoE logging tracker (`trackers.tracker_roots`)."""
        return [*(self._objs or ()), *self.extra_roots, *tracker_roots()]

    def rank_state(self) -> RankState:
        model, optimizer, scheduler, _ = self.objs
        return RankState(optimizer, scheduler, model)

    def model(self) -> list[Any]:
        return self.objs[0]

    def after_rejoin(self, roster: Roster) -> None:
        """A survivor one step behind the others (`survivors.py`) runs its step and skips the
        between-step work after it, with the `training_log` sums of a survivor ahead."""
        reports = self._survivor_reports(roster)
        step = resume_step(reports)
        self._behind = None
        if self.target is not None and self.target < step:
            d = self.driver
            peers = d.placement.holders[d.rank] if d.placement and d.rank is not None else ()
            self._behind = self.target
            self._log_state_to_load = peer_ahead(reports, step, peers).log_state
            log.info(
                "the other survivors resume at step %d: this rank runs step %d and skips the "
                "work between the two steps (logging, evaluation, checkpoint), which they met "
                "the failure in",
                step,
                self.target,
            )

    def skips_between_steps(self, iteration: int) -> bool:
        """Whether Megatron's work after step `iteration` (logging, evaluation, callbacks,
        checkpoint and exit check) is skipped: this rank resumed one step behind the others."""
        return self._behind == iteration

    def skip_evaluation(self) -> None:
        """`training_log` of the step behind was skipped: so is the evaluation Megatron's loop
        decides right after it from `args.do_valid` (with barriers of its own, outside the
        hooked `evaluate_and_print_results`), until the next step puts the flag back."""
        from megatron.training import get_args

        a = get_args()
        if self._do_valid is None:
            self._do_valid, a.do_valid = a.do_valid, False

    def _evaluation_back(self) -> None:
        """The next step, or the end of `train()`: Megatron's `args.do_valid` as it was."""
        from megatron.training import get_args

        if self._do_valid is not None:
            get_args().do_valid, self._do_valid = self._do_valid, None

    def after_restore(self, iteration: int, *, newcomer: bool) -> None:
        """Megatron's rerun state machine and data iterators back at `iteration`; the
        logging trackers emptied (`trackers.py`)."""
        from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

        rsm = get_rerun_state_machine()
        rsm.state = RerunState.NOT_RUNNING_YET
        rsm.current_iteration = iteration
        clear_logging_trackers()
        reset_rerun_iterators(self.data_iterator)
        if not newcomer:
            for rec in self.recorders:
                rec.rewind_to(iteration)
        self.next_step = iteration + 1

    def recovery_report(self) -> dict[str, Any]:
        """The step to return to, Megatron's counters, what a newcomer's start-up needs."""
        from megatron.training import get_args

        a = get_args()
        do_train, do_valid, do_test = (
            bool(getattr(a, name, False)) for name in ("do_train", "do_valid", "do_test")
        )
        return SurvivorReport(
            target=self.target,
            counters={str(k): v for k, v in self.counters.items()},
            flags=(do_train, do_valid, do_test),
            log_state=mreport.dump_log_state(self.total_loss_dict),
        ).to_dict()

    def salvage_target(self, iteration: int) -> tuple[str | None, dict[str, Any] | None]:
        from megatron.training import get_args

        if iteration not in self.counters and iteration == self.driver.completed:
            self._note_counters(iteration + 1)  # Megatron's counters after the last step
        counters = self.counters.get(iteration)
        return get_args().save, ({"megatron": counters} if counters is not None else None)

    # ------------------------------------------------------------------ the training step
    def train_step(
        self,
        real: Any,
        fwd: Any,
        data_iterator: Any,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        config: Any,
        fb_func: Any,
        iteration: int,
    ) -> Any:
        """Megatron's `train_step(iteration)` (step n = iteration + 1) with replication and
        in-place recovery; returns step n's result."""
        n = iteration + 1
        d = self.driver
        self._evaluation_back()
        if self._objs is None:
            self._bind(model, optimizer, scheduler, config, data_iterator, n)
        self._note_counters(n)
        pending, self.pending = self.pending, None
        self.target = n  # the step a recovery returns to (reported to the coordinator)
        running = timers.running(timers.megatron())
        call = (real, fwd, data_iterator, model, optimizer, scheduler, config, fb_func)

        def attempt(restored: int | None) -> Any:
            """Step n, after the steps since the restore iteration (a recovery's recompute)."""
            if self.newcomer is not None:
                self._take_slot(n)
            d.begin_step(n)
            while self.next_step < n:  # recomputed: never logged
                self._run(call, self.next_step)
                clear_logging_trackers()
            result = self._run(call, n)
            if n == self.last_step:  # a failure in here is recovered like any other
                d.finish_training(n)
                if d.rank == 0 and d.replicator is not None:  # its round committed: say so
                    d.membership.set_progress(
                        n, d.generation, d.committed, d.replicator.bytes_per_round
                    )
            return result

        return d.recovering(
            attempt,
            target=n,
            pending=pending,
            on_failure=lambda: timers.restore(timers.megatron(), running),
        )

    @property
    def last_step(self) -> int:
        from megatron.training import get_args

        return get_args().train_iters

    def _bind(self, model, optimizer, scheduler, config, data_iterator, n: int) -> None:
        self._objs = (model, optimizer, scheduler, config)
        self.data_iterator = data_iterator
        self.recorders = install_recorder(data_iterator)
        self.next_step = n
        self.driver.bind(self)
        self.driver.check_rebindable()  # e.g. a group some module made outside parallel_state

    def _note_counters(self, n: int) -> None:
        """Megatron's counters after step n-1 (train() updates them after each step)."""
        from megatron.training import get_args
        from megatron.training.training import num_floating_point_operations

        a = get_args()
        prev = self.counters.get(n - 2)
        if prev is None:
            flops = float(a.num_floating_point_operations_so_far)
        else:
            batch = a.micro_batch_size * a.data_parallel_size * _num_microbatches()
            flops = prev["flops"] + num_floating_point_operations(a, batch)
        self.counters[n - 1] = {
            "consumed_train": a.consumed_train_samples,
            "consumed_valid": a.consumed_valid_samples,
            "skipped_train": a.skipped_train_samples,
            "flops": flops,
        }
        for old in [k for k in self.counters if k < n - 4]:
            del self.counters[old]

    def _run(self, call: tuple, k: int) -> Any:
        from megatron.training import get_args

        real, fwd, data_iterator, model, optimizer, scheduler, config, fb_func = call
        for rec in self.recorders:
            rec.begin_step(k)
        get_args().curr_iteration = k - 1
        result = real(
            fwd, data_iterator, model, optimizer, scheduler, config, fb_func, iteration=k - 1
        )
        t0 = time.perf_counter()
        self.driver.replicate(k)
        self.repl_seconds = time.perf_counter() - t0
        self.next_step = k + 1
        self.driver.step_completed(k)
        return result

    def _take_slot(self, n: int) -> None:
        """First step of a newcomer: take its slot (`Driver.take_slot`) at the step the
        survivors resume at, and Megatron's log sums from a peer at the same position."""
        plan = self.newcomer
        assert plan is not None
        self.newcomer = None  # a failure from here on is recovered like a survivor's
        if n != plan.target:
            raise DeadpoolRuntimeError(
                f"newcomer reached step {n}, the survivors resume at step {plan.target}"
            )
        self.driver.take_slot(target=n)
        self._log_state_to_load = plan.log_state

    # ------------------------------------------------------------------ between steps
    def training_returned(self, iteration: int) -> None:
        """Megatron's `train()` returned after `iteration` (its last step, or an exit
        condition: --exit-interval, --exit-duration-in-mins, a signal)."""
        self._evaluation_back()  # the final evaluation is every rank's
        if self._objs is None:
            return
        if self.driver.completed is None:
            try:
                self.driver.finish_training(iteration)
            except Exception as exc:
                if not self.driver.is_peer_failure(exc):
                    raise
                self.driver.completed = iteration  # no step to recompute outside the loop
                self.defer(exc, "the last replication round")
        self.driver.training_over()

    def is_peer_failure(self, exc: BaseException) -> bool:
        """Whether `exc` is a peer's failure to recover from (`Driver.is_peer_failure`)."""
        return self.driver.is_peer_failure(exc)

    def defer(self, exc: BaseException, where: str) -> None:
        """A collective failed outside a training step: recover at the next step - or, once
        training completed, save what survives and end (`LostAfterTrainingError`)."""
        if self.driver.completed is not None:
            message = self.driver.end_failure(exc, where)
            self.driver.finish()
            raise LostAfterTrainingError(message)
        log.warning(
            "collective failed in %s (%s): recovering at the next step",
            where,
            str(exc).splitlines()[0][:160],
        )
        traceback.clear_frames(exc.__traceback__)
        self.pending = exc

    def checkpoint_not_saved(self, iteration: int, line: str) -> None:
        """Megatron's checkpoint of `iteration` was not written (`save.py`; every rank alike,
        `line` says what was and was not saved): a warning in every rank's log, and rank 0 tells
        the launcher, with what happens next: training goes on (DeadPool protects its state in
        memory), unless it is complete or Megatron stops (a save of its exit check: held until
        the check decided, `exit_check`)."""
        if self._held is not None:
            self._held.append((iteration, line))
            return
        d = self.driver
        if d.completed is not None:
            line += (
                f"; training is complete: its final state (iteration {d.completed}) is not saved"
            )
        else:
            line += "; training goes on (its state is protected in memory)"
        self._say_not_saved(iteration, line)

    @contextlib.contextmanager
    def exit_check(self) -> Iterator[Callable[[bool], None]]:
        """Around Megatron's `checkpoint_and_decide_exit`: a checkpoint it fails to save is
        said once it decided (call the yielded function with its answer: True, Megatron stops)."""
        self._held = []
        stops = False

        def decided(stop: bool) -> None:
            nonlocal stops
            stops = bool(stop)

        try:
            yield decided
        finally:
            held, self._held = self._held, None
            for iteration, line in held:
                if stops:
                    self._say_not_saved(iteration, f"{line}; Megatron stops after this iteration")
                else:
                    self.checkpoint_not_saved(iteration, line)

    def _say_not_saved(self, iteration: int, line: str) -> None:
        log.warning("%s", line)
        if self.driver.rank == 0:
            self.driver.membership.publish_checkpoint_failure(iteration, line)

    def before_log(self, total_loss_dict: dict[str, Any]) -> None:
        """Before Megatron's `training_log`: keep a handle on its running sums (a train()
        local); a newcomer first takes over its predecessor's, which a data-parallel peer at
        the same position holds identically, so its log lines read as the dead rank's would."""
        self.total_loss_dict = total_loss_dict
        if self._log_state_to_load is not None:
            mreport.load_log_state(total_loss_dict, self._log_state_to_load)
            self._log_state_to_load = None

    def log_failed(self, iteration: int, first: bool) -> None:
        """Megatron's `training_log` of `iteration` met a peer failure (deferred): its running
        sums as a completed call leaves them. Its world barrier fails after the step was added
        and before a logged interval's sums are reset; left so, the next interval's averages
        would count this step too (and every newcomer would copy them)."""
        from megatron.training import get_args

        sums = self.total_loss_dict
        # Megatron keeps a process's first iteration's sums.
        if sums is not None and iteration % get_args().log_interval == 0 and not first:
            mreport.reset_log_sums(sums)

    def after_log(self, iteration: int) -> None:
        """After Megatron's `training_log`: DeadPool's line and scalars (last rank)."""
        from megatron.training import get_args

        a, d = get_args(), self.driver
        nbytes = d.replicator.bytes_per_round if d.replicator else 0
        if iteration % a.log_interval == 0:
            mreport.print_last(
                *mreport.replication_fields(
                    iteration, a.train_iters, d.committed, nbytes, self.repl_seconds
                )
            )
        for record in d.recoveries[self.reported :]:
            mreport.print_last(*mreport.recovery_fields(record))
        self.reported = len(d.recoveries)
        if mreport.is_last_rank() and iteration % a.tensorboard_log_interval == 0:
            scalars = {
                "committed-iteration": float(d.committed if d.committed is not None else -1),
                "replica-bytes-per-iteration": float(nbytes),
                "replication-time-ms": self.repl_seconds * 1000,
                "generation": float(d.generation),
                "recoveries": float(len(d.recoveries)),
            }
            if d.recoveries:
                scalars["last-recovery-s"] = d.recoveries[-1].total_s
                for phase, seconds in d.recoveries[-1].phases_s.items():
                    scalars[f"last-recovery-{phase}-s"] = seconds
            status = d.membership.job_status()
            scalars.update(mreport.status_scalars(status, d.generation, d.committed))
            mreport.write_scalars(iteration, scalars)

    def finish(self) -> None:
        """After `pretrain()` returned: drain the last round, mark this process done."""
        self.driver.finish()


# ---------------------------------------------------------------------- helpers
def rank_order(margs: Any) -> RankOrder:
    """The rank order Megatron-LM's `initialize_megatron` builds its groups in: tp-pp-dp with
    `--use-tp-pp-dp-mapping` (order 'tp-cp-ep-pp-dp' in both supported tags), else the default
    tp-dp-pp ('tp-cp-ep-dp-pp')."""
    return (
        RankOrder.TP_PP_DP if getattr(margs, "use_tp_pp_dp_mapping", False) else RankOrder.TP_DP_PP
    )


def _num_microbatches() -> int:
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    return get_num_microbatches()
