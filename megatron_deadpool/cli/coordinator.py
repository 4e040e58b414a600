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

from ..errors import ConfigError
from ..hotswap.coordinator import Coordinator, EventLog, HeartbeatOnly
from ..hotswap.membership import Membership, host_store
from ..logs import setup_logging


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default loopback only)"
    )
    parser.add_argument("--port", type=int, default=29400, help="store port")
    parser.add_argument("--world-size", type=int, required=True, help="active ranks (tp*pp*dp)")
    parser.add_argument("--spares", type=int, default=0, help="spare ranks started with the job")
    parser.add_argument("--log-dir", help="directory for events.jsonl")
    parser.add_argument("--job-token", help="job token (default: $DEADPOOL_JOB_TOKEN or new)")
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0)
    parser.add_argument("--agree-timeout", type=float, default=60.0)
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
        heartbeat_timeout=args.heartbeat_timeout,
        agree_timeout=args.agree_timeout,
        liveness=HeartbeatOnly(),
        events=EventLog(log_dir / "events.jsonl" if log_dir else None),
        on_event=lambda text: print(f"deadpool coordinator: {text}", flush=True),
    )
    coord.start()
    print(
        f"deadpool coordinator: listening on {args.host}:{args.port}, world size "
        f"{args.world_size}, {args.spares} spare(s)",
        flush=True,
    )
    deadline = time.monotonic() + args.max_wait
    while time.monotonic() < deadline:
        coord.tick()
        if coord.aborted is not None:
            members.request_shutdown()
            return 1
        done = members.all_done(list(coord.roster.slots.values()))
        if done and coord.recovery is None:
            members.request_shutdown()
            print("deadpool coordinator: every rank finished", flush=True)
            time.sleep(2.0)  # let spares see the shutdown before the store goes away
            return 0
        time.sleep(0.05)
    print("deadpool coordinator: --max-wait reached", flush=True)
    return 1
