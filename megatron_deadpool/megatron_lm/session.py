"""DeadPool inside one Megatron-LM process: Megatron's training loop over the hot-swap driver.

The `MegatronSession` is the Megatron-LM job's adapter to `hotswap.worker.driver.Driver` (the
embedded job's is `embedded.job`), driven by Megatron's own training loop through the hooks in
`hooks.py`:

- `begin()` (before `pretrain()`): the driver's start-up (`Driver.start`): connect to the
  coordinator, heartbeat, and - for a spare - wait for a slot. A spare that a plan names for one
  becomes a *newcomer*: it runs Megatron's start-up in a private world
  (`hotswap/worker/private_world.py`) at once, while the survivors agree on the restore
  iteration; once its model and optimizer are built it waits for the agreement
  (`newcomer_plan`), and the rest of the start-up is positioned at the agreed iteration.
  Megatron's own start-up makes the groups (`Driver.init_process_group`, `Driver.groups_made`).
- `train_step(...)` wraps Megatron's `train_step` in the driver's step (`Driver.step`: after
  each optimizer step the driver replicates). When a collective fails, survivors recover
  *inside* the call (`Driver.train`: the driver releases every group, agrees on the restore
  iteration T, joins the next generation, rebinds and restores T), then recompute the steps
  after T (the data iterator replays their batches) and return the step Megatron asked for.
  Megatron's loop never notices: survivors never re-run `pretrain()`. A newcomer takes its
  slot at its first step (`Driver.train`) and restores from the holder of its shard.
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
import logging
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from ..config.deadpool import DeadpoolConfig
from ..devices import active_device
from ..errors import ConfigError, DeadpoolRuntimeError, LostAfterTrainingError
from ..hotswap.protocol.messages import Roster
from ..hotswap.worker.adapter import JobAdapter
from ..hotswap.worker.driver import Driver
from ..hotswap.worker.step import Step
from ..replication.placement import RankOrder
from ..replication.snapshot import RankState
from . import report as mreport
from . import timers
from .refused import refused_problems
from .replay import BatchRecorder, install_recorder, reset_rerun_iterators
from .survivors import NewcomerPlan, SurvivorReport, newcomer_plan, peer_ahead, resume_step
from .trackers import clear_logging_trackers, tracker_roots

log = logging.getLogger("megatron_deadpool.megatron_lm")


def task_from_env() -> int:
    """This process's task index: RANK (torchrun, `deadpool megatron-lm`, the Slurm script)
    or SLURM_PROCID. Tasks at or beyond the coordinator's world size are spares."""
    text = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    if not text.isdigit():
        raise ConfigError(f"RANK: expected a task index (0, 1, ...), got {text!r}")
    return int(text)


