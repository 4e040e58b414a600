"""A run's timeline from what it left in its folder: failures, recoveries and their phases,
spares, the committed iteration - for `deadpool report`'s table and picture.

Reads the coordinator's event log (`events.jsonl`, schema `events.EVENTS`), the spares the job
started with (`job.yaml` of `deadpool train`, `summary.json` of `deadpool megatron-lm`) and
rank 0's per-iteration records (`ITERATIONS_FILE`, which `deadpool train` writes into its run
folder, or a `--json-log` file given). Pure reading: no store, no process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ...errors import ConfigError

ITERATIONS_FILE = "iterations.jsonl"
"""Rank 0's per-iteration records in a `deadpool train` run folder (as `--json-log` has them)."""


@dataclass(frozen=True)
class Row:
    """One line of the timeline: seconds from the start, what happened, its details."""

    t: float
    what: str
    detail: str
    spares: int


@dataclass
class Timeline:
    """A run as the report shows it."""

    start: float
    rows: list[Row] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    """Each `recovered` entry, with `t` its end (seconds from the start)."""
    failures: list[float] = field(default_factory=list)
    """Seconds from the start at which a process was found dead."""
    spares: list[tuple[float, int]] = field(default_factory=list)
    """(seconds from the start, spares waiting), a step at each change."""
    committed: list[tuple[float, int]] = field(default_factory=list)
    """(seconds from the start, committed iteration) from the iteration records."""


def _lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"{path}:{i}: not a JSON line") from None
        if isinstance(entry, dict):
            out.append(entry)
    return out


def initial_spares(run_dir: Path) -> int:
    """The spares the job started with: job.yaml (`deadpool train`) or summary.json
    (`deadpool megatron-lm`); 0 when neither says."""
    job = run_dir / "job.yaml"
    if job.is_file():
        section = (yaml.safe_load(job.read_text()) or {}).get("deadpool") or {}
        return int(section.get("spare_ranks", section.get("spares")) or 0)  # spares: an older run
    summary = run_dir / "summary.json"
    if summary.is_file():
        return int(json.loads(summary.read_text()).get("spares") or 0)
    return 0


def read_timeline(run_dir: str | Path, iterations: str | Path | None = None) -> Timeline:
    """The timeline of the run in `run_dir` (`iterations`: its per-iteration records, by
    default the folder's `ITERATIONS_FILE` if there is one). `ConfigError` when the folder holds
    no event log."""
    folder = Path(run_dir)
    if iterations is None and (folder / ITERATIONS_FILE).is_file():
        iterations = folder / ITERATIONS_FILE
    events_path = folder / "events.jsonl"
    if not events_path.is_file():
        raise ConfigError(
            f"RUN_DIR: {folder} holds no events.jsonl; give the --run-dir (or "
            "--deadpool-log-dir) of a DeadPool run"
        )
    events = _lines(events_path)
    if not events:
        raise ConfigError(f"RUN_DIR: {events_path} is empty")
    start = float(events[0]["t"])
    spares = initial_spares(folder)
    tl = Timeline(start=start, spares=[(0.0, spares)])
    for e in events:
        t = float(e.get("t", start)) - start
        kind = str(e.get("event"))
        detail = ""
        if kind == "process_dead":
            tl.failures.append(t)
            detail = f"{e.get('member')}: {e.get('why')}"
        elif kind == "respawned":
            detail = f"rank {e.get('rank')} -> {e.get('member')} on node {e.get('node')}"
        elif kind == "plan":
            detail = f"generation {e.get('generation')}, dead ranks {e.get('dead')}"
        elif kind == "recovered":
            respawned = {str(r) for r in (e.get("respawned") or {})}
            used = [r for r in (e.get("replaced_by") or {}) if str(r) not in respawned]
            spares -= len(used)
            tl.spares.append((t, spares))
            tl.recoveries.append({**e, "t": t})
            phases = ", ".join(f"{p} {s:.2f}s" for p, s in (e.get("phases_s") or {}).items())
            detail = (
                f"generation {e.get('generation')}: ranks {e.get('dead_ranks')} "
                f"({len(used)} spare(s), {len(respawned)} respawn(s)) in "
                f"{float(e.get('total_s') or 0):.2f}s: {phases}"
            )
        elif kind == "spare_lost":
            spares = int(e.get("spares_left", spares - 1))
            tl.spares.append((t, spares))
            detail = str(e.get("member"))
        elif kind in ("out_of_redundancy", "job_error", "lost_after_training"):
            detail = str(e.get("reason", ""))
        elif kind == "finished":
            detail = f"digest {str(e.get('final_param_digest') or '')[:16]}"
        elif kind in ("roster", "store", "agreed", "settings"):
            continue  # plumbing: in the log, not in the table
        else:
            detail = ", ".join(
                f"{k}={v}" for k, v in e.items() if k not in ("v", "job", "t", "event")
            )
        tl.rows.append(Row(round(t, 3), kind, detail, spares))
    if iterations is not None:
        for rec in _lines(Path(iterations)):
            if "iteration" in rec and rec.get("committed_iteration") is not None:
                tl.committed.append((float(rec["time"]) - start, int(rec["committed_iteration"])))
    return tl


def table(tl: Timeline) -> str:
    """The timeline as a fixed-width table."""
    lines = [f"{'t (s)':>8}  {'event':<20} {'spares':>6}  detail"]
    for r in tl.rows:
        lines.append(f"{r.t:8.2f}  {r.what:<20} {r.spares:>6}  {r.detail}")
    if tl.committed:
        lines.append(f"committed iteration at the end: {tl.committed[-1][1]}")
    return "\n".join(lines)
