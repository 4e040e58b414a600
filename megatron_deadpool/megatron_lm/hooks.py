"""Where DeadPool hooks into Megatron-LM's training (`megatron/training`, every supported tag).

`pretrain()` calls these module-level functions of `megatron.training.training` by name, so
replacing the module attributes is enough (no source edit). Each hook and why:

- `torch.distributed.init_process_group` (generation 0): on the coordinator's store under the
  prefix `gen0`, with the rank the roster gives; later generations use `gen1`, ... .
- `parallel_state.initialize_model_parallel`: record Megatron's exact call (a new generation
  repeats it), check the layout and place replicas.
- `setup_model_and_optimizer` (newcomer only): no checkpoint load (state comes from memory);
  then - the survivors' agreement awaited, `MegatronSession.newcomer_plan` - the iteration
  counter is set to the step before the survivors' resume step.
- `build_train_valid_test_data_iterators` (newcomer only): the training data loader starts
  at the restore iteration's sample count, the validation loader where the survivors' is.
- `train`: remember Megatron's checkpointing context (its cached save strategy holds the
  data-parallel group, which must be rebound like the model's groups) and any process groups
  `pretrain` was given (core_v0.19.0); when Megatron ends the job from inside `train` (its
  `sys.exit` after a world barrier) every rank is marked done first, so the coordinator does
  not take the exits for failures.
- `train_step`: replication after every optimizer step; recovery and recomputation in place
  (`MegatronSession.train_step`).
- `save_checkpoint`: a save that cannot be written (a full disk, an unwritable folder) is
  agreed on by every rank, leaves no partial folder and is one warning line; training goes on
  (`save.py`). Around `checkpoint_and_decide_exit` that line waits for its decision, so that it
  says whether Megatron stops there (an exit signal, interval or duration).
- `training_log`, `evaluate_and_print_results`, `post_training_step_callbacks`,
  `checkpoint_and_decide_exit`: a collective that fails in them (a peer died between steps)
  is deferred to the next step, so that all survivors resume at the same step; a survivor
  that resumed one step behind the others skips them once (`survivors.py`); after
  `training_log`, DeadPool's own log line and TensorBoard/W&B scalars.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from . import timers
from .resume import build_without_loading
from .save import wrap_save_checkpoint
from .session import MegatronSession

_ORIGINALS: dict[tuple[Any, str], Any] = {}


def _patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    key = (owner, name)
    if key not in _ORIGINALS:
        _ORIGINALS[key] = getattr(owner, name)
    setattr(owner, name, make(_ORIGINALS[key]))


def uninstall() -> None:
    """Put every original back (tests)."""
    for (owner, name), value in _ORIGINALS.items():
        setattr(owner, name, value)
    _ORIGINALS.clear()


def wrap_init_process_group(real: Any, session: Any, restore: Callable[[Any], None]) -> Any:
    """Generation 0's `init_process_group` through the session (then the real one again)."""

    @functools.wraps(real)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        restore(real)  # later generations call the real one
        if args:
            kwargs = {**dict(zip(("backend", "init_method"), args)), **kwargs}
        session.init_process_group(real, kwargs)

    return init_process_group


