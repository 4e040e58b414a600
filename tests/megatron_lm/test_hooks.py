"""The hooks into `megatron.training.training` (hooks.py), on Megatron's signatures."""

from __future__ import annotations

import pytest

from megatron_deadpool.errors import DeadpoolRuntimeError


class _FakeSession:
    def __init__(self, joined_late: bool = False) -> None:
        self.joined_late = joined_late
        self.deferred: list[str] = []
        self.logged: list[int] = []
        self.extra_roots: list[object] = []
        self.behind: int | None = None  # the step whose between-step work is skipped

    def skips_between_steps(self, iteration: int) -> bool:
        return self.behind == iteration

    def skip_evaluation(self) -> None:
        self.evaluation_skipped = True

    def defer(self, exc: BaseException, where: str) -> None:
        self.deferred.append(where)

    def log_failed(self, iteration: int, first: bool) -> None:
        self.failed_log = (iteration, first)

    def is_peer_failure(self, exc: BaseException) -> bool:  # as the driver's, before any abort
        from megatron_deadpool.devices.failures import is_peer_failure

        return is_peer_failure(exc)

    def before_log(self, total_loss_dict: dict) -> None:
        total_loss_dict["seen"] = True

    def after_log(self, iteration: int) -> None:
        self.logged.append(iteration)

    def training_returned(self, iteration: object) -> None:
        self.returned = iteration


def _megatron_training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                           report_memory_flag, skipped_iter, grad_norm, params_norm,
                           num_zeros_in_grad, max_attention_logit, pg_collection=None,
                           is_first_iteration=False):  # fmt: skip
    """Megatron-LM's `training_log` signature (core_v0.16.1)."""
    if loss_dict == "fail":
        raise RuntimeError("Connection closed by peer")
    if loss_dict == "bug":
        raise DeadpoolRuntimeError("not a peer failure")
    return ("logged", is_first_iteration)


def test_training_log_hook_defers_peer_failures_and_hides_a_newcomers_first_iteration() -> None:
    from megatron_deadpool.megatron_lm.hooks import wrap_training_log

    session = _FakeSession(joined_late=True)
    log = wrap_training_log(_megatron_training_log, session)
    args = (None, {}, 1e-3, 7, 1.0, True, 0, 1.0, None, None, 0)
    assert log(*args, is_first_iteration=True) == ("logged", False)
    assert session.logged == [7]
    assert log("fail", *args[1:]) is True  # report_memory_flag back, failure deferred
    assert session.deferred == ["training_log"]
    assert session.failed_log == (7, False)  # its sums made what a completed log leaves
    with pytest.raises(DeadpoolRuntimeError):
        log("bug", *args[1:])
    survivor = _FakeSession()
    assert wrap_training_log(_megatron_training_log, survivor)(*args, is_first_iteration=True)[1]


def test_between_steps_guard_returns_megatrons_neutral_value() -> None:
    from megatron_deadpool.megatron_lm.hooks import wrap_between_steps

    def post_training_step_callbacks(model, optimizer, opt_param_scheduler, iteration, prof,
                                     num_floating_point_operations_since_last_log_event,
                                     nsys_nvtx_context=None):  # fmt: skip
        raise RuntimeError("gloo: Connection reset by peer")

    session = _FakeSession()
    guarded = wrap_between_steps(
        post_training_step_callbacks,
        session,
        "post-step callbacks",
        lambda b: b.arguments["num_floating_point_operations_since_last_log_event"],
    )
    assert guarded(1, 2, 3, 4, None, 12.5) == 12.5
    assert session.deferred == ["post-step callbacks"]


def test_a_rank_one_step_behind_skips_that_steps_work_between_steps_only() -> None:
    """survivors.py: the step's `training_log` and the guarded hooks are not called at all (the
    fakes raise a job's error if they are), the next step's are."""
    from megatron_deadpool.megatron_lm.hooks import wrap_between_steps, wrap_training_log

    session = _FakeSession()
    session.behind = 7
    log = wrap_training_log(_megatron_training_log, session)
    total: dict = {}
    args = (total, 1e-3, 7, 1.0, "flag", 0, 1.0, None, None, 0)
    assert log("bug", *args) == "flag"
    assert total == {} and session.logged == []  # no sums loaded, no DeadPool line
    assert session.evaluation_skipped  # Megatron's loop decides it after the log
    assert log(None, total, 1e-3, 8, *args[3:])[0] == "logged"
    assert session.logged == [8]

    def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration,
                                   num_floating_point_operations_so_far, checkpointing_context,
                                   train_data_iterator):  # fmt: skip
        raise DeadpoolRuntimeError("called")

    guarded = wrap_between_steps(checkpoint_and_decide_exit, session, "exit check", lambda b: False)
    assert guarded(None, None, None, 7, 0.0, {}, None) is False
    with pytest.raises(DeadpoolRuntimeError, match="called"):
        guarded(None, None, None, 8, 0.0, {}, None)
    assert session.deferred == []


