"""`deadpool chaos`: a soak of the CPU demo under random failures, bounded in wall time.

    deadpool chaos --minutes 10 --mtbf-iters 8 [--seed 1] [--config configs/cpu-demo.yaml]
                   [--iters 40] [--kinds kill,hang,node] [--json soak.json]

Runs episodes until the time budget is spent (`chaos.soak`, which says what an episode is and
when a failure counts as recovered). Prints one line per episode and per recovery, then a
table; `--json` writes the figures. Exit code 0 when every episode matched and every injected
failure was recovered.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ..chaos.schedule import KINDS, parse_kinds, spares_needed
from ..chaos.soak import MIN_MINUTES, Soak, SoakSettings, print_table
from ..config.job import JobConfig, load_job
from ..config.numbers import number_arg
from ..config.paths import check_writable_dir, check_writable_file
from ..errors import ConfigError

DEFAULT_CONFIG = "configs/cpu-demo.yaml"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--minutes",
        type=number_arg(minimum=MIN_MINUTES, unit="minutes"),
        required=True,
        help=f"wall-time budget of the whole soak (at least {MIN_MINUTES:g}: a reference run "
        "and one episode)",
    )
    parser.add_argument(
        "--mtbf-iters",
        type=number_arg(minimum=1),
        required=True,
        metavar="K",
        help="mean iterations between failures (each iteration fails with probability 1/K)",
    )
    parser.add_argument(
        "--seed", type=number_arg(integer=True), default=1, help="seed of the failure plan"
    )
    parser.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"job config (default {DEFAULT_CONFIG})"
    )
    parser.add_argument(
        "--iters",
        type=number_arg(integer=True, minimum=1),
        default=40,
        help="iterations per episode (default 40)",
    )
    parser.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"failure kinds to draw from (default {','.join(KINDS)}): kill = one rank "
        "SIGKILLed, hang = one rank SIGSTOPped, node = a whole node killed or hung",
    )
    parser.add_argument(
        "--spares",
        "--spare-ranks",
        dest="spares",
        type=number_arg(integer=True, minimum=0),
        help="spare ranks (processes) in the pool (default: the config's, at least the largest failure's ranks)",
    )
    parser.add_argument(
        "--episodes",
        type=number_arg(integer=True, minimum=1),
        help="stop after this many episodes",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=number_arg(above=0, unit="seconds"),
        default=3.0,
        help="seconds of silence that make a rank hung (default 3: hangs are cheap to find)",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=number_arg(above=0, unit="seconds"),
        default=0.5,
        help="heartbeat period (default 0.5)",
    )
    parser.add_argument("--run-dir", help="directory for every run's logs (default: a temp dir)")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="write the figures here")


def _config_path(text: str) -> str:
    p = Path(text)
    if not p.is_file() and not p.is_absolute():
        packaged = Path(__file__).resolve().parents[2] / text
        if packaged.is_file():
            return str(packaged)
    return text


def _job(args: argparse.Namespace, kinds: tuple[str, ...]) -> JobConfig:
    job = load_job(_config_path(args.config))
    if not job.deadpool.enabled:
        raise ConfigError(f"chaos: {args.config} turns DeadPool off (deadpool.enabled: false)")
    need = spares_needed(kinds, job.ranks_per_node)
    spares = args.spares if args.spares is not None else max(job.deadpool.spares, need)
    deadpool = job.deadpool.replace(
        spares=spares,
        fail=[],
        ranks_per_node=job.ranks_per_node,
        heartbeat_timeout=args.heartbeat_timeout,
        heartbeat_interval=args.heartbeat_interval,
        log_dir=None,
    )
    train = dataclasses.replace(job.train, iters=args.iters, save=None, save_interval=0, load=None)
    return dataclasses.replace(job, train=train, deadpool=deadpool)


def run(args: argparse.Namespace) -> int:
    kinds = parse_kinds(args.kinds)
    if args.run_dir:
        check_writable_dir(args.run_dir, "--run-dir")
    if args.json_path:
        check_writable_file(args.json_path, "--json")
    settings = SoakSettings(
        seed=args.seed,
        mtbf_iters=args.mtbf_iters,
        minutes=args.minutes,
        config=args.config,
        episodes=args.episodes,
        run_dir=args.run_dir,
    )
    report = Soak(_job(args, kinds), kinds, settings).run()
    print_table(report)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    ok = (
        report["episodes"] > 0
        and report["digest_equal"]
        and report["failures_recovered"] == report["failures_injected"]
        and not report["episodes_failed"]
    )
    return 0 if ok else 1