def wrap_initialize_model_parallel(real: Any, session: Any, get_args: Callable[[], Any]) -> Any:
    @functools.wraps(real)
    def initialize_model_parallel(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        session.model_parallel_ready(real, args, kwargs, get_args())

    return initialize_model_parallel


def wrap_setup_model_and_optimizer(real: Any, session: Any, get_args: Callable[[], Any]) -> Any:
    @functools.wraps(real)
    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        if session.joining is None:
            return real(*args, **kwargs)
        a = get_args()
        out = build_without_loading(a, real, *args, **kwargs)  # the state: peers' memory
        plan = session.newcomer_plan()  # the survivors agreed meanwhile, or now
        a.iteration = plan.target - 1
        a.num_floating_point_operations_so_far = plan.counters[str(plan.target - 1)]["flops"]
        return out

    return setup_model_and_optimizer


def wrap_build_data_iterators(real: Any, session: Any, get_args: Callable[[], Any]) -> Any:
    @functools.wraps(real)
    def build_train_valid_test_data_iterators(*args: Any, **kwargs: Any) -> Any:
        if session.joining is None:
            return real(*args, **kwargs)
        plan = session.newcomer_plan()
        a = get_args()
        restore = plan.counters[str(plan.roster.restore_iteration)]
        resume = plan.counters[str(plan.target - 1)]
        a.iteration = plan.roster.restore_iteration
        a.consumed_train_samples = int(restore["consumed_train"])
        a.consumed_valid_samples = int(resume["consumed_valid"])
        out = real(*args, **kwargs)
        a.iteration = plan.target - 1
        a.consumed_train_samples = int(resume["consumed_train"])
        a.skipped_train_samples = int(resume["skipped_train"])
        # A rank that builds no dataset takes these flags from rank 0's broadcast, which the
        # private world cannot deliver: the survivors' values.
        a.do_train, a.do_valid, a.do_test = plan.flags
        return out

    return build_train_valid_test_data_iterators


def wrap_train(real: Any, session: Any) -> Any:
    sig = inspect.signature(real)

    @functools.wraps(real)
    def train(*args: Any, **kwargs: Any) -> Any:
        arguments = sig.bind(*args, **kwargs).arguments
        # Megatron's checkpointing context (its cached save strategy holds the data-parallel
        # group) and, core_v0.19.0, the groups `pretrain` was given for the schedule.
        for name in ("checkpointing_context", "pg_collection", "p2p_communicator"):
            if arguments.get(name) is not None:
                session.extra_roots.append(arguments[name])
        try:
            out = real(*args, **kwargs)
        except SystemExit:
            # Megatron's own end of the job, decided by every rank together (after a world
            # barrier): --exit-interval, --exit-duration-in-mins, the exit signal handler,
            # the rerun state machine's codes 16/17. Done on purpose, not a failed rank.
            session.finish()
            raise
        session.training_returned(out[0])  # (iteration, floating-point operations so far)
        return out

    return train


STEP_ARGS = (
    "forward_step_func",
    "data_iterator",
    "model",
    "optimizer",
    "opt_param_scheduler",
    "config",
    "forward_backward_func",
)
"""`train_step`'s arguments in every supported release; later ones (core_v0.19.0:
`pg_collection`, `p2p_communicator`) are passed through as given."""


def wrap_train_step(real: Any, session: Any) -> Any:
    sig = inspect.signature(real)

    @functools.wraps(real)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        arguments = dict(sig.bind(*args, **kwargs).arguments)
        fixed = [arguments.pop(name) for name in STEP_ARGS]
        iteration = arguments.pop("iteration", None)
        step = functools.partial(real, **arguments) if arguments else real
        return session.train_step(step, *fixed, iteration)

    return train_step


def wrap_training_log(real: Any, session: Any) -> Any:
    sig = inspect.signature(real)
    failed = object()  # `guarded`'s answer when a peer failure was deferred
    guarded = wrap_between_steps(real, session, "training_log", lambda b: failed)

    @functools.wraps(real)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        if session.skips_between_steps(bound.arguments["iteration"]):
            session.skip_evaluation()
            return bound.arguments["report_memory_flag"]
        session.before_log(bound.arguments["total_loss_dict"])
        if session.joined_late:
            # Megatron logs a process's first iteration unconditionally (with a world
            # barrier); a newcomer's first iteration is not the job's.
            bound.arguments["is_first_iteration"] = False
        out = guarded(*bound.args, **bound.kwargs)
        if out is failed:
            first = bound.arguments.get("is_first_iteration", False)
            session.log_failed(bound.arguments["iteration"], first)
            return bound.arguments["report_memory_flag"]
        session.after_log(bound.arguments["iteration"])
        return out

    return training_log


def wrap_between_steps(
    real: Any, session: Any, where: str, fallback: Callable[[inspect.BoundArguments], Any]
) -> Any:
    """`real` with a peer failure deferred to the next step (returning `fallback(args)`),
    Megatron's timers left as they were before the call (`timers.restore`); not called at all
    after a step the other survivors had passed (`MegatronSession.skips_between_steps`)."""
    sig = inspect.signature(real)

    @functools.wraps(real)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        if session.skips_between_steps(bound.arguments["iteration"]):
            return fallback(bound)
        running = timers.running(timers.megatron())
        try:
            return real(*args, **kwargs)
        except Exception as exc:
            if not session.is_peer_failure(exc):
                raise
            timers.restore(timers.megatron(), running)
            session.defer(exc, where)
            return fallback(bound)

    return guarded


def wrap_exit_check(real: Any, session: Any) -> Any:
    """`checkpoint_and_decide_exit`: a checkpoint it fails to save is said with what Megatron
    decided (`MegatronSession.exit_check`): training goes on, or it stops there."""

    @functools.wraps(real)
    def checkpoint_and_decide_exit(*args: Any, **kwargs: Any) -> Any:
        with session.exit_check() as decided:
            stop = real(*args, **kwargs)
            decided(stop)
        return stop

    return checkpoint_and_decide_exit


def install(session: MegatronSession) -> None:
    """Hook `session` into megatron.training (idempotent per process)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.training import get_args
    from megatron.training import training as tr

    if session.joining is None:
        _patch(
            dist,
            "init_process_group",
            lambda real: wrap_init_process_group(
                real, session, lambda r: setattr(dist, "init_process_group", r)
            ),
        )
    _patch(
        ps,
        "initialize_model_parallel",
        lambda real: wrap_initialize_model_parallel(real, session, get_args),
    )
    _patch(
        tr,
        "setup_model_and_optimizer",
        lambda real: wrap_setup_model_and_optimizer(real, session, get_args),
    )
    _patch(
        tr,
        "build_train_valid_test_data_iterators",
        lambda real: wrap_build_data_iterators(real, session, get_args),
    )
    _patch(tr, "train", lambda real: wrap_train(real, session))
    _patch(tr, "train_step", lambda real: wrap_train_step(real, session))
    _patch(tr, "save_checkpoint", lambda real: wrap_save_checkpoint(real, session))
    _patch(tr, "training_log", lambda real: wrap_training_log(real, session))
    _patch(
        tr,
        "evaluate_and_print_results",
        lambda real: wrap_between_steps(real, session, "evaluation", lambda b: None),
    )
    _patch(
        tr,
        "post_training_step_callbacks",
        lambda real: wrap_between_steps(
            real,
            session,
            "post-step callbacks",
            lambda b: b.arguments["num_floating_point_operations_since_last_log_event"],
        ),
    )
    _patch(
        tr,
        "checkpoint_and_decide_exit",
        lambda real: wrap_exit_check(
            wrap_between_steps(real, session, "checkpoint/exit check", lambda b: False), session
        ),
    )
