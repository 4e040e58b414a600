"""The exception hierarchy of megatron-deadpool.

Bad input raises a subclass of `ValueError` (`ConfigError` and its children) whose message
names the offending field and says how to fix it; the CLI turns those into one line on
stderr and exit code 2. Runtime conditions that end a run on purpose have their own types.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value, flag or file is invalid; the message names the field and fix."""


class PlacementError(ConfigError):
    """Replicas cannot be placed outside their owner's failure domain for this layout."""


class JobTokenError(ConfigError):
    """A process presented a job token that does not match the coordinator's job."""


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


def first_line(exc: BaseException) -> str:
    """An error's first line (its type when it says nothing), at most 160 characters: how
    DeadPool quotes an error in a log line or a report."""
    return (str(exc).splitlines() or [type(exc).__name__])[0][:160]
