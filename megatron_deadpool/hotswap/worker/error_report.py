"""The report a process sends the coordinator when it ends with an error no recovery accounts
for (`Driver.report_error`): its phase, the exception's type and first line, the end of its
traceback - from which the coordinator tells the job's own error from a lost process
(`coordinator/job_error.py`)."""

from __future__ import annotations

import time
import traceback

import torch.distributed as dist

from ...errors import (
    ConfigError,
    CoordinatorUnreachableError,
    LostAfterTrainingError,
    OutOfRedundancyError,
    first_line,
)
from ..protocol.messages import ErrorReport, Phase

NOT_THE_JOBS_ERRORS = (
    ConfigError,  # bad input: exit code 2, its own one line
    OutOfRedundancyError,
    LostAfterTrainingError,
    CoordinatorUnreachableError,
    dist.DistStoreError,  # the coordinator's store, not the job
    dist.DistNetworkError,
)
"""Errors a process ends with that are no error of the job's (`Driver.report_error`): bad
input, which has its own exit code, DeadPool's own verdicts and a lost coordinator."""

TRACEBACK_LINES = 12
"""How many of its traceback's last lines an error report carries (each cut at 240 characters)."""


def error_report(
    exc: BaseException, *, member: str, rank: int | None, generation: int, phase: Phase
) -> ErrorReport | None:
    """What a process that ends with `exc` tells the coordinator (None: nothing, for the errors
    in `NOT_THE_JOBS_ERRORS`). `generation` counts only with a rank (-1 without)."""
    if isinstance(exc, NOT_THE_JOBS_ERRORS):
        return None
    lines = "".join(traceback.format_exception(exc)).splitlines()[-TRACEBACK_LINES:]
    return ErrorReport(
        number=1,  # the store's number replaces it
        member=member,
        rank=rank,
        generation=generation if rank is not None else -1,
        phase=phase,
        error=type(exc).__name__,
        message=first_line(exc) if str(exc).strip() else "",
        time=time.time(),
        tail=tuple(line[:240] for line in lines),
    )
