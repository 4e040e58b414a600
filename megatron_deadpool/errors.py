"""The exception hierarchy of megatron-deadpool.

Bad input raises a subclass of `ValueError` (`ConfigError` and its children) whose message
names the offending field and says how to fix it; the CLI turns those into one line on
stderr and exit code 2. Runtime conditions that end a run on purpose have their own types.
`ExitCode` is the one list of exit codes every command, launcher and worker uses.
"""

from __future__ import annotations

from enum import IntEnum


class ConfigError(ValueError):
    """A configuration value, flag or file is invalid; the message names the field and fix."""


class PlacementError(ConfigError):
    """Replicas cannot be placed outside their owner's failure domain for this layout."""


class JobTokenError(ConfigError):
    """A process presented a job token that does not match the coordinator's job."""


class OpenFilesError(ConfigError):
    """The process that would host the job's store may not open enough files for the job's
    connections (its hard limit is too low)."""


class DeadpoolRuntimeError(RuntimeError):
    """Base for runtime conditions that end a run deliberately."""


class OutOfRedundancyError(DeadpoolRuntimeError):
    """A failure destroyed state that no surviving memory holds (or no spare is left)."""


class LostAfterTrainingError(DeadpoolRuntimeError):
    """A peer was lost after training completed: the job's final work that needs it cannot
    run (what survives was saved); the process ends successfully."""


class CoordinatorUnreachableError(DeadpoolRuntimeError):
    """The coordinator's store could not be reached within the configured time."""


class CheckpointError(DeadpoolRuntimeError):
    """A checkpoint is missing, incomplete, or does not fit this job."""


class CheckpointSaveError(CheckpointError):
    """A persistent checkpoint could not be written (a full disk, a read-only folder), raised on
    every rank alike: nothing of it is left on disk and the marker still names the newest
    complete one. The message is the one line that says so."""


def first_line(exc: BaseException) -> str:
    """An error's first line (its type when it says nothing), at most 160 characters: how
    DeadPool quotes an error in a log line or a report."""
    return (str(exc).splitlines() or [type(exc).__name__])[0][:160]


class ExitCode(IntEnum):
    """The exit codes of every `deadpool` command, launcher and worker (README, "Exit codes").

    0, 3 and 143 mean "resume": the job ended on its own terms (3: out of redundancy, what
    survived is saved - run the same command with `--load`; 143: stopped on SIGTERM, saved).
    2 and 9 mean "fix the job": resuming repeats the error (2: a flag, file or setting refused
    before anything started; 9: the job's own error - its ranks failed before their first step
    was replicated, or a spare failed exactly as the rank it replaced).
    """

    OK = 0
    FAILED = 1
    """An error DeadPool does not handle (its traceback is in the log)."""
    BAD_INPUT = 2
    """A flag, file or setting was refused; the message names it and the fix."""
    OUT_OF_REDUNDANCY = 3
    """Memory could not recover a failure: what survived is saved; resume with `--load`."""
    NO_COORDINATOR = 4
    """No coordinator could be reached (or none was left); what a rank held is saved."""
    NOT_ACTIVE = 5
    """`deadpool coordinator`: not the job's coordinator (a standby never needed, or a primary a
    standby took over from)."""
    MAX_WAIT = 6
    """`deadpool coordinator`: `--max-wait` reached."""
    ABORT_HUNG = 7
    """A survivor's abort of its process groups did not return within `--deadpool-abort-timeout`
    (a hung NCCL abort): the process ended itself so that the coordinator sees a death, not a
    live process that never reports; a spare takes its slot."""
    DEVICE_FAULT = 8
    """This rank's GPU stopped completing work (its last step's work not done within the
    process-group timeout plus the heartbeat timeout) or its CUDA context failed: the process
    ended itself so that a spare takes its slot."""
    JOB_ERROR = 9
    """The job's own error, not a lost process: a rank raised an exception before its first
    step was replicated (arguments, imports, data paths, initialisation), or a spare raised the
    same one in the same phase as the rank it replaced. No spare is spent on it; the launcher
    names the rank, its phase and the error, and shows the end of its log: fix the job."""
    SELFTEST_INCOMPLETE = 10
    """`deadpool selftest`: every check that ran passed, but nothing was checked across ranks
    (`--nproc 1`: replication, a killed and a frozen peer need two ranks or more)."""
    TIMEOUT = 124
    """A launcher's `--timeout` passed (as `timeout(1)`)."""
    INTERRUPTED = 130
    """Ctrl-C (128 + SIGINT)."""
    PREEMPTED = 143
    """Stopped on purpose after SIGTERM (128 + SIGTERM), a checkpoint saved with `--save` (or, if
    that save failed, a line saying so: `--load` resumes from the newest complete one)."""
