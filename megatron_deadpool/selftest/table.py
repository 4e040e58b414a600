"""The selftest's rows, table, verdict and JSON report (pure: no torch, no processes)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ExitCode

Status = Literal["pass", "fail", "skipped"]

NAME_WIDTH = 15
STATUS_WIDTH = 7

EXIT_INCOMPLETE = int(ExitCode.SELFTEST_INCOMPLETE)
"""The exit code of a selftest in which nothing failed but no cross-rank check ran (one rank:
`--nproc 1`): the machine's replication, kill and hang were not checked, so it does not say OK."""


@dataclass(frozen=True)
class Row:
    """One check's outcome: `detail` says what was seen (or why it failed or was skipped),
    `data` holds its figures for the JSON report."""

    check: str
    status: Status
    seconds: float
    detail: str
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in ("pass", "fail", "skipped"):
            raise ValueError(f"status: {self.status!r} is not one of pass, fail, skipped")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "detail": self.detail,
        }
        if self.data:
            out["data"] = self.data
        return out


def header() -> str:
    """The table's column titles and rule."""
    title = f"{'check':<{NAME_WIDTH}} {'status':<{STATUS_WIDTH}} {'seconds':>8}  detail"
    return f"{title}\n{'-' * len(title)}"


def render(row: Row) -> str:
    """One row of the table; a multi-line detail continues under the detail column."""
    lead = f"{row.check:<{NAME_WIDTH}} {row.status.upper():<{STATUS_WIDTH}} {row.seconds:>8.2f}  "
    lines = row.detail.splitlines() or [""]
    return "\n".join([lead + lines[0], *(" " * len(lead) + line for line in lines[1:])])


def not_checked(rows: list[Row], cross_rank: Collection[str]) -> list[str]:
    """The cross-rank checks among `rows` when none of them ran (all skipped), else []."""
    named = [r for r in rows if r.check in cross_rank]
    if named and all(r.status == "skipped" for r in named):
        return [r.check for r in named]
    return []


def exit_code(rows: list[Row], cross_rank: Collection[str] = ()) -> int:
    """0 when every check that ran passed (skipped ones do not count) and, of the checks
    named in `cross_rank`, at least one ran; 1 when one failed; `EXIT_INCOMPLETE` when
    nothing failed but no cross-rank check ran."""
    if any(r.status == "fail" for r in rows):
        return 1
    return EXIT_INCOMPLETE if not_checked(rows, cross_rank) else 0


def verdict(rows: list[Row], cross_rank: Collection[str] = ()) -> str:
    """The closing line: how many passed, failed and were skipped; INCOMPLETE (not OK) when
    nothing failed but no cross-rank check ran, naming them."""
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "fail", "skipped")}
    missing = not_checked(rows, cross_rank)
    word = "FAILED" if counts["fail"] else ("INCOMPLETE" if missing else "OK")
    line = (
        f"selftest {word}: {counts['pass']} passed, {counts['fail']} failed, "
        f"{counts['skipped']} skipped"
    )
    if word == "INCOMPLETE":
        line += (
            f"; not checked across ranks: {', '.join(missing)} (give --nproc 2 or more, or "
            "--slurm across nodes)"
        )
    return line


def report(
    rows: list[Row], environment: dict[str, Any], cross_rank: Collection[str] = ()
) -> dict[str, Any]:
    """The JSON report: every check by name, the environment, the verdict."""
    return {
        "checks": {r.check: r.to_dict() for r in rows},
        "environment": environment,
        "exit_code": exit_code(rows, cross_rank),
        "verdict": verdict(rows, cross_rank),
    }
