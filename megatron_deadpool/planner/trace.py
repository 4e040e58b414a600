"""Failure traces for `deadpool plan --trace`: a documented file format, the bundled traces and
a synthetic trace at a chosen rate (pure: no torch, no communication).

A trace is a CSV file (UTF-8). Lines starting with ``#`` are comments, except ``# key: value``
lines before the header, which set the trace's metadata:

    # deadpool failure trace v1
    # duration_h: 1296          the span the trace covers, in hours (required)
    # gpus: 16384               GPUs of the job it was recorded on (informational)
    # source: The Llama 3 Herd of Models, Table 5
    time_h,cause,scope,permanent
    0.62,Faulty GPU,process,yes
    3.10,Software Bug,process,no
    5.47,Network Switch/Cable,node,yes

one row per interruption:
- ``time_h``: hours from the start of the trace, a finite number in [0, duration_h);
- ``cause``: free text, what failed (reported per cause);
- ``scope``: what the failure does to the job - ``process`` (one training process ends, its
  node still up), ``node`` (a whole node is lost: its processes fall silent) or ``hang`` (a
  process stops answering; found by a timeout);
- ``permanent``: ``yes`` when the node cannot host the job again during the run (a GPU that
  must be drained, a dead NIC, a node taken for repair), ``no`` when a new process can start
  on the same node (a software bug, a timeout). A permanent failure needs a spare; a
  transient process failure can be respawned in place.

`load_trace(spec)` reads a path, a bundled trace by name (``llama3``, see `BUNDLED`) or a
synthetic trace ``synthetic:per_day=R[,days=D][,seed=S][,gpus=N]``: R interruptions per day
(a Poisson process, seeded), their causes, scopes and permanence drawn from Llama 3's mix.
Bad input raises `ConfigError` naming the file, line and field.
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import ConfigError

SCOPES = ("process", "node", "hang")
FORMAT_LINE = "# deadpool failure trace v1"
HEADER = ("time_h", "cause", "scope", "permanent")
BUNDLED = {"llama3": "llama3-405b-54d.csv"}
"""Bundled traces (package data under megatron_deadpool/planner/traces/) by name."""
LLAMA3_CAUSES: tuple[tuple[str, str, int, str, bool], ...] = (
    # (cause, the paper's category, interruptions, scope, permanent)
    ("Faulty GPU", "GPU", 148, "process", True),
    ("GPU HBM3 Memory", "GPU", 72, "process", True),
    ("Software Bug", "Dependency", 54, "process", False),
    ("Network Switch/Cable", "Network", 35, "node", True),
    ("Host Maintenance", "Unplanned Maintenance", 32, "node", True),
    ("GPU SRAM Memory", "GPU", 19, "process", True),
    ("GPU System Processor", "GPU", 17, "process", True),
    ("NIC", "Host", 7, "node", True),
    ("NCCL Watchdog Timeouts", "Unknown", 7, "hang", False),
    ("Silent Data Corruption", "GPU", 6, "process", True),
    ("GPU Thermal Interface + Sensor", "GPU", 6, "process", True),
    ("SSD", "Host", 3, "node", True),
    ("Power Supply", "Host", 3, "node", True),
    ("Server Chassis", "Host", 2, "node", True),
    ("IO Expansion Board", "Host", 2, "node", True),
    ("Dependency", "Dependency", 2, "process", False),
    ("CPU", "Host", 2, "node", True),
    ("System Memory", "Host", 2, "node", True),
)
"""Llama 3 405B's 419 unexpected interruptions in a 54-day snapshot of pre-training on 16,384
H100 GPUs, by root cause: "The Llama 3 Herd of Models" (Meta, arXiv 2407.21783), Section
3.3.4, Table 5 (counts as published). The scope and permanence are this planner's reading of
each cause (the paper gives causes only): a GPU fault ends its process and takes the GPU out of
service (permanent: the node is drained); software bugs and dependencies end a process that can
start again in place; network, host and maintenance faults lose the node; NCCL watchdog
timeouts are hangs."""
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384


@dataclass(frozen=True)
class Interruption:
    """One row of a trace."""

    time_h: float
    """Hours from the trace's start."""

    cause: str
    """What failed."""

    scope: str
    """process, node or hang."""

    permanent: bool
    """The node cannot host the job again during the run."""


