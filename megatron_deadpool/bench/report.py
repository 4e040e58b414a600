"""What the benchmarks' reports share: aligned text rows, Markdown tables, the JSON file and the
job's shape in it.

`bench overhead`, `bench recovery` and `bench paper` print their tables with `text_row`, render
Markdown with `markdown_table`, and write their results with `write_json` (`publish`: the
printed table, then the JSON).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..config.job import JobConfig


def text_row(cells: Sequence[str], specs: Sequence[str]) -> str:
    """`cells` padded by their format specs (`"<36"`, `">18"`), one space apart."""
    return " ".join(f"{cell:{spec}}" for cell, spec in zip(cells, specs, strict=True))


def markdown_row(cells: Sequence[str]) -> str:
    """`| a | b |`; an empty cell is `| |`."""
    return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """The header, the `|---|` line and the rows."""
    return [markdown_row(header), "|" + "---|" * len(header), *map(markdown_row, rows)]


def yes_no(flag: bool) -> str:
    return "yes" if flag else "NO"


def job_shape(job: JobConfig) -> dict[str, int]:
    """The parallel layout and DeadPool's replica count, as a result's `config` starts."""
    p = job.parallel
    return {
        "tp": p.tp,
        "pp": p.pp,
        "dp": p.dp,
        "ranks_per_node": job.ranks_per_node,
        "replicas": job.deadpool.replicas,
    }


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    """`result` as indented JSON (what JSON cannot hold, as text)."""
    Path(path).write_text(json.dumps(result, indent=1, default=str) + "\n")


def publish(lines: Iterable[str], result: dict[str, Any], json_path: str | None) -> None:
    """Print `lines`; write `result` to `json_path`, if given, and say so."""
    for line in lines:
        print(line)
    if json_path:
        write_json(json_path, result)
        print(f"wrote {json_path}")
