"""A cluster node's agent: it starts that node's processes, keeps their memory, and respawns them.

`deadpool agent` runs once per node (one Slurm task per node, `srun --ntasks-per-node=1`, as
torchrun and nvidia-resiliency-ext's ft_launcher are run). It starts the node's R processes -
tasks place*R .. place*R+R-1 (actives first, then spares; `place`: the node's number in its
allocation) - each with its `RANK`, `LOCAL_RANK` (its GPU) and its log `task-{t}.log`, as
`srun` with one task per GPU would, and then, for the rest of the job:
  - beats (`agent/{node}/hb`), so that the coordinator knows the node can still start a process
    (`node_agents.StoreAgents`, the coordinator's side);
  - gives each process a folder in the node's memory file system (`replication.segments`): its
    snapshot and the replicas it holds live there and outlive it;
  - carries out the coordinator's respawn orders: the process named in the order's place
    (`replaces`) is killed if it still runs (a hung one), and a new one starts on its GPU with
    its folder, under the order's member name; it restores from its own snapshot, and no spare
    node is spent;
  - reports each exit of a process it started (`agents/exit/{n}`, a `ProcessExit`) as it
    happens - its pause between beats ends when one of them ends (`exit_watch.ExitWatch`, on
    their pidfds), not a fixed sleep - and wakes
    the coordinator, so that a crash is known in milliseconds (`liveness.AgentExits`), not a
    beat later or after the peers' failure reports and a silence;
  - follows the job to a standby coordinator that took it over (the first of
    `--deadpool-coordinator` that serves the job), and tells it what the lost one knew: the
    exits it saw (again: they may not have been acted on), when it respawned processes (the
    node's respawn budget goes on, not afresh: `RespawnHistory`) and the spare names its
    processes took (the standby hands out none of them again).
Every process learns its node's number in the job (`AGENT_NODE_ENV`) and announces it, so the
coordinator finds the node of any process an agent started. An agent that joins a running job
(`join`: a revived node, or one of another allocation) takes a node number of its own from the
job's store first, and its processes join as spares (`--deadpool-join`: each takes its spare
name from the store; the agent finds a process an order names by the OS pid it announced). It
ends once every process it started has exited and the job is over (the coordinator's shutdown,
or no coordinator left for the connect timeout): processes still running `grace_s` after that
are killed, and the node's folders are deleted. A node whose agent is lost (the node crashed,
froze or was cut off) is condemned by the coordinator: its failed ranks take spares. An injected
node fault (`--deadpool-fail node:N@ITER`) makes that happen on purpose: the agent that sees its
process struck by one kills the node's other processes, deletes its memory and SIGKILLs itself.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...errors import CoordinatorUnreachableError, first_line
from ...replication import segments
from ..coordinator.liveness import kill_groups
from ..protocol.agent_view import AgentView
from ..protocol.connection import STORE_ERRORS, BoundedStore, open_client
from ..protocol.joining import next_spare_number
from ..protocol.messages import (
    AGENT_NODE_ENV,
    Announcement,
    ProcessExit,
    RespawnHistory,
    RespawnOrder,
    is_member,
    member_of,
    task_of,
)
from ..protocol.seal import JobSeal
from ..protocol.sealed_store import SealedStore
from .exit_watch import ExitWatch
from .forkserver import Preload
from .warm_start import ForkedProcess, WarmStart

log = logging.getLogger("megatron_deadpool.agent")

PER_PROCESS_ENV = ("RANK", "SLURM_PROCID", "LOCAL_RANK", "SLURM_LOCALID", segments.ENV,
                   AGENT_NODE_ENV)  # fmt: skip
"""Variables that differ between the node's processes: not given to their fork server."""

NOT_JOINING = "--no-deadpool-join"
"""Appended to a joined node's command for a respawned process: it has its name already."""


