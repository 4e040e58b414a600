"""Is a failure the job's own error - one no spare can fix - or a lost process to hot-swap?

Pure: part of the coordinator's decisions (`decide.py`) over the error reports it read. A process
that ends with an exception of its own reports it (`messages.ErrorReport`: its phase, the
exception's type and first line; `Driver.report_error`); one that dies by a signal reports
nothing. A death is the job's own error when
  - the member reported an error in its start-up in generation 0: none of its iterations was
    replicated yet (arguments, imports, data paths, initialisation, the first steps), so memory
    holds nothing to recover from and a spare would only run the same start-up again; or
  - a newcomer reported the same error - phase, type and first line - as an earlier holder of
    its slot: the error follows the slot, not the process.
Everything else stays a failure to hot-swap: a death by a signal, a first error in training
(the spare may not meet it: a bad node's memory, a full local disk), a waiting spare's error.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..protocol.messages import ErrorReport, JobError, Phase


def judge(
    dead: Mapping[int, str],
    reports: Mapping[str, ErrorReport],
    replaced: Mapping[str, str],
) -> JobError | None:
    """The verdict on the ranks that died together (rank -> the member in its slot), given the
    error reports read so far (member -> its report) and who took whose slot (newcomer -> the
    member it replaced); None: a failure to hot-swap. When several ranks' errors are the job's,
    the lowest rank's report is the one named."""
    for rank in sorted(dead):
        member = dead[rank]
        report = reports.get(member)
        if report is None:
            continue
        if report.generation == 0 and report.phase is Phase.START_UP:
            reason = (
                f"rank {rank} failed in its start-up, before replication started: the job's own "
                "error, not a lost process (a spare would fail the same way)"
            )
        else:
            earlier = _same_error_before(member, report, reports, replaced)
            if earlier is None:
                continue
            reason = (
                f"rank {rank}'s spare {member} failed as {earlier} did before it, in the same "
                "phase with the same error: the error follows the slot, not the process"
            )
        return JobError(reason=reason, report=report, dead_ranks=tuple(sorted(dead)))
    return None


def _same_error_before(
    member: str,
    report: ErrorReport,
    reports: Mapping[str, ErrorReport],
    replaced: Mapping[str, str],
) -> str | None:
    """The earlier holder of `member`'s slot that reported the same error, if any (the nearest
    one that reported anything decides: one that died by a signal in between is skipped)."""
    seen = {member}
    earlier = replaced.get(member)
    while earlier is not None and earlier not in seen:
        before = reports.get(earlier)
        if before is not None:
            return earlier if before.signature() == report.signature() else None
        seen.add(earlier)
        earlier = replaced.get(earlier)
    return None
