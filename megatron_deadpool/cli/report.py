"""`deadpool report RUN_DIR [--json-log FILE] [--plot FILE]`: a run's timeline.

Reads what a run left in its folder (`deadpool train --run-dir`, `deadpool megatron-lm
--run-dir`, a Slurm job's --deadpool-log-dir): the coordinator's events, the spares it started
with, and rank 0's iteration records (`iterations.jsonl`, which `deadpool train` writes into its
run folder, or the file `--json-log` names). Prints the failures,
recoveries with their phases and the spares left as a table; `--plot` draws them with the
committed iteration as a PNG (matplotlib, the `plots` extra).
"""

from __future__ import annotations

import argparse

from ..config.paths import check_writable_file


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (its events.jsonl)")
    parser.add_argument(
        "--json-log",
        help="the run's per-iteration records (deadpool train --json-log; default: RUN_DIR's "
        "iterations.jsonl, which deadpool train writes)",
    )
    parser.add_argument("--plot", metavar="FILE", help="draw the timeline into this PNG")


def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..hotswap.report.timeline import read_timeline, table

    if args.json_log is not None:
        import os

        if not os.path.isfile(args.json_log):
            raise ConfigError(f"--json-log: {args.json_log} is not a file")
    if args.plot:
        check_writable_file(args.plot, "--plot")
    tl = read_timeline(args.run_dir, args.json_log)
    print(table(tl))
    if args.plot:
        from ..bench.timeline_plot import draw_timeline

        draw_timeline(tl, args.plot)
        print(f"plot: {args.plot}")
    return 0
