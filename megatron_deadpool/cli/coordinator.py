"""`deadpool coordinator`: the coordinator as its own process, for Slurm clusters.

    deadpool coordinator --world-size W --deadpool-coordinator HOST:PORT[,HOST:PORT...] \\
        [--standby [N]] [--config JOB.yaml] [--deadpool-* flags of the job]

The primary (the first entry of `--deadpool-coordinator`) hosts the job's store there,
publishes the first roster (ranks 0..W-1 are the initial actives `a{r}`, the next
`--deadpool-spares` tasks are spares `s{i}`), watches heartbeats, assigns spares and drives
agreement (`hotswap/coordinator/coordinator.py`), and writes the event log (`--deadpool-log-dir`). With
`--standby` this process is entry N (default 1) instead: it watches the coordinators before it
and takes the job over when they are lost (`hotswap/coordinator/standby.py`). Both take the job's own
settings - its YAML's `deadpool:` section, then the same `--deadpool-*` flags the workers get -
and workers must hold the same job secret: in the environment (`DEADPOOL_JOB_TOKEN`) or in a
file only its owner can read (`DEADPOOL_JOB_TOKEN_FILE`, mode 0600), never on a command line;
it seals every value of the store (`hotswap/protocol/seal.py`) and is never stored itself.

Exit codes: 0 every rank finished (this coordinator ended the job); 3 out of redundancy (the
survivors saved what they held); 4 a standby found no coordinator of the job to watch; 5 not the
job's coordinator (a standby the job never needed, or a primary a standby took over from);
6 `--max-wait` reached; 9 the job's own error (a rank's exception before replication started, or
a spare failing as the rank it replaced did: it prints `JOB ERROR: ...` and the end of that
rank's traceback). A launcher ends the job on 0, 3, 6 and 9 (`scripts/slurm`).
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from ..config.deadpool import DeadpoolConfig, parse_host_port
from ..config.flags import add_flags, dest_name
from ..config.job import load_job
from ..config.numbers import number_arg
from ..config.paths import check_writable_dir, check_writable_file
from ..digest import final_digest
from ..errors import ConfigError, CoordinatorUnreachableError, ExitCode
from ..hotswap.coordinator.coordinator import Coordinator
from ..hotswap.coordinator.events import EventLog, job_id
from ..hotswap.coordinator.liveness import AgentExits, HeartbeatOnly
from ..hotswap.coordinator.node_agents import StoreAgents
from ..hotswap.coordinator.settings import CoordinatorSettings
from ..hotswap.coordinator.standby import Standby, StandbyWatch
from ..hotswap.launch.silent_connections import SilentConnections
from ..hotswap.launch.supervisor import CoordinatorOnly, Supervisor
from ..hotswap.protocol.coordinator_view import CoordinatorView
from ..hotswap.protocol.membership import host_store
from ..hotswap.protocol.messages import CoordinatorIdentity, JobError
from ..hotswap.protocol.seal import SECRET_ENV, SECRET_FILE_ENV, JobSeal, job_binding, job_secret
from ..hotswap.protocol.sealed_store import SealedStore
from ..hotswap.protocol.store_files import reserve_files, store_files_needed
from ..hotswap.report.job_status import publish_status
from ..hotswap.report.metrics_file import follow_progress, watch_events
from ..logs import setup_logging


def configure(parser: argparse.ArgumentParser) -> None:
    add_world_size(parser)
    parser.add_argument(
        "--standby",
        type=int,
        nargs="?",
        const=1,
        default=0,
        metavar="N",
        help="be entry N (default 1) of --deadpool-coordinator: a standby that takes the job "
        "over once the coordinators before it were silent for the heartbeat timeout",
    )
    add_job_settings(parser)
    parser.add_argument(
        "--max-wait",
        type=number_arg(above=0, unit="seconds"),
        default=7 * 24 * 3600,
        help="give up after this many seconds",
    )


def add_world_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-size",
        type=number_arg(integer=True, minimum=1),
        required=True,
        help="active ranks (tp*pp*dp)",
    )


def add_job_settings(parser: argparse.ArgumentParser) -> None:
    """`--config` and every `--deadpool-*` flag, as the workers get them (`job_settings`)."""
    parser.add_argument(
        "--config", help="the embedded job's YAML: its deadpool: section sets the defaults"
    )
    group = parser.add_argument_group("the job's DeadPool settings (as the workers get them)")
    add_flags(
        group,
        DeadpoolConfig,
        prefix="deadpool",
        defaults={f.name: None for f in dataclasses.fields(DeadpoolConfig)},
    )


def job_settings(args: argparse.Namespace) -> DeadpoolConfig:
    """The job's settings: defaults < --config's deadpool: section < --deadpool-* flags."""
    base = load_job(args.config).deadpool if args.config else DeadpoolConfig()
    flags = {
        f.name: getattr(args, dest_name("deadpool", f.name))
        for f in dataclasses.fields(DeadpoolConfig)
    }
    return base.replace(**{k: v for k, v in flags.items() if v is not None})


def role_name(standby: int) -> str:
    """What this process serves as, in messages."""
    return "standby" if standby else "coordinator"


def run(args: argparse.Namespace) -> int:
    cfg = job_settings(args)
    addresses = cfg.coordinators
    if not addresses:
        raise ConfigError(
            "deadpool-coordinator: give the coordinators' HOST:PORT[,HOST:PORT...] (the primary "
            "first): this process serves one of them"
        )
    if not 0 <= args.standby < len(addresses):
        raise ConfigError(
            f"standby: entry {args.standby} of deadpool-coordinator does not exist (it lists "
            f"{len(addresses)}); a standby needs the primary's address before its own"
        )
    # In-place respawn needs every node's `deadpool agent` and where each node's ranks are:
    # asked for by name without the latter, refused; not asked for, off (every failure a spare).
    if args.deadpool_respawn_limit and cfg.ranks_per_node is None:
        raise ConfigError(
            "deadpool-respawn-limit: needs --deadpool-ranks-per-node (the processes each node's "
            "`deadpool agent` starts)"
        )
    if cfg.join:
        raise ConfigError(
            "deadpool-join: is for a worker joining a running job, not its coordinator; drop "
            "the flag here"
        )
    address = addresses[args.standby]
    host, port = parse_host_port(address, "deadpool-coordinator")
    if cfg.log_dir:
        check_writable_dir(cfg.log_dir, "--deadpool-log-dir")
    if cfg.metrics_file:
        check_writable_file(cfg.metrics_file, "--deadpool-metrics-file")
    secret = job_secret(cfg.job_token)
    if not secret:  # one of its own would match no worker's: every one would be refused
        whose = "the primary's" if args.standby else "the one its workers are given"
        raise ConfigError(
            f"deadpool-job-token: the {role_name(args.standby)} needs the job's secret ({whose}): "
            f"set {SECRET_ENV} or {SECRET_FILE_ENV}"
        )
    seal = JobSeal(secret, job_binding(), store=args.standby)  # this store's own (`seal.py`)
    role = role_name(args.standby)
    need = store_files_needed(args.world_size, cfg.spares)
    reserve_files(
        need, f"deadpool {role} (the store of {args.world_size} ranks and {cfg.spares} spare(s))"
    )
    setup_logging()
    silent = SilentConnections(need)
    try:  # on that host only; silent connections watched from the moment it listens
        store = host_store(host, port, keepalive_s=cfg.store_keepalive, on_listen=silent.watch)
    except (RuntimeError, OSError) as exc:
        raise ConfigError(f"deadpool-coordinator: cannot listen on {address} ({exc})") from None

    def say(text: str) -> None:
        print(f"deadpool {role}: {text}", flush=True)

    membership = CoordinatorView(SealedStore(store, role, seal))
    log_dir = Path(cfg.log_dir) if cfg.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    events = EventLog(log_dir / "events.jsonl" if log_dir else None, job=job_id(secret))
    events(
        "settings",
        role=role,
        address=address,
        heartbeat_interval=cfg.heartbeat_interval,
        heartbeat_timeout=cfg.heartbeat_timeout,
        agree_timeout=cfg.agreement_timeout,
        join_timeout=cfg.join_timeout,
        pg_timeout=cfg.pg_timeout,
    )
    agents, exits = None, AgentExits(membership)
    # Whether the nodes run `deadpool agent` is not for this process to see: it respawns
    # through them when told a limit by name (deadpool_launch.sh always tells one, 0 included).
    if args.deadpool_respawn_limit and cfg.ranks_per_node is not None:
        agents = StoreAgents(
            membership,
            world_size=args.world_size,
            processes=args.world_size + cfg.spares,
            ranks_per_node=cfg.ranks_per_node,
            beat_s=cfg.heartbeat_interval,
            exits=exits,
        )
    coord = Coordinator.from_settings(  # the layout arrives from rank 0 (job/layout)
        CoordinatorSettings.of(cfg, args.world_size, cfg.spares, suspect_after=cfg.suspect_after),
        membership,
        liveness=HeartbeatOnly() if agents is None else exits,
        events=events,
        say=say,
        agents=agents,
    )
    metrics = (
        watch_events(events, cfg.metrics_file, lambda: len(coord.spares))
        if cfg.metrics_file
        else None
    )
    progress = follow_progress(metrics, coord.membership.progress_record)  # committed iteration
    say(
        f"listening on {address}, world size {args.world_size}, {cfg.spares} spare(s); "
        f"heartbeat interval {cfg.heartbeat_interval:g}s, timeout {cfg.heartbeat_timeout:g}s, "
        f"agreement timeout {cfg.agreement_timeout:g}s, pg timeout {cfg.pg_timeout:g}s"
    )
    deadline = time.monotonic() + args.max_wait
    try:
        return _run(args, cfg, coord, deadline, events, say, progress)
    finally:
        silent.stop()
        coord.close()


def _run(
    args: argparse.Namespace,
    cfg: DeadpoolConfig,
    coord: Coordinator,
    deadline: float,
    events: EventLog,
    say: Callable[[str], None],
    progress: Callable[[], None],
) -> int:
    """Serve as the primary, or as a standby once it took the job over (`progress`: each tick);
    the exit code."""
    if args.standby:
        membership = coord.membership
        standby = Standby(cfg, args.standby, args.world_size, membership, events, say)
        try:
            while True:
                if not standby.wait_for_loss():
                    return ExitCode.NOT_ACTIVE
                state = standby.take_over()
                if state is not None:
                    break
        except CoordinatorUnreachableError as exc:
            say(str(exc))
            return ExitCode.NO_COORDINATOR
        standby.hand_over(coord, state)
        publish_status(events, coord, standbys=len(cfg.coordinators) - 1 - args.standby)

        def each_tick() -> None:
            standby.late_registrations(coord)
            progress()

        return serve(coord, deadline, say, each_tick=each_tick)
    coord.membership.set_identity(CoordinatorIdentity(0, secrets.token_hex(8)))
    coord.membership.set_token()
    publish_status(events, coord, standbys=len(cfg.coordinators) - 1)
    coord.start()
    watch = None
    if len(cfg.coordinators) > 1:
        watch = StandbyWatch(cfg, coord.membership.seal, events, say)
        watch.start()
    return serve(coord, deadline, say, watch=watch, each_tick=progress)


def serve(
    coord: Coordinator,
    deadline: float,
    say: Callable[[str], None],
    *,
    watch: StandbyWatch | None = None,
    each_tick: Callable[[], None] = lambda: None,
) -> int:
    """Coordinate the job until it ends here (`hotswap.launch.supervisor`); the exit code."""

    def superseded() -> int | None:
        if watch is None or not watch.superseded:
            return None
        say(f"standby {watch.superseded} took the job over: standing down")
        return ExitCode.NOT_ACTIVE

    def finished() -> int:
        coord.membership.request_shutdown()
        digest, ranks = _digests(coord.membership, coord.world_size)
        coord.events("finished", final_param_digest=digest, rank_digests=ranks)
        say(f"every rank finished; digest {digest}")
        time.sleep(2.0)  # let spares and a standby see the shutdown before the store goes
        return ExitCode.OK

    def job_error(verdict: JobError) -> int:
        coord.membership.request_shutdown()  # waiting spares leave
        lines = "\n".join(f"    {verdict.report.member}| {line}" for line in verdict.report.tail)
        say(f"{verdict.report.member}'s traceback ends:\n{lines}")
        time.sleep(2.0)  # let spares see the shutdown before the store goes
        return ExitCode.JOB_ERROR

    code = Supervisor(
        CoordinatorOnly(coord, each_tick, deadline),
        limit_s=deadline - time.monotonic(),
        say=say,
        finished=finished,
        on_job_error=job_error,
        checks=[superseded],
        on_timeout=ExitCode.MAX_WAIT,
    ).run()
    if code == ExitCode.MAX_WAIT:
        say("--max-wait reached")
    return code


def _digests(membership: CoordinatorView, world_size: int) -> tuple[str | None, dict[str, str]]:
    """The job's parameter digest as `deadpool train` reports it (any member's digest stands for
    its group of ranks holding the same weights, `Layout.peer_groups`: a rank lost after
    training completed costs none), and each rank's."""
    ranks = {r: d for r in range(world_size) if (d := membership.digest(r)) is not None}
    record = membership.layout()
    if record is None:
        return None, {str(r): d for r, d in ranks.items()}
    groups = record.layout().peer_groups  # with experts: the ranks holding the same ones
    return final_digest(groups, ranks)[0], {str(r): d for r, d in ranks.items()}
