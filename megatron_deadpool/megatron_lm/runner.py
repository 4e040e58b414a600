"""Megatron-LM integration: the `--deadpool` flags, the hooks, and the zero-edit runner.

Users keep their `pretrain_gpt.py` command line and add `--deadpool ...` flags. Three ways in:

- Locally (like torchrun, but nobody is restarted when a rank dies):
      deadpool megatron-lm --nproc-per-node 4 PATH/pretrain_gpt.py <Megatron args> --deadpool ...
- On a cluster, one process per task (RANK/WORLD_SIZE/LOCAL_RANK or SLURM_* env; the last
  `--deadpool-spares` tasks are spares), with `deadpool coordinator` running somewhere:
      python -m megatron_deadpool.megatron_lm PATH/pretrain_gpt.py <Megatron args> --deadpool ...
- A patched script (`scripts/apply_patches.sh`) that calls `prepare()` before Megatron's
  imports, `wrap_pretrain(pretrain)`, and passes `extra_args_provider(...)` itself; it behaves
  exactly as the runner does.

Before the script runs, `prepare()` refuses a Megatron-LM flag that cannot be combined with
`--deadpool` (`interplay.py`) and a Megatron-LM release DeadPool does not support
(`versions.py`, which also says what differs between the supported tags), and on a
machine without a GPU installs the CPU mode and its flags. The runner then runs the
unmodified script with `runpy`, with `megatron.training.pretrain` replaced by
`wrap_pretrain(pretrain)` and the flags added to Megatron's parser (chained with the script's
own `extra_args_provider`: in `pretrain` for core_v0.16.1, in `parse_and_validate_args`,
which the script calls first, for core_v0.19.0). With `--deadpool`, `wrap_pretrain` starts a
`MegatronSession` and installs the training hooks (`megatron_lm_hooks`); DeadPool's log level
follows Megatron's (`log_level.py`). Without `--deadpool` nothing but the flags, the
CPU mode and the resume from a snapshot set (below) is added - and, either way, the dataclasses'
field docstrings Megatron's parser reads are read once per class (`field_docstrings.py`: a
newcomer's start-up builds the parser again, ~65-85 ms each time otherwise; the parser is the same).

Out of redundancy (no spare left, or a shard with no surviving copy) every survivor exits with
code 3 after writing DeadPool's snapshot set of one common iteration under `--save`
(`megatron_lm_recovery`); the message names the dead ranks and any shard that was lost. When
the set is complete, launching the same command with `--load` resumes from it and, with
`--save`, writes it as a Megatron checkpoint through Megatron's own `save_checkpoint`
(`megatron_lm_resume` says why that cannot happen before the exit).

An exception that ends a process inside `pretrain()` is first reported to the coordinator
(`Driver.report_error`: phase, type, first line, the end of the traceback): an error of
Megatron's start-up, or a spare's repeat of the error of the rank it replaced, is the job's own
and ends the job with exit code 9 instead of costing a spare (`hotswap/coordinator/job_error.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import logging
import os
import runpy
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..config.deadpool import DeadpoolConfig
from ..config.flags import add_flags, from_namespace
from ..config.torchrun import refuse_torchrun
from ..errors import (
    ConfigError,
    CoordinatorUnreachableError,
    ExitCode,
    LostAfterTrainingError,
    OutOfRedundancyError,
)
from . import field_docstrings, interplay, versions

log = logging.getLogger("megatron_deadpool.megatron_lm")

_session_begun = False
"""Whether `pretrain()` began this process's DeadPool session (which reports its errors)."""

USAGE = (
    "usage: python -m megatron_deadpool.megatron_lm SCRIPT [Megatron-LM args] [--deadpool ...]\n"
    "Runs a Megatron-LM training script (e.g. pretrain_gpt.py) unmodified, with DeadPool's\n"
    "--deadpool-* flags and hooks. One process per task; see `deadpool megatron-lm` for a\n"
    "local launcher."
)


def add_deadpool_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every `--deadpool-*` flag (generated from `DeadpoolConfig`) on `parser`."""
    group = parser.add_argument_group(
        "DeadPool", "in-memory replication of optimizer shards and hot swap with spares"
    )
    add_flags(group, DeadpoolConfig, prefix="deadpool")
    return parser


def extra_args_provider(
    user_provider: Callable[[argparse.ArgumentParser], Any] | None = None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """An `extra_args_provider` for `pretrain()`: the script's own one, then DeadPool's flags."""
    if getattr(user_provider, "_deadpool", False):
        return user_provider  # type: ignore[return-value]

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if user_provider is not None:
            parser = user_provider(parser) or parser
        return add_deadpool_flags(parser)

    provider._deadpool = True  # type: ignore[attr-defined]
    return provider


def preparse(argv: Sequence[str]) -> DeadpoolConfig:
    """The `--deadpool-*` flags of a Megatron command line (everything else is ignored)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_flags(parser, DeadpoolConfig, prefix="deadpool")
    try:
        known, _ = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:  # one line, as Megatron's parser would not say it
        raise ConfigError(str(exc)) from None
    return from_namespace(DeadpoolConfig, known, prefix="deadpool")


