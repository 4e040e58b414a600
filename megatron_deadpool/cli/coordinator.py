"""`deadpool coordinator`: the coordinator as its own process, for Slurm clusters.

It hosts the job's store on HOST:PORT, publishes the first roster (ranks 0..W-1 are the
initial actives `a{r}`, the next S tasks are spares `s{i}`), watches heartbeats, assigns
spares and drives agreement (see `coordinator.py`), and writes the event log. It exits 0 once
every active rank has finished, 1 when a failure ran out of redundancy. Workers find it with
`--deadpool-coordinator HOST:PORT` and must present the same job token
(`--deadpool-job-token` or `DEADPOOL_JOB_TOKEN`).
"""

from __future__ import annotations

import argparse
import os
import secrets
import time
from pathlib import Path

from ..config.deadpool import DeadpoolConfig
from ..config.flags import field_docs
from ..config.job import load_job
from ..digest import final_digest
from ..errors import ConfigError
from ..hotswap.coordinator import Coordinator, EventLog, HeartbeatOnly
from ..hotswap.membership import Membership, host_store
from ..logs import setup_logging
from ..replication.placement import Layout

# The job's settings the coordinator needs, under the workers' flag names.
_JOB_TIMEOUTS = ("heartbeat_interval", "heartbeat_timeout", "agree_timeout", "pg_timeout")
_ALIASES = {"heartbeat_timeout": ["--heartbeat-timeout"], "agree_timeout": ["--agree-timeout"]}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default loopback only)"
    )
    parser.add_argument("--port", type=int, default=29400, help="store port")
    parser.add_argument("--world-size", type=int, required=True, help="active ranks (tp*pp*dp)")
    parser.add_argument("--spares", type=int, default=0, help="spare ranks started with the job")
    parser.add_argument("--log-dir", help="directory for events.jsonl")
    parser.add_argument("--job-token", help="job token (default: $DEADPOOL_JOB_TOKEN or new)")
    parser.add_argument(
        "--config", help="the embedded job's YAML: its deadpool: section sets the flags below"
    )
    docs = field_docs(DeadpoolConfig)
    for name in _JOB_TIMEOUTS:
        flag = "--deadpool-" + name.replace("_", "-")
        parser.add_argument(
            flag, *_ALIASES.get(name, []), dest=name, type=float, help=f"the job's {docs[name]}"
        )
    parser.add_argument(
        "--max-wait", type=float, default=7 * 24 * 3600, help="give up after this many seconds"
    )


def run(args: argparse.Namespace) -> int:
    if args.world_size < 1:
        raise ConfigError("world-size: must be >= 1")
    if args.spares < 0:
        raise ConfigError("spares: must be >= 0")
    if not 0 < args.port < 65536:
        raise ConfigError("port: must be in 1-65535")
    cfg = _job_settings(args)
    setup_logging()
    token = args.job_token or os.environ.get("DEADPOOL_JOB_TOKEN") or secrets.token_hex(16)
    try:
        # `listener` must outlive the store: it is the socket the store serves on.
        store, _listener = host_store(args.host, args.port)  # listens on --host only
    except (RuntimeError, OSError) as exc:
        raise ConfigError(f"host/port: cannot listen on {args.host}:{args.port} ({exc})") from None
    members = Membership(store, "coordinator")
    members.set_token(token)
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    coord = Coordinator(
        members,
        args.world_size,
        None,  # the layout arrives from rank 0 (job/layout)
        [f"s{i}" for i in range(args.spares)],
        heartbeat_timeout=cfg.heartbeat_timeout,
        agree_timeout=cfg.agreement_timeout,
        suspect_after=cfg.suspect_after,
        liveness=HeartbeatOnly(),
        events=EventLog(log_dir / "events.jsonl" if log_dir else None),
        on_event=lambda text: print(f"deadpool coordinator: {text}", flush=True),
    )
    coord.start()
    settings = {name: getattr(cfg, name) for name in _JOB_TIMEOUTS}
    settings["agree_timeout"] = cfg.agreement_timeout
    coord.events("settings", **settings)
    print(
        f"deadpool coordinator: listening on {args.host}:{args.port}, world size "
        f"{args.world_size}, {args.spares} spare(s); "
        + ", ".join(f"{k.replace('_', ' ')} {v:g}s" for k, v in settings.items()),
        flush=True,
    )
    try:
        return _serve(coord, members, time.monotonic() + args.max_wait)
    finally:
        coord.close()


def _serve(coord: Coordinator, members: Membership, deadline: float) -> int:
    """Tick until every rank finished (0), memory ran out of redundancy (1) or `deadline`."""
    while time.monotonic() < deadline:
        coord.tick()
        if coord.aborted is not None:
            members.request_shutdown()
            return 1
        slots = list(coord.roster.slots.values())
        # The count first: one round trip per tick, whatever the size of the job.
        done = members.done_count() >= len(slots) and members.all_done(slots)
        if done and coord.recovery is None:
            members.request_shutdown()
            digest, ranks = _digests(members, coord.world)
            coord.events("finished", final_param_digest=digest, rank_digests=ranks)
            print(f"deadpool coordinator: every rank finished; digest {digest}", flush=True)
            time.sleep(2.0)  # let spares see the shutdown before the store goes away
            return 0
        coord.wait(0.05)
    print("deadpool coordinator: --max-wait reached", flush=True)
    return 1


def _job_settings(args: argparse.Namespace) -> DeadpoolConfig:
    """The job's timeouts: --config's deadpool: section < flags, checked as the workers do."""
    base = load_job(args.config).deadpool if args.config else DeadpoolConfig()
    flags = {name: getattr(args, name) for name in _JOB_TIMEOUTS}
    return base.replace(**{k: v for k, v in flags.items() if v is not None})


def _digests(members: Membership, world_size: int) -> tuple[str | None, dict[str, str]]:
    """The job's parameter digest as `deadpool train` reports it, and each rank's."""
    ranks = {r: d for r in range(world_size) if (d := members.digest(r)) is not None}
    layout = members.layout()
    if layout is None:
        return None, {str(r): d for r, d in ranks.items()}
    groups = Layout(layout["tp"], layout["pp"], layout["dp"], layout["ranks_per_node"]).dp_groups
    return final_digest(groups, ranks)[0], {str(r): d for r, d in ranks.items()}