def test_train_hook_keeps_the_checkpointing_context_for_rebinding() -> None:
    from megatron_deadpool.megatron_lm.hooks import wrap_train

    def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
              valid_data_iterator, process_non_loss_data_func, config, checkpointing_context,
              non_loss_data_func, inference_model=None):  # fmt: skip
        return "trained"

    session = _FakeSession()
    context = {"save_strategy": object()}
    assert wrap_train(train, session)(1, 2, 3, 4, 5, 6, 7, 8, context, 10) == "trained"
    assert session.extra_roots == [context]


class _StepSession(_FakeSession):
    def __init__(self) -> None:
        super().__init__()
        self.finished = 0

    def train_step(self, step, *args):  # MegatronSession.train_step's order
        *fixed, iteration = args
        return step(*fixed, iteration=iteration)

    def finish(self) -> None:
        self.finished += 1


def _train_step_16(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                   config, forward_backward_func, iteration=None):  # fmt: skip
    """Megatron-LM's `train_step` signature (core_v0.16.1)."""
    return ("stepped", iteration)


def _train_step_19(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                   config, forward_backward_func, iteration=None, pg_collection=None,
                   p2p_communicator=None):  # fmt: skip
    """Megatron-LM's `train_step` signature (core_v0.19.0)."""
    return ("stepped", iteration, pg_collection, p2p_communicator)


def test_train_step_hook_passes_each_tags_arguments_through() -> None:
    from megatron_deadpool.megatron_lm.hooks import wrap_train_step

    session = _StepSession()
    assert wrap_train_step(_train_step_16, session)(*range(7), iteration=4) == ("stepped", 4)
    step = wrap_train_step(_train_step_19, session)
    assert step(*range(7), 4, pg_collection="pgs") == ("stepped", 4, "pgs", None)
    assert step(*range(7), iteration=5) == ("stepped", 5, None, None)


def test_train_hook_marks_the_rank_done_when_megatron_ends_the_job() -> None:
    """Megatron's own `sys.exit` at the end of `train` (after a world barrier) ends the job:
    the session is finished first, the exit code passes through."""
    from megatron_deadpool.megatron_lm.hooks import wrap_train

    def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
              valid_data_iterator, process_non_loss_data_func, config, checkpointing_context,
              non_loss_data_func, inference_model=None, p2p_communicator=None,
              pg_collection=None):  # fmt: skip
        raise SystemExit(16)

    session = _StepSession()
    context = {}
    with pytest.raises(SystemExit) as exited:
        wrap_train(train, session)(*range(8), context, 9, pg_collection="pgs")
    assert exited.value.code == 16 and session.finished == 1
    assert session.extra_roots == [context, "pgs"]  # rebound after a swap like the model


def test_a_log_failing_in_its_timers_barrier_leaves_the_interval_timer_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Megatron's own `Timers`: `training_log` reads `interval-time` with a barrier, which
    stops and resets it, then restarts it with another barrier; a peer dying there left it
    stopped at 0 s, and the first log after the recovery divided by that 0 (ZeroDivisionError,
    seen in the Slurm lab). The hook puts the timer back running, so the next log reads the
    time since."""
    import time

    import torch
    from megatron.core.timers import Timers

    from megatron_deadpool.megatron_lm import timers as timers_mod
    from megatron_deadpool.megatron_lm.hooks import wrap_training_log

    megatron_timers = Timers(log_level=0, log_option="minmax")
    monkeypatch.setattr(timers_mod, "megatron", lambda: megatron_timers)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # a CPU, no CUDA
    barriers = []

    def barrier(group=None) -> None:  # the second barrier of the first read meets a dead peer
        barriers.append(group)
        if len(barriers) == 2:
            raise RuntimeError(
                "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
            )

    monkeypatch.setattr(torch.distributed, "barrier", barrier)
    read: list[float] = []

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                     report_memory_flag, skipped_iter, grad_norm, params_norm,
                     num_zeros_in_grad, max_attention_logit, pg_collection=None,
                     is_first_iteration=False):  # fmt: skip
        elapsed = megatron_timers("interval-time").elapsed(barrier=True)
        read.append(elapsed)
        return 1.0 / elapsed  # Megatron's throughput

    megatron_timers("interval-time", log_level=0).start()
    session = _FakeSession()
    log = wrap_training_log(training_log, session)
    args = ({}, {}, 1e-3, 7, 1.0, True, 0, 1.0, None, None, 0)
    assert log(*args) is True  # failed in the restart's barrier: deferred
    assert session.deferred == ["training_log"]
    time.sleep(0.01)
    assert log(*args) > 0  # no ZeroDivisionError
    assert read == [pytest.approx(read[0])] and read[0] >= 0.01  # the time since the restart
    assert megatron_timers("interval-time")._started


def test_a_step_that_fails_resets_the_timers_it_started() -> None:
    from megatron.core.timers import Timers

    from megatron_deadpool.megatron_lm import timers

    megatron_timers = Timers(log_level=2, log_option="minmax")
    for name in ("interval-time", "forward-backward", "optimizer"):
        megatron_timers(name, log_level=0)
    megatron_timers("interval-time")._started = True
    before = timers.running(megatron_timers)
    megatron_timers("forward-backward")._started = True  # the step started it, then failed
    timers.restore(megatron_timers, before)
    assert timers.running(megatron_timers) == {"interval-time"}
    assert timers.running(None) == set()
