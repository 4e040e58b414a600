"""`DeadpoolConfig`: the single source of every `--deadpool-*` flag and YAML `deadpool:` key.

Megatron-LM's `extra_args_provider`, the `deadpool train` CLI and the YAML configs are all
generated from / validated against this dataclass (see `flags.py`), the way Megatron-LM turns
its config dataclasses into arguments. Every field has a docstring below it: that text is the
flag's help.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ..errors import ConfigError
from .faults import parse_fault
from .numbers import check_number

SECONDS = (
    "heartbeat_interval",
    "heartbeat_timeout",
    "agree_timeout",
    "pg_timeout",
    "abort_timeout",
    "connect_timeout",
    "join_timeout",
    "respawn_window",
)
"""`DeadpoolConfig`'s durations: each a finite number of seconds > 0 (the optional ones: or
unset)."""
OPTIONAL_SECONDS = ("agree_timeout", "abort_timeout")


@dataclass(kw_only=True)
class DeadpoolConfig:
    """Settings of replication, failure detection and hot swap.

    Words: a *spare rank* (the field `spares`, --deadpool-spare-ranks, the YAML key
    `spare_ranks`) is one spare process, which takes one failed rank's slot; a *spare node*
    (the Slurm scripts' SPARE_NODES, the selftest's --spare-nodes) is a whole node of them (its
    ranks per node spare ranks)."""

    # Fields whose flag and YAML key say more than the field's name (--deadpool-spares and the
    # key `spares` still accepted, the key with a warning).
    FLAG_NAMES: ClassVar[dict[str, str]] = {"spares": "spare-ranks"}

    enabled: bool = False
    """Turn DeadPool on: per-iteration in-memory replication of optimizer shards and hot swap."""

    spares: int = 0
    """Spare ranks: spare processes that start with the job and each replace one failed rank
    at runtime (on a cluster: the spare nodes' processes, spare nodes x ranks per node). Also
    spelled --deadpool-spares (and, deprecated, the YAML key `spares`)."""

    respawn_limit: int = 2
    """In-place respawns per node within deadpool-respawn-window seconds: a failed process
    replaced by a new one on its own node (same slot, same GPU), which spends no spare. Past the
    limit, or once the node itself is lost, its failed ranks take spares. Wherever a launcher or
    agent can start a process on the failed one's node: `deadpool train` and `deadpool
    megatron-lm` on this machine (with or without --node-agents), and a Slurm job whose nodes
    each run a `deadpool agent` (scripts/slurm/deadpool_launch.sh does, unless
    DEADPOOL_RESPAWN_LIMIT=0). Default 2 per 10 minutes: a crash or two (most failures of a long
    run) costs no spare, while a node that fails a third time within minutes is probably faulty
    and is given up for a spare. 0: every failure takes a spare."""

    respawn_window: float = 600.0
    """Seconds over which deadpool-respawn-limit counts a node's respawns (a sliding window;
    default 10 minutes, several recoveries long)."""

    join: bool = False
    """Join a running job as a spare (a repaired node, or a node of another allocation): this
    process takes the next spare name from the job's coordinator (--deadpool-coordinator
    HOST:PORT, the job's secret in DEADPOOL_JOB_TOKEN or DEADPOOL_JOB_TOKEN_FILE, its run id in
    DEADPOOL_JOB_ID) instead of one from RANK/SLURM_PROCID, and waits for a slot like the spares
    that started with the job."""

    replicas: int = 1
    """Remote replicas k of each rank's optimizer shard, each on a peer in another failure
    domain (node)."""

    replica_device: Literal["auto", "cpu", "gpu"] = "auto"
    """Where replicas and local snapshots live: gpu memory, pinned host memory (cpu), or auto
    (gpu when CUDA is really present, else cpu)."""

    ranks_per_node: int | None = None
    """Ranks per failure domain (node); consecutive ranks share a node. Default: the launcher's
    local world size (LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE), or TP in `deadpool train`."""

    heartbeat_interval: float = 1.0
    """Seconds between heartbeats each rank publishes to the coordinator."""

    heartbeat_timeout: float = 10.0
    """A rank silent for this many seconds is declared hung and replaced. Must exceed
    3 x heartbeat-interval and stay below the agreement timeout."""

    agree_timeout: float | None = None
    """Seconds the coordinator waits for every survivor's report once it planned a recovery;
    a survivor silent that long is presumed dead. Between the heartbeat timeout and the
    process-group timeout (default: half-way between them)."""

    pg_timeout: float = 120.0
    """Timeout in seconds of every collective DeadPool creates (and of the rebuilt groups);
    the bound on how long a survivor can block on a dead peer. Above the agreement timeout."""

    join_timeout: float = 600.0
    """Seconds a recovery's newcomer may take, once the coordinator decided, to build its
    objects and claim its slot; the survivors wait for it meanwhile. Past it the newcomer is
    taken for lost (killed where the launcher can) and the next spare takes the slot. Above
    the heartbeat timeout; keep it above a spare's model, optimizer and data-loader build."""

    abort_timeout: float | None = None
    """Seconds a survivor's abort of its process groups may take (it runs on a thread of its own
    while the heartbeat goes on); past it the process ends with exit code 7, so that the
    coordinator sees a death instead of a live process that never reports. Below the agreement
    timeout (default: the heartbeat timeout)."""

    connect_timeout: float = 60.0
    """Seconds a process may take to reach the coordinator at start-up, or to find it (or a
    standby that took over) again after losing it; past it the process exits with a clear error
    instead of hanging. A single store operation waits at most the heartbeat timeout."""

    coordinator: str | None = None
    """HOST:PORT of the coordinator's store, or an ordered list HOST:PORT,HOST:PORT,...: the
    primary first, then standby coordinators (`deadpool coordinator --standby`) that take over
    when it is lost. Unset: the launcher hosts it on loopback."""

    fail: list[str] = field(default_factory=list)
    """Fault injection, repeatable: RANK@ITER[:kill|hang|flip|raise] or
    node:N@ITER[:kill|hang|raise] (and the forms of `config/faults.py`)."""

    log_dir: str | None = None
    """Directory for the coordinator's event log and per-rank logs."""

    metrics_file: str | None = None
    """Write the job's state here in the Prometheus text format (node_exporter's textfile
    collector reads it: name it *.prom in the collector's folder), rewritten atomically at every
    iteration and every event: spares available, recoveries, respawns, committed iteration,
    replica bytes per iteration, under-replicated shards, the last recovery's seconds (and its
    phases'). The process that hosts the coordinator writes it."""

    job_token: str | None = None
    """Shared secret of this job: it seals every value of the coordinator's store, and a
    process holding another is refused. Better given in the environment (DEADPOOL_JOB_TOKEN)
    or a file only its owner reads (DEADPOOL_JOB_TOKEN_FILE): a flag is on a command line,
    which `ps` shows. Default: one the launcher generates per job."""

    def __post_init__(self) -> None:
        check_number(self.spares, "deadpool-spare-ranks", integer=True, minimum=0)
        check_number(self.replicas, "replicas", integer=True, minimum=1)
        check_number(self.respawn_limit, "deadpool-respawn-limit", integer=True, minimum=0)
        if self.replica_device not in ("auto", "cpu", "gpu"):
            raise ConfigError(
                f"deadpool-replica-device: {self.replica_device!r} is not one of auto, cpu, gpu"
            )
        if self.ranks_per_node is not None:
            check_number(self.ranks_per_node, "ranks-per-node", integer=True, minimum=1)
        for name in SECONDS:
            value = getattr(self, name)
            if value is not None or name not in OPTIONAL_SECONDS:
                check_number(value, f"deadpool-{name.replace('_', '-')}", above=0, unit="seconds")
        if self.heartbeat_timeout < 3 * self.heartbeat_interval:
            raise ConfigError(
                f"deadpool-heartbeat-timeout ({self.heartbeat_timeout}s) must be at least 3 x "
                f"deadpool-heartbeat-interval ({self.heartbeat_interval}s): raise the timeout "
                "or shorten the interval"
            )
        if self.pg_timeout <= self.heartbeat_timeout:
            raise ConfigError(
                f"deadpool-pg-timeout ({self.pg_timeout}s) must exceed deadpool-heartbeat-timeout "
                f"({self.heartbeat_timeout}s), or a hung peer times collectives out before the "
                "heartbeat monitor names it"
            )
        if self.join_timeout <= self.heartbeat_timeout:
            raise ConfigError(
                f"deadpool-join-timeout ({self.join_timeout}s) must exceed "
                f"deadpool-heartbeat-timeout ({self.heartbeat_timeout}s): a newcomer builds its "
                "objects after it was picked, which takes longer than a heartbeat"
            )
        if self.agree_timeout is not None and not (
            self.heartbeat_timeout < self.agree_timeout < self.pg_timeout
        ):
            raise ConfigError(
                f"deadpool-agree-timeout ({self.agree_timeout}s) must lie between "
                f"deadpool-heartbeat-timeout ({self.heartbeat_timeout}s) and deadpool-pg-timeout "
                f"({self.pg_timeout}s): survivors are named before they are presumed dead, and "
                "presumed dead before their collectives time out"
            )
        if self.abort_timeout is not None and not self.abort_timeout < self.agreement_timeout:
            raise ConfigError(
                f"deadpool-abort-timeout ({self.abort_timeout}s) must be a positive number of "
                f"seconds below the agreement timeout ({self.agreement_timeout:g}s): the "
                "coordinator presumes a survivor dead that has not reported by then, so one whose "
                "abort hangs longer must have ended itself before"
            )
        standbys = len(split_coordinators(self.coordinator)) - 1 if self.coordinator else 0
        if standbys and self.connect_timeout < 2 * self.heartbeat_timeout:
            raise ConfigError(
                f"deadpool-connect-timeout ({self.connect_timeout}s) must be at least 2 x "
                f"deadpool-heartbeat-timeout ({self.heartbeat_timeout}s) when "
                "deadpool-coordinator lists a standby: a standby takes over only after the "
                "primary was silent for the heartbeat timeout, and processes look for it for "
                "the connect timeout"
            )
        for spec in self.fail:
            parse_fault(spec)

    @property
    def agreement_timeout(self) -> float:
        """The agreement timeout in effect."""
        if self.agree_timeout is not None:
            return float(self.agree_timeout)
        return (self.heartbeat_timeout + self.pg_timeout) / 2

    @property
    def abort_bound(self) -> float:
        """The abort timeout in effect: a healthy abort takes well under a second (NCCL
        communicators aborted, gloo connections shut down); one still running after a heartbeat
        timeout is hung (NVIDIA/nccl#1777, #829), and ending the process then keeps plan,
        abort and the death being named within the agreement timeout."""
        if self.abort_timeout is not None:
            return float(self.abort_timeout)
        return self.heartbeat_timeout

    @property
    def store_keepalive(self) -> float:
        """Seconds after which the store drops a connection whose host stopped answering (a node
        lost without closing its sockets): the process-group timeout, by which every collective
        with that host has timed out and the heartbeat monitor has long named it dead. A live
        host's connections are never dropped (its kernel answers the probes)."""
        return self.pg_timeout

    @property
    def suspect_after(self) -> float:
        """Silence that names a rank dead once a survivor reported a failed collective: half
        the heartbeat timeout, at least 3 heartbeat intervals."""
        return max(3 * self.heartbeat_interval, self.heartbeat_timeout / 2)

    @property
    def coordinators(self) -> list[str]:
        """The coordinators' addresses, primary first (empty: the launcher hosts one)."""
        return split_coordinators(self.coordinator) if self.coordinator else []

    def replace(self, **changes: Any) -> DeadpoolConfig:
        """A validated copy with `changes` applied."""
        return dataclasses.replace(self, **changes)


def split_coordinators(text: str) -> list[str]:
    """`HOST:PORT[,HOST:PORT...]` as a list, each entry checked; one `ConfigError` naming the
    flag and the entry otherwise."""
    flag = "deadpool-coordinator"
    if not isinstance(text, str):
        raise ConfigError(f"{flag}: expected HOST:PORT[,HOST:PORT...], got {text!r}")
    entries = [e.strip() for e in text.split(",")]
    for i, entry in enumerate(entries, 1):
        where = f"{flag} (entry {i} of {len(entries)})" if len(entries) > 1 else flag
        parse_host_port(entry, where)
        if entry in entries[: i - 1]:
            raise ConfigError(f"{where}: {entry!r} is listed twice; each coordinator once")
    return entries


def parse_host_port(text: str, flag: str, *, resolve: bool = False) -> tuple[str, int]:
    """Split HOST:PORT; with `resolve`, also check that HOST resolves."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"{flag}: expected HOST:PORT with a port in 1-65535, got {text!r}")
    host = host.strip("[]")
    if resolve:
        try:
            socket.getaddrinfo(host, int(port_text))
        except socket.gaierror as exc:
            raise ConfigError(
                f"{flag}: host {host!r} does not resolve ({exc.strerror}); give the coordinator "
                "node's hostname or IP address"
            ) from None
    return host, int(port_text)
