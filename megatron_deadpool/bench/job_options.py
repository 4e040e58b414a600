"""What the benchmarks that launch the training job share: the job they measure and its options.

`deadpool bench overhead`, `recovery`, `goodput` and `paper` each run the job of `--config`
(else the CPU demo, else tp 2 x dp 2: `base_job`) for `--iters` iterations, each launch limited
by `--timeout`, and most keep their run folders on `--keep`; these options are written here once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config.job import JobConfig, ParallelConfig, load_job
from ..config.numbers import number_arg

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "cpu-demo.yaml"
"""The CPU demo job, used when no --config is given (and present in the source tree)."""
CONFIG_HELP = "YAML job config (default: configs/cpu-demo.yaml when present, else tp 2 x dp 2)"


def base_job(config: str | None) -> JobConfig:
    """The job to measure: --config, else the CPU demo, else the tp 2 x dp 2 default."""
    if config:
        return load_job(config)
    if DEFAULT_CONFIG.is_file():
        return load_job(DEFAULT_CONFIG)
    return JobConfig(parallel=ParallelConfig(tp=2, pp=1, dp=2))


def add_job_options(
    parser: argparse.ArgumentParser, *, iters: int, iters_help: str = "iterations per run"
) -> None:
    """--config (the job, `base_job`) and --iters (default `iters`)."""
    parser.add_argument("--config", help=CONFIG_HELP)
    parser.add_argument(
        "--iters",
        type=number_arg(integer=True, minimum=1),
        default=iters,
        help=f"{iters_help} (default {iters})",
    )


def add_run_limit(
    parser: argparse.ArgumentParser, *, timeout: float, per: str = "run", keep: bool = True
) -> None:
    """--timeout (the wall-clock limit of one `per`, default `timeout` seconds) and, with
    `keep`, --keep (the run logs and checkpoints)."""
    parser.add_argument(
        "--timeout",
        type=number_arg(above=0, unit="seconds"),
        default=timeout,
        help=f"wall-clock limit of one {per} in s (default {timeout:g})",
    )
    if keep:
        parser.add_argument("--keep", action="store_true", help="keep run logs and checkpoints")
