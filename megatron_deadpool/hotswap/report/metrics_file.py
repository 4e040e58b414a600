"""The job's state for a cluster's monitoring: a Prometheus text-format file, rewritten whole.

node_exporter's textfile collector (and any scraper of the Prometheus text exposition format)
reads `--deadpool-metrics-file PATH`. The process that hosts the coordinator writes it: that
process knows the spares, the recoveries, the respawns and the shards short of replicas
first-hand, and it reads rank 0's progress from the job's store anyway (committed iteration,
replica bytes: the embedded job's iteration records, any job's `Progress`) - so one writer, on
one host, sees everything, and no training rank spends time on it. It is rewritten at every
event of the coordinator and every iteration rank 0 reports, atomically as the textfile
convention asks: written to a temporary file in the same folder, then renamed over the old.

`render` is pure (a `JobGauges` to text); `MetricsFile` keeps the latest values and writes.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..coordinator.events import EventLog
from ..protocol.messages import Progress
from .replica_deficit import ReplicaDeficit


@dataclass(frozen=True)
class JobGauges:
    """What the file says about a job."""

    spares_available: int = 0
    recoveries_total: int = 0
    respawns_total: int = 0
    committed_iteration: int | None = None
    iteration: int | None = None
    generation: int = 0
    replica_bytes_per_iteration: int | None = None
    last_recovery_seconds: float | None = None
    last_recovery_phases: Mapping[str, float] = field(default_factory=dict)
    out_of_redundancy: bool = False
    under_replicated_shards: int = 0


METRICS: dict[str, tuple[str, str]] = {
    "deadpool_spares_available": ("gauge", "Spare processes waiting to take a failed rank's slot."),
    "deadpool_recoveries_total": ("counter", "Recoveries completed since the job started."),
    "deadpool_respawns_total": (
        "counter",
        "Failed processes replaced in place on their own node (no spare spent).",
    ),
    "deadpool_committed_iteration": (
        "gauge",
        "Newest iteration whose optimizer-shard replicas every holder committed.",
    ),
    "deadpool_iteration": ("gauge", "Newest iteration rank 0 completed."),
    "deadpool_generation": ("gauge", "Generation of the job's process groups (+1 per recovery)."),
    "deadpool_replica_bytes_per_iteration": (
        "gauge",
        "Bytes of replicas rank 0 sent in its last iteration.",
    ),
    "deadpool_under_replicated_shards": (
        "gauge",
        (
            "Optimizer shards fewer than deadpool-replicas ranks hold a committed copy of: those "
            "a failure took copies of, until the next committed round re-replicates them."
        ),
    ),
    "deadpool_last_recovery_seconds": ("gauge", "Wall time of the last recovery, in seconds."),
    "deadpool_last_recovery_phase_seconds": (
        "gauge",
        "Wall time of each phase of the last recovery, in seconds.",
    ),
    "deadpool_out_of_redundancy": (
        "gauge",
        "1 once the job ended out of redundancy (no spare or no surviving copy), else 0.",
    ),
}
"""Every metric the file holds: name -> (type, help)."""


def _number(value: float) -> str:
    return repr(int(value)) if float(value).is_integer() else repr(float(value))


def render(g: JobGauges) -> str:
    """The Prometheus text exposition of `g`: `# HELP` and `# TYPE` before each metric; a
    metric with no value yet (before the first iteration, before a recovery) left out."""
    values: dict[str, list[tuple[str, float]]] = {
        "deadpool_spares_available": [("", g.spares_available)],
        "deadpool_recoveries_total": [("", g.recoveries_total)],
        "deadpool_respawns_total": [("", g.respawns_total)],
        "deadpool_generation": [("", g.generation)],
        "deadpool_under_replicated_shards": [("", g.under_replicated_shards)],
        "deadpool_out_of_redundancy": [("", int(g.out_of_redundancy))],
    }
    optional: Iterable[tuple[str, float | None]] = (
        ("deadpool_committed_iteration", g.committed_iteration),
        ("deadpool_iteration", g.iteration),
        ("deadpool_replica_bytes_per_iteration", g.replica_bytes_per_iteration),
        ("deadpool_last_recovery_seconds", g.last_recovery_seconds),
    )
    for name, value in optional:
        if value is not None and math.isfinite(value):
            values[name] = [("", value)]
    phases = [
        (f'{{phase="{phase}"}}', s)
        for phase, s in g.last_recovery_phases.items()
        if math.isfinite(s)
    ]
    if phases:
        values["deadpool_last_recovery_phase_seconds"] = phases
    lines = []
    for name, (kind, help_text) in METRICS.items():
        if name not in values:
            continue
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{labels} {_number(v)}" for labels, v in values[name]]
    return "\n".join(lines) + "\n"


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` as the textfile convention asks: a temporary file in the same folder,
    renamed over `path` (a reader sees the old file or the new one, never half of one)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class MetricsFile:
    """The latest `JobGauges` of a job, written to `path` at each update (thread-safe: the
    coordinator's events come from its own thread)."""

    def __init__(self, path: str | Path, spares: int) -> None:
        self.path = Path(path)
        self.gauges = JobGauges(spares_available=spares)
        self.deficit = ReplicaDeficit()
        self._lock = threading.Lock()
        self.write()

    def update(self, **changes: Any) -> None:
        """Apply `changes` (fields of `JobGauges`) and rewrite the file."""
        with self._lock:
            self.gauges = replace(self.gauges, **changes)
            write_atomically(self.path, render(self.gauges))

    def write(self) -> None:
        with self._lock:
            write_atomically(self.path, render(self.gauges))

    def on_event(self, entry: Mapping[str, Any]) -> None:
        """An `EventLog` listener: recoveries, respawns, spares lost, out of redundancy, the
        shards a failure took copies of."""
        kind = entry.get("event")
        if self.deficit.on_event(entry):
            self.update(under_replicated_shards=self.deficit.count)
        if kind == "recovered":
            g = self.gauges
            self.update(
                recoveries_total=g.recoveries_total + 1,
                respawns_total=g.respawns_total + len(entry.get("respawned") or {}),
                last_recovery_seconds=entry.get("total_s"),
                last_recovery_phases=dict(entry.get("phases_s") or {}),
                generation=entry.get("generation", g.generation),
            )
        elif kind == "out_of_redundancy":
            self.update(out_of_redundancy=True)

    def on_record(self, record: Mapping[str, Any]) -> None:
        """Rank 0's iteration record (`messages.IterationRecord` as a dict)."""
        generation = record.get("generation", self.gauges.generation)
        committed = record.get("committed_iteration")
        self.deficit.on_committed(generation, committed)
        self.update(
            iteration=record.get("iteration"),
            committed_iteration=committed,
            replica_bytes_per_iteration=record.get("replica_bytes_sent"),
            generation=generation,
            under_replicated_shards=self.deficit.count,
        )

    def on_progress(self, progress: Progress) -> None:
        """Rank 0's `Progress` (any job; what a Megatron-LM job reports), when it is news."""
        g = self.gauges
        if (progress.iteration, progress.generation) == (g.iteration, g.generation) and (
            progress.committed_iteration == g.committed_iteration
        ):
            return
        self.on_record(
            {
                "iteration": progress.iteration,
                "generation": progress.generation,
                "committed_iteration": progress.committed_iteration,
                "replica_bytes_sent": progress.replica_bytes,
            }
        )


def watch_events(events: EventLog, path: str | Path, spares: Callable[[], int]) -> MetricsFile:
    """A `MetricsFile` at `path` rewritten at each of `events`' entries from now on, with the
    spares `spares()` counts then."""
    metrics = MetricsFile(path, spares())

    def listener(entry: dict[str, Any]) -> None:
        metrics.on_event(entry)
        metrics.update(spares_available=spares())

    events.listeners.append(listener)
    return metrics


def follow_progress(
    metrics: MetricsFile | None, read: Callable[[], Progress | None], every_s: float = 0.5
) -> Callable[[], None]:
    """A function for a supervision loop's ticks: at most every `every_s` seconds, rank 0's
    `Progress` (`read()`, `Membership.progress_record`) into `metrics` (None: nothing to do)."""
    next_look = [0.0]

    def tick() -> None:
        if metrics is None or time.monotonic() < next_look[0]:
            return
        next_look[0] = time.monotonic() + every_s
        progress = read()
        if progress is not None:
            metrics.on_progress(progress)

    return tick
