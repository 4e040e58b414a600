"""The selftest's rows, table, verdict and JSON report (pure: no torch, no processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["pass", "fail", "skipped"]

NAME_WIDTH = 15
STATUS_WIDTH = 7


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


def exit_code(rows: list[Row]) -> int:
    """0 when every check that ran passed (skipped ones do not count), else 1."""
    return 1 if any(r.status == "fail" for r in rows) else 0


def verdict(rows: list[Row]) -> str:
    """The closing line: how many passed, failed and were skipped."""
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "fail", "skipped")}
    word = "FAILED" if counts["fail"] else "OK"
    return (
        f"selftest {word}: {counts['pass']} passed, {counts['fail']} failed, "
        f"{counts['skipped']} skipped"
    )


def report(rows: list[Row], environment: dict[str, Any]) -> dict[str, Any]:
    """The JSON report: every check by name, the environment, the verdict."""
    return {
        "checks": {r.check: r.to_dict() for r in rows},
        "environment": environment,
        "exit_code": exit_code(rows),
        "verdict": verdict(rows),
    }