@dataclass
class Started:
    """One process the agent started: its GPU and its memory folder."""

    proc: subprocess.Popen | ForkedProcess
    gpu: int
    folder: Path
    reported: bool = False
    """Its exit was reported to the coordinator serving the job now."""


class NodeAgent:
    """The processes of one node of a job, and their memory that outlives them."""

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        place: int,
        per_node: int,
        world_size: int,
        processes: int,
        coordinators: list[str],
        seal: JobSeal,
        log_dir: Path,
        beat_s: float,
        connect_timeout: float,
        join: bool = False,
        preload: Preload | None = None,
        grace_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> None:
        """`place`: this node's number in its allocation (Slurm's SLURM_NODEID), also its
        number in the job unless it `join`s; `processes`: the job's initial processes (actives
        and spares; tasks beyond it on this node start nothing); `preload`: what the command
        imports - its processes are then forked from a fork server that imported it once
        (`warm_start`), a respawned one too, instead of starting a fresh interpreter."""
        self.cmd = list(cmd)
        self.place = place
        self.node = place
        self.per_node = per_node
        self.world_size = world_size
        self.processes = processes
        self.coordinators = coordinators
        self.seal = seal
        self.log_dir = log_dir
        self.beat_s = beat_s
        self.connect_timeout = connect_timeout
        self.join = join
        self.preload = preload
        self.starter = WarmStart(log=log.info, log_dir=log_dir)
        self.grace_s = grace_s
        self.env = dict(os.environ if env is None else env)
        self.server_env = {k: v for k, v in self.env.items() if k not in PER_PROCESS_ENV}
        shm = Path("/dev/shm")
        self.root = Path(
            tempfile.mkdtemp(prefix="deadpool-node-", dir=shm if shm.is_dir() else None)
        )
        self.started: dict[str, Started] = {}  # member name (joining{i}: not known yet)
        self.membership: AgentView | None = None
        self.address = ""  # the coordinator's that serves the job (`_connect`)
        self.orders_seen = 0
        self._respawned_at: list[float] = []  # monotonic times of the orders carried out
        self.struck = False  # a node fault struck one of its processes (`_notice_exits`)
        self._exited = threading.Event()  # set as a process it started ends (`_pause`)
        self.exits = ExitWatch(self._exited.set)

    # ------------------------------------------------------------------ processes
    def start(self) -> None:
        """Connect, take a node number if joining, and start the node's initial processes."""
        deadline = time.monotonic() + self.connect_timeout
        while not self._look(orders=False):
            if time.monotonic() > deadline:
                raise CoordinatorUnreachableError(
                    f"coordinator {','.join(self.coordinators)} unreachable after "
                    f"{self.connect_timeout:.0f}s; start `deadpool coordinator` first or fix "
                    "--deadpool-coordinator"
                )
            time.sleep(min(1.0, self.beat_s))
        assert self.membership is not None
        if self.join:  # the job's own world size (this allocation's says nothing of it)
            self.world_size = self.membership.wait_newest_roster(self.connect_timeout).world_size
            self.node = self.membership.claim_agent_node()
        log.info("node %d: processes' memory in %s", self.node, self.root)
        first = self.place * self.per_node
        for gpu in range(self.per_node):
            task = first + gpu
            if self.join:  # each takes its spare name from the store
                self._start(f"joining{gpu}", task, gpu, self.root / f"joining{gpu}", [])
            elif task < self.processes:
                member = member_of(task, self.world_size)
                self._start(member, task, gpu, self.root / f"m-{member}", [])

    def _start(self, name: str, task: int, gpu: int, folder: Path, extra: list[str]) -> None:
        folder.mkdir(exist_ok=True)
        env = {  # as `srun` with one task per GPU would set them (the agent's own: node's)
            **self.env,
            "RANK": str(task),
            "SLURM_PROCID": str(task),
            "LOCAL_RANK": str(gpu),
            "SLURM_LOCALID": str(gpu),
            segments.ENV: str(folder),
            AGENT_NODE_ENV: str(self.node),
        }
        with open(self.log_dir / f"task-{task}.log", "ab") as out:
            proc = self.starter.start(
                self.cmd + extra, env, out, preload=self.preload, server_env=self.server_env
            )
        self.started[name] = Started(proc, gpu, folder)
        self.exits.watch(proc)
        log.info("node %d: started %s (task %d, GPU %d, pid %d)", self.node, name, task, gpu,
                 proc.pid)  # fmt: skip

    def _find(self, member: str) -> Started | None:
        """The process the agent started that is `member`: by name, or (a process that took
        its name from the store) by the OS pid it announced from this host."""
        if member in self.started:
            return self.started[member]
        assert self.membership is not None
        where = self.membership.announcement(member)
        return next((s for s in self.started.values() if _announced(where, s)), None)

    def _member_of(self, name: str, started: Started) -> str | None:
        """The member name of the process the agent started as `name`: that name, or for a
        process that joined (`joining{i}`: it took its name from the store) the spare that
        announced its OS pid from this host, if any."""
        if is_member(name):
            return name
        assert self.membership is not None
        for i in range(self.membership.spare_names_claimed()):
            if _announced(self.membership.announcement(f"s{i}"), started):
                return f"s{i}"
        return None

    def _carry_out(self, order: RespawnOrder) -> None:
        old = self._find(order.replaces)
        if old is None:  # the coordinator moves on to a spare once the join timeout passed
            log.warning("node %d: no process of mine is %s: cannot respawn it", self.node,
                        order.replaces)  # fmt: skip
            return
        if old.proc.poll() is None:  # hung: the coordinator named it dead
            kill_groups([old.proc])  # type: ignore[list-item]  # Popen-like
            log.info("node %d: killed %s (named dead while still running)", self.node,
                     order.replaces)  # fmt: skip
        task = task_of(order.member, self.world_size)
        self._start(order.member, task, old.gpu, old.folder, [NOT_JOINING] if self.join else [])
        self._respawned_at.append(time.monotonic())
        log.info("node %d: %s takes rank %d in place of %s", self.node, order.member, order.rank,
                 order.replaces)  # fmt: skip

    def running(self) -> list[str]:
        return [name for name, s in self.started.items() if s.proc.poll() is None]

    # ------------------------------------------------------------------ the coordinator
    def _connect(self) -> AgentView | None:
        """The coordinator serving the job (the first listed that does), or None; one that
        took the job over from another is told what that one knew (`_hand_over`)."""
        for index, address in enumerate(self.coordinators):
            try:
                store = BoundedStore(open_client(address, 2.0), max(2.0, self.beat_s * 4))
                seal = self.seal.for_store(index)  # each store its own (`seal.py`)
                membership = AgentView(SealedStore(store, f"agent{self.node}", seal))
                if membership.serves_job():
                    if self.address and address != self.address:
                        self._hand_over(membership, address)
                    self.address = address
                    return membership
            except STORE_ERRORS:
                continue
        return None

    def _hand_over(self, membership: AgentView, address: str) -> None:
        """A standby took the job over: what the lost coordinator knew from this agent, told
        again before the first beat there (a beat makes the node eligible for respawns). Its
        orders are numbered afresh; every exit is reported again (the lost coordinator may
        have died before acting on one, and the standby finds the node of a process that
        never re-registered with it by its exit); the node's respawns so far, as ages; spare
        names from after every one this node's processes took."""
        now = time.monotonic()
        membership.set_respawn_history(
            self.node, RespawnHistory(tuple(now - t for t in self._respawned_at))
        )
        membership.number_spares_from(next_spare_number(list(self.started)))
        self.orders_seen = 0
        for started in self.started.values():
            started.reported = False
        log.info("node %d: following the job to the coordinator at %s", self.node, address)

    def _look(self, orders: bool = True) -> bool:
        """Report exits, beat and carry out new orders; False when the coordinator could not be
        reached. The exits go first: a coordinator that took the job over learns of them before
        a beat makes this node eligible for respawns."""
        try:
            if self.membership is None:
                self.membership = self._connect()
                if self.membership is None:
                    return False
            if orders:
                self.struck = self.struck or self._notice_exits()
                self.membership.agent_beat(self.node)
                self.orders_seen, new = self.membership.respawn_orders(self.node, self.orders_seen)
                for order in new:
                    self._carry_out(order)
            return True
        except STORE_ERRORS as exc:
            log.warning("node %d: coordinator lost (%s)", self.node, first_line(exc))
            self.membership = None
            return False

    def _notice_exits(self) -> bool:
        """Report the exits of this node's processes not reported yet (`ProcessExit`: the
        coordinator need not wait for their silence); True if a node fault
        (`--deadpool-fail node:N@ITER`) struck one of them: the node is to go down whole, its
        agent with it."""
        if self.membership is None:
            return False
        reported = False
        try:
            for name, started in self.started.items():
                code = started.proc.poll()
                if code is None or started.reported:
                    continue
                member = self._member_of(name, started)
                if member is not None and self.membership.node_lost(member):
                    return True
                if member is not None:
                    self.membership.report_exit(ProcessExit(member, code, self.node))
                    reported = True
                started.reported = True
            if reported:  # the coordinator acts on it now, not at its next tick
                self.membership.notify_coordinator()
        except STORE_ERRORS:
            pass  # reported at the next look
        return False

    def _pause(self, seconds: float) -> None:
        """Wait `seconds` between looks, less when a process this agent started ends: its exit
        is reported at once, not up to a beat later (a crash's detection on a cluster). An exit
        after the last look ends it at once (`exits` woke it meanwhile)."""
        self._exited.wait(seconds)
        self._exited.clear()

    def _job_over(self) -> bool:
        try:
            return self.membership is not None and self.membership.shutdown_requested()
        except STORE_ERRORS:
            return False

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Supervise until the job is over and every process exited; 0."""
        try:
            self.start()
            unreachable_since: float | None = None
            over_since: float | None = None
            while True:
                now = time.monotonic()
                reached = self._look()
                if self.struck:
                    log.warning("node %d: a node fault struck (--deadpool-fail node:%d@...): "
                                "the node goes down whole, its agent with it", self.node,
                                self.node)  # fmt: skip
                    self.close()  # its processes, and its memory
                    os.kill(os.getpid(), signal.SIGKILL)
                unreachable_since = None if reached else (unreachable_since or now)
                lost = unreachable_since is not None and now - unreachable_since > (
                    self.connect_timeout
                )
                if over_since is None and (lost or self._job_over()):
                    over_since = now
                    log.info("node %d: the job is over (%s)", self.node,
                             "no coordinator left" if lost else "shutdown")  # fmt: skip
                if over_since is not None and (
                    not self.running() or now - over_since > self.grace_s
                ):
                    return 0
                self._pause(self.beat_s)
        finally:
            self.close()

    def close(self) -> None:
        """Kill what is left of the node's processes and delete their folders."""
        kill_groups([s.proc for s in self.started.values()])  # type: ignore[misc]  # Popen-like
        self.starter.close()  # after the processes it forked: it reports their exits
        shutil.rmtree(self.root, ignore_errors=True)
        self.exits.stop()


def _announced(where: Announcement | None, started: Started) -> bool:
    """Whether announcement `where` is that of process `started`: from this host, its OS pid."""
    return where is not None and (where.host, where.os_pid) == (
        socket.gethostname(),
        started.proc.pid,
    )


def stop_on_term(agent: NodeAgent) -> None:
    """SIGTERM (Slurm ending the step) ends the agent with its processes."""

    def handler(signum: int, frame: object) -> None:
        agent.close()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