@dataclass(frozen=True)
class Trace:
    """A failure trace: its span and its interruptions in time order."""

    name: str
    """Where it came from (path, bundled name or synthetic spec)."""

    duration_h: float
    """Hours the trace covers."""

    interruptions: tuple[Interruption, ...]
    """In time order."""

    gpus: int | None = None
    """GPUs of the job it was recorded on, when known."""

    source: str = ""
    """Citation or how it was made."""

    def by_cause(self) -> dict[str, int]:
        """Interruptions per cause, most frequent first."""
        return dict(Counter(i.cause for i in self.interruptions).most_common())

    def count(self, *, scope: str | None = None, permanent: bool | None = None) -> int:
        """Interruptions of `scope` (any when None) and permanence (any when None)."""
        return sum(
            1
            for i in self.interruptions
            if (scope is None or i.scope == scope)
            and (permanent is None or i.permanent == permanent)
        )


def parse_trace(text: str, name: str) -> Trace:
    """A trace from the text of a trace file (module docstring); `ConfigError` naming `name`,
    the line and the field on bad input."""
    meta: dict[str, str] = {}
    lines = text.splitlines()
    body_start = None
    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            key, sep, value = stripped[1:].partition(":")
            if sep and key.strip().isidentifier():
                meta[key.strip()] = value.strip()
            continue
        body_start = n
        break
    if body_start is None:
        raise ConfigError(f"--trace {name}: no header line 'time_h,cause,scope,permanent'")
    rows = list(csv.reader(io.StringIO("\n".join(lines[body_start - 1 :]))))
    header = tuple(cell.strip() for cell in rows[0])
    if header != HEADER:
        raise ConfigError(
            f"--trace {name}: line {body_start}: the header must be {','.join(HEADER)}, got "
            f"{','.join(header)!r}"
        )
    duration = _number(meta.get("duration_h"), f"--trace {name}: '# duration_h:'")
    if duration <= 0:
        raise ConfigError(f"--trace {name}: '# duration_h:' must be > 0 hours, got {duration:g}")
    gpus: int | None = None
    if "gpus" in meta:
        count = _number(meta["gpus"], f"--trace {name}: '# gpus:'")
        if count < 1 or count != int(count):
            raise ConfigError(f"--trace {name}: '# gpus:' must be an integer >= 1")
        gpus = int(count)
    out: list[Interruption] = []
    for offset, row in enumerate(rows[1:], 1):
        n = body_start + offset
        if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
            continue
        where = f"--trace {name}: line {n}"
        if len(row) != len(HEADER):
            raise ConfigError(f"{where}: expected 4 fields (time_h,cause,scope,permanent)")
        time_h = _number(row[0], f"{where}: time_h")
        if not 0 <= time_h < duration:
            raise ConfigError(
                f"{where}: time_h {time_h:g} is outside the trace [0, duration_h {duration:g})"
            )
        cause, scope, permanent = row[1].strip(), row[2].strip(), row[3].strip().lower()
        if not cause:
            raise ConfigError(f"{where}: cause is empty")
        if scope not in SCOPES:
            raise ConfigError(f"{where}: scope {scope!r} is not one of {', '.join(SCOPES)}")
        if permanent not in ("yes", "no"):
            raise ConfigError(f"{where}: permanent {row[3].strip()!r} is not yes or no")
        out.append(Interruption(time_h, cause, scope, permanent == "yes"))
    out.sort(key=lambda i: i.time_h)
    return Trace(name, duration, tuple(out), gpus, meta.get("source", ""))


def _number(text: str | None, where: str) -> float:
    if text is None:
        raise ConfigError(f"{where} is missing: give the trace's span, e.g. '# duration_h: 720'")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {text.strip()!r}")
    return value