def _chain_flags(bound: inspect.BoundArguments) -> None:
    """DeadPool's flags chained into the call's `extra_args_provider` (`extra_args_provider`)."""
    bound.arguments["extra_args_provider"] = extra_args_provider(
        bound.arguments.get("extra_args_provider")
    )


def wrap_pretrain(pretrain: Callable[..., Any]) -> Callable[..., Any]:
    """`pretrain` with DeadPool: flags chained into its `extra_args_provider` (where it parses
    the arguments: core_v0.16.1), CPU mode when there is no GPU, and with `--deadpool`
    replication and hot swap (idempotent)."""
    if getattr(pretrain, "_deadpool", False):
        return pretrain
    field_docstrings.install()  # before the script parses the arguments (core_v0.19.0)
    signature = inspect.signature(pretrain)

    @functools.wraps(pretrain)
    def pretrain_with_deadpool(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        if "extra_args_provider" in signature.parameters:
            _chain_flags(bound)
        with _exit_codes():
            return _pretrain(pretrain, bound)

    pretrain_with_deadpool._deadpool = True  # type: ignore[attr-defined]
    return pretrain_with_deadpool


def wrap_parse_and_validate_args(real: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's `parse_and_validate_args` (core_v0.19.0: the script parses the arguments
    before `pretrain`) with DeadPool's flags chained into its `extra_args_provider`."""
    if getattr(real, "_deadpool", False):
        return real
    signature = inspect.signature(real)

    @functools.wraps(real)
    def parse_and_validate_args(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        _chain_flags(bound)
        return real(*bound.args, **bound.kwargs)

    parse_and_validate_args._deadpool = True  # type: ignore[attr-defined]
    return parse_and_validate_args


@contextlib.contextmanager
def _exit_codes() -> Iterator[None]:
    """One line and an exit code: bad input 2, out of redundancy 3, no coordinator 4, a rank
    lost after training completed 0 (what survives was saved)."""
    try:
        yield
    except ConfigError as exc:
        print(f"deadpool: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(ExitCode.BAD_INPUT) from None
    except OutOfRedundancyError as exc:
        print(f"deadpool: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(ExitCode.OUT_OF_REDUNDANCY) from None
    except CoordinatorUnreachableError as exc:
        print(f"deadpool: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(ExitCode.NO_COORDINATOR) from None
    except LostAfterTrainingError as exc:
        print(f"deadpool: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(ExitCode.OK) from None


def _pretrain(pretrain: Callable[..., Any], bound: inspect.BoundArguments) -> Any:
    cfg = preparse(sys.argv[1:])
    _cpu_mode()
    from . import resume as megatron_lm_resume

    # --load from a snapshot set saved out of redundancy
    megatron_lm_resume.install(sys.modules.get(pretrain.__module__))
    if not cfg.enabled:
        return pretrain(*bound.args, **bound.kwargs)
    from ..devices.base import prepare_communication
    from ..hotswap.protocol.seal import job_secret
    from ..logs import setup_logging
    from . import cpu as megatron_lm_cpu
    from . import hooks as megatron_lm_hooks
    from .log_level import megatron_logging_level
    from .session import MegatronSession, task_from_env

    setup_logging(megatron_logging_level(sys.argv[1:], os.environ))
    prepare_communication("cpu" if megatron_lm_cpu.needs_cpu() else "cuda")
    token = job_secret(cfg.job_token) or ""  # the environment's (`hotswap/protocol/seal.py`)
    session = MegatronSession(cfg, None if cfg.join else task_from_env(), token)
    global _session_begun
    _session_begun = True
    if not session.begin():
        return None  # a spare the job never needed
    megatron_lm_hooks.install(session)
    try:
        out = pretrain(*bound.args, **bound.kwargs)
    except CoordinatorUnreachableError:
        session.driver.without_coordinator()
        raise
    except Exception as exc:
        # pretrain()'s work after train() (its barriers, final save, evaluation) with a peer
        # lost after training completed: save what survives, end (LostAfterTrainingError).
        driver = session.driver
        if driver.completed is None or not driver.is_peer_failure(exc):
            driver.report_error(exc)  # the coordinator decides: the job's own error?
            raise
        session.defer(exc, "Megatron's final work after training")
    session.finish()
    return out


def _cpu_mode() -> None:
    """Without a GPU: the CPU development mode, and its flags on the command line (before
    Megatron parses it; idempotent)."""
    from . import cpu as megatron_lm_cpu

    if megatron_lm_cpu.needs_cpu():
        megatron_lm_cpu.activate()
        sys.argv = [sys.argv[0], *megatron_lm_cpu.with_cpu_flags(sys.argv[1:])]


def prepare() -> None:
    """Call before Megatron's modules are imported: refuse a Megatron-LM flag that cannot be
    combined with `--deadpool` and an unsupported Megatron-LM tree, adapt Python to its
    release, and on a machine without a GPU install the CPU development mode (Megatron-LM's
    imports and `initialize_megatron` expect CUDA) and its flags."""
    with _exit_codes():
        cfg = preparse(sys.argv[1:])
        if cfg.enabled:  # torchrun would restart every rank on a failure
            refuse_torchrun(os.environ, "megatron-lm")
            from ..devices import gloo

            gloo.check_settings()  # before any rank or spare starts its world
        interplay.check_megatron_flags(sys.argv[1:], cfg)
        versions.prepare_python(versions.current())
        _cpu_mode()


def install() -> None:
    """Replace `megatron.training.pretrain` by `wrap_pretrain(pretrain)` and, where the script
    parses the arguments itself, `parse_and_validate_args` by its wrapper (the runner does
    this before the script imports them)."""
    import megatron.training as mt
    from megatron.training import training as tr

    wrapped = wrap_pretrain(tr.pretrain)
    tr.pretrain = wrapped
    mt.pretrain = wrapped
    if versions.current().script_parses_args:
        from megatron.training import arguments

        arguments.parse_and_validate_args = wrap_parse_and_validate_args(
            arguments.parse_and_validate_args
        )


def run_script(script: str, script_args: Sequence[str]) -> None:
    """Run a Megatron-LM training script as `python SCRIPT ARGS` would, with DeadPool hooked
    in. The script's folder comes first on the import path, so `megatron` is that tree's."""
    path = os.path.abspath(script)
    sys.path.insert(0, os.path.dirname(path))
    sys.argv = [path, *script_args]
    os.environ["DEADPOOL_MAIN_SCRIPT"] = path  # for spawned children (`_spawned_child`)
    prepare()
    install()
    _spawn_through_runner()
    try:
        runpy.run_path(path, run_name="__main__")
    except Exception as exc:
        if not _session_begun:
            _report_before_pretrain(exc)
        raise


def _report_before_pretrain(exc: Exception) -> None:
    """The script raised `exc` before `pretrain()` began a session (core_v0.19.0's parses and
    validates Megatron's arguments first): with `--deadpool`, report it as this rank's start-up
    error (`MegatronSession.report_early_error`); a report that cannot be made is only logged
    (the process's exit is seen all the same)."""
    from .session import MegatronSession, task_from_env

    try:
        cfg = preparse(sys.argv[1:])
        if cfg.enabled and not cfg.join:  # a joining process held no slot: nothing to report
            token = cfg.job_token or os.environ.get("DEADPOOL_JOB_TOKEN", "")
            MegatronSession(cfg, task_from_env(), token).report_early_error(exc)
    except (ValueError, RuntimeError, OSError) as failed:
        log.warning("could not report this error to the coordinator: %s", failed)


def _spawn_through_runner() -> None:
    """Children started with multiprocessing's *spawn* method re-import the parent's main
    script first (Megatron's checkpoint writer starts a `Manager` that way where DeadPool does
    not guard the save: `replication/write_results.py`). The runner's main script is the
    user's unprepared one, so such children import this module instead: it prepares the CPU
    mode, then runs the script's top level as spawn would have."""
    from multiprocessing import spawn

    if getattr(spawn.get_preparation_data, "_deadpool", False):
        return
    real = spawn.get_preparation_data

    def get_preparation_data(name: str) -> dict[str, Any]:
        data = real(name)
        if data.pop("init_main_from_path", None) is not None:
            data["init_main_from_name"] = "megatron_deadpool.megatron_lm.runner"
        return data

    get_preparation_data._deadpool = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data


def _spawned_child() -> None:
    """This module as a spawned child's `__mp_main__`: prepare, then the script's top level."""
    prepare()
    namespace = runpy.run_path(os.environ["DEADPOOL_MAIN_SCRIPT"], run_name="__mp_main__")
    globals().update({k: v for k, v in namespace.items() if not k.startswith("__")})


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    script, script_args = argv[0], argv[1:]
    if not os.path.isfile(script):
        print(f"deadpool: error: script {script!r} does not exist", file=sys.stderr)
        return 2
    try:
        run_script(script, script_args)
    except ConfigError as exc:
        print(f"deadpool: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__mp_main__":
    _spawned_child()