class MegatronSession(JobAdapter):
    """DeadPool's state in one Megatron-LM process, and its `JobAdapter` for the driver."""

    owns_start_up = True  # Megatron's `pretrain` makes the groups and objects (`hooks.py`)

    def __init__(self, cfg: DeadpoolConfig, task: int | None, token: str) -> None:
        """`task`: this process's task index (`task_from_env`); None for a process joining a
        running job (`--deadpool-join`: its name comes from the coordinator)."""
        self.cfg = cfg
        self.task = task
        self.token = token
        self._active: Driver | None = None
        self.joining: Roster | None = None  # a newcomer's roster as its start-up began
        self.newcomer: NewcomerPlan | None = None  # once agreed (`newcomer_plan`)
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
        self._joining_log_state: dict[str, Any] | None = None  # a newcomer's, once restored
        self._held: list[tuple[int, str]] | None = None  # checkpoints not saved, not yet said
        self._behind: int | None = None  # the step whose between-step work this rank skips
        self._do_valid: bool | None = None  # Megatron's args.do_valid while that step skips it

    # ------------------------------------------------------------------ start-up
    def begin(self) -> bool:
        """Connect, heartbeat, wait for a slot (`Driver.start`); False when this spare was
        never needed."""
        return self._driver().start(self) is not None

    def slot_taken(self, roster: Roster) -> None:
        """A newcomer (generation > 0) begins Megatron's start-up, for its planned slot."""
        if roster.generation > 0:
            self.joining = roster
            log.info("taking rank %s in generation %d: Megatron start-up in a private world",
                     os.environ["RANK"], roster.generation)  # fmt: skip

    def newcomer_plan(self) -> NewcomerPlan:
        """A newcomer's plan (`NewcomerPlan`): where the survivors stand, once they agreed (its
        start-up waits here for the agreed roster the first time: `Driver.agreed_slot`)."""
        if self.newcomer is None:
            if self.joining is None:
                raise DeadpoolRuntimeError("this process is no newcomer")
            roster = self.driver.agreed_slot(self.joining)
            reports, holder = self._survivor_reports(roster), self.driver.restore_source(roster)
            self.newcomer = newcomer_plan(roster, reports, holder)
            log.info("generation %d agreed: restore iteration %s, joining at step %d",
                     roster.generation, roster.restore_iteration,
                     self.newcomer.target)  # fmt: skip
        return self.newcomer

    def report_early_error(self, exc: BaseException) -> None:
        """The script raised `exc` before `pretrain()` began this session (core_v0.19.0's
        `pretrain_gpt.py` parses and validates Megatron's arguments first): reported as an
        active rank's start-up error (`Driver.report_early_error`)."""
        self._driver().report_early_error(exc)

    def _driver(self) -> Driver:
        """This process's driver (not connected yet)."""
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
        return d

    def _survivor_reports(self, roster: Roster) -> dict[int, SurvivorReport]:
        reports = self.driver.survivor_reports(roster).items()
        return {r: SurvivorReport.from_dict(job) for r, job in reports if "target" in job}

    @property
    def driver(self) -> Driver:
        if self._active is None:
            raise DeadpoolRuntimeError("--deadpool's session has not begun (`begin`)")
        return self._active

    @property
    def joined_late(self) -> bool:
        """A spare that took a slot after the start."""
        return self.driver.joined_late

    # ------------------------------------------------------------------ Megatron's start-up
    def init_process_group(self, real: Any, kwargs: dict[str, Any]) -> None:
        """Generation 0: Megatron's `init_process_group` on the coordinator's store."""
        if kwargs.get("store") is not None:
            raise ConfigError(
                "--deadpool cannot share Megatron's in-process restart store: turn "
                "--inprocess-restart off (DeadPool replaces failed ranks itself)"
            )
        self.driver.init_process_group(real, kwargs)

    def model_parallel_ready(
        self, real: Any, args: tuple, kwargs: dict[str, Any], margs: Any
    ) -> None:
        """After Megatron's `initialize_model_parallel(*args, **kwargs)` (`real`): check the
        set-up and place replicas; later generations repeat the same call."""
        self.mp_call = (real, args, kwargs)
        self._check_megatron_args(margs)
        if getattr(margs, "deadpool_job_token", None):  # Megatron saves its args in checkpoints
            margs.deadpool_job_token = "<redacted>"
        self.driver.groups_made(rank_order(margs), iterations=margs.train_iters or 0)

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
        problems += refused_problems(a)  # options whose state a hot swap cannot carry
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

        if newcomer:  # its slot taken (`Driver.take_slot`): a peer's log sums
            self._log_state_to_load, self._joining_log_state = self._joining_log_state, None
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
    def train_step(self, real: Any, *args: Any) -> Any:
        """Megatron's `train_step(*fixed, iteration)` (`args`: `hooks.STEP_ARGS`' values, then
        the iteration; step n = iteration + 1) with replication and in-place recovery; returns
        step n's result."""
        *fixed, iteration = args
        n = iteration + 1
        self._evaluation_back()
        if self._objs is None:
            self._bind(fixed, n)
        self._note_counters(n)
        pending, self.pending = self.pending, None
        self.target = n  # the step a recovery returns to (reported to the coordinator)
        self._joining(n)
        running = timers.running(timers.megatron())

        def attempt(restored: int | None) -> Any:
            """Step n, after the steps since the restore iteration (a recovery's recompute)."""
            with self.driver.step(n, last=n == self.last_step) as step:
                while self.next_step < n:  # recomputed: never logged
                    self._run(real, fixed, step, self.next_step)
                    clear_logging_trackers()
                return self._run(real, fixed, step, n)

        on_failure = lambda: timers.restore(timers.megatron(), running)
        return self.driver.train(attempt, target=n, pending=pending, on_failure=on_failure)

    @property
    def last_step(self) -> int:
        from megatron.training import get_args

        return get_args().train_iters

    def _bind(self, fixed: list[Any], n: int) -> None:
        _, data_iterator, model, optimizer, scheduler, config, _ = fixed
        self._objs = (model, optimizer, scheduler, config)
        self.data_iterator = data_iterator
        self.recorders = install_recorder(data_iterator)
        self.next_step = n
        self.driver.bind(self, check=True)  # e.g. a group some module made outside parallel_state

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

    def _run(self, real: Any, fixed: list[Any], step: Step, k: int) -> Any:
        from megatron.training import get_args

        for rec in self.recorders:
            rec.begin_step(k)
        get_args().curr_iteration = k - 1
        result = real(*fixed, iteration=k - 1)
        step.done(k)
        self.repl_seconds = step.replication_s
        self.next_step = k + 1
        return result

    def _joining(self, n: int) -> None:
        """First step of a newcomer: the step the survivors resume at, where it takes its slot
        (`Driver.train`); Megatron's log sums then come from a peer at the same position."""
        plan = self.newcomer_plan() if self.joining is not None else None
        self.newcomer, self.joining = None, None
        if plan is None:
            return
        if n != plan.target:
            raise DeadpoolRuntimeError(
                f"newcomer reached step {n}, the survivors resume at step {plan.target}"
            )
        self._joining_log_state = plan.log_state

    # ------------------------------------------------------------------ between steps
    def training_returned(self, iteration: int) -> None:
        """Megatron's `train()` returned after `iteration` (its last step, or an exit
        condition: --exit-interval, --exit-duration-in-mins, a signal)."""
        self._evaluation_back()  # the final evaluation is every rank's
        if self._objs is None:
            return
        failed = self.driver.training_ended(iteration)
        if failed is not None:  # no step to recompute outside the loop
            self.defer(failed, "the last replication round")
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
        self.driver.report_checkpoint_failure(iteration, line)

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
            scalars.update(mreport.status_scalars(d.job_status(), d.generation, d.committed))
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