def format_trace(trace: Trace) -> str:
    """The trace as a trace file's text (`parse_trace` reads it back)."""
    lines = [FORMAT_LINE, f"# duration_h: {trace.duration_h:g}"]
    if trace.gpus is not None:
        lines.append(f"# gpus: {trace.gpus}")
    if trace.source:
        lines.append(f"# source: {trace.source}")
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(HEADER)
    for i in trace.interruptions:
        writer.writerow([f"{i.time_h:.3f}", i.cause, i.scope, "yes" if i.permanent else "no"])
    return "\n".join(lines) + "\n" + buf.getvalue()


def llama3_trace(seed: int = 2024) -> Trace:
    """Llama 3's 419 interruptions (`LLAMA3_CAUSES`) at times drawn uniformly over the 54 days
    (the paper gives counts per cause, not times): how the bundled file was made."""
    rng = random.Random(seed)
    causes = [c for c in LLAMA3_CAUSES for _ in range(c[2])]
    rng.shuffle(causes)
    hours = LLAMA3_DAYS * 24
    times = sorted(round(rng.uniform(0, hours), 3) for _ in causes)
    rows = tuple(
        Interruption(min(t, hours - 0.001), c[0], c[3], c[4]) for t, c in zip(times, causes)
    )
    source = (
        "The Llama 3 Herd of Models (arXiv 2407.21783), Table 5: 419 unexpected interruptions "
        "of 405B pre-training in a 54-day snapshot on 16,384 H100; counts per cause as "
        "published, scope/permanent read from each cause, times uniform (seed "
        f"{seed}): the paper gives none"
    )
    return Trace("llama3", float(hours), rows, LLAMA3_GPUS, source)


def synthetic_trace(spec: str) -> Trace:
    """`synthetic:per_day=R[,days=D][,seed=S][,gpus=N]`: a Poisson process of R interruptions
    per day over D days (default 30), causes drawn from Llama 3's mix."""
    values = {"days": 30.0, "seed": 0.0}
    given = spec.partition(":")[2]
    for part in filter(None, (p.strip() for p in given.split(","))):
        key, _, text = part.partition("=")
        if key not in ("per_day", "days", "seed", "gpus"):
            raise ConfigError(
                f"--trace {spec}: unknown key {key!r}; use synthetic:per_day=R[,days=D]"
                "[,seed=S][,gpus=N], e.g. synthetic:per_day=8,days=54"
            )
        values[key] = _number(text, f"--trace {spec}: {key}")
    if "per_day" not in values:
        raise ConfigError(f"--trace {spec}: give the rate, e.g. synthetic:per_day=8,days=54")
    rate, days = values["per_day"], values["days"]
    if not 0 <= rate <= 1e5 or not 0 < days <= 3650:
        raise ConfigError(f"--trace {spec}: per_day must be in [0, 100000] and days in (0, 3650]")
    gpus = values.get("gpus")
    if gpus is not None and (gpus < 1 or gpus != int(gpus)):
        raise ConfigError(f"--trace {spec}: gpus must be an integer >= 1")
    rng = random.Random(int(values["seed"]))
    hours, t, rows = days * 24, 0.0, []
    weights = [c[2] for c in LLAMA3_CAUSES]
    while rate > 0:
        t += rng.expovariate(rate / 24)
        if t >= hours:
            break
        cause = rng.choices(LLAMA3_CAUSES, weights=weights)[0]
        rows.append(Interruption(t, cause[0], cause[3], cause[4]))
    return Trace(
        spec,
        hours,
        tuple(rows),
        None if gpus is None else int(gpus),
        f"synthetic: {rate:g} interruptions per day over {days:g} days, Llama 3's causes",
    )


def load_trace(spec: str) -> Trace:
    """A trace from a path, a bundled name (`BUNDLED`) or a synthetic spec."""
    if spec.startswith("synthetic:") or spec == "synthetic":
        return synthetic_trace(spec)
    if spec in BUNDLED:
        text = resources.files(__package__).joinpath("traces", BUNDLED[spec]).read_text("utf-8")
        return parse_trace(text, spec)
    try:
        text = Path(spec).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"--trace {spec}: cannot read it ({exc.strerror}); give a trace file, "
            f"{', '.join(BUNDLED)} or synthetic:per_day=R"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"--trace {spec}: not a UTF-8 text file") from None
    return parse_trace(text, spec)
