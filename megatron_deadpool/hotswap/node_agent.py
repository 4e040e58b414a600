"""A cluster node's agent: it starts that node's processes, keeps their memory, and respawns them.

`deadpool agent` runs once per node (one Slurm task per node, `srun --ntasks-per-node=1`, as
torchrun and nvidia-resiliency-ext's ft_launcher are run). It starts the node's R processes -
tasks node*R .. node*R+R-1 of the job (actives first, then spares), each with its `RANK`,
`LOCAL_RANK` (its GPU) and its log `task-{t}.log`, as `srun` with one task per GPU would - and
then, for the rest of the job:
  - beats (`agent/{node}/hb`), so that the coordinator knows the node can still start a process
    (`node_agents.StoreAgents`, the coordinator's side);
  - gives each process a folder in the node's memory file system (`replication.segments`): its
    snapshot and the replicas it holds live there and outlive it;
  - carries out the coordinator's respawn orders: the process named in the order's place
    (`replaces`) is killed if it still runs (a hung one), and a new one starts on the same GPU
    with its predecessor's folder, under the order's member name; it restores from its own
    snapshot, and no spare node is spent;
  - follows the job to a standby coordinator that took it over (the first of
    `--deadpool-coordinator` that serves the job).
It ends once every process it started has exited and the job is over (the coordinator's
shutdown, or no coordinator left for the connect timeout): processes still running `grace_s`
after that are killed, and the node's folders are deleted. A node whose agent is lost (the node
crashed, froze or was cut off) is condemned by the coordinator: its failed ranks take spares.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import first_line
from ..replication import segments
from .connection import STORE_ERRORS, BoundedStore, open_client
from .liveness import kill_groups
from .membership import Membership
from .messages import RespawnOrder, member_of, task_of
from .seal import JobSeal

log = logging.getLogger("megatron_deadpool.agent")


class NodeAgent:
    """The processes of one node of a job, and their memory that outlives them."""

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        node: int,
        per_node: int,
        world_size: int,
        processes: int,
        coordinators: list[str],
        seal: JobSeal,
        log_dir: Path,
        beat_s: float,
        connect_timeout: float,
        grace_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> None:
        """`processes`: the job's initial processes (actives and spares; tasks beyond it on
        this node start nothing)."""
        self.cmd = list(cmd)
        self.node = node
        self.per_node = per_node
        self.world_size = world_size
        self.processes = processes
        self.coordinators = coordinators
        self.seal = seal
        self.log_dir = log_dir
        self.beat_s = beat_s
        self.connect_timeout = connect_timeout
        self.grace_s = grace_s
        self.env = dict(os.environ if env is None else env)
        shm = Path("/dev/shm")
        self.root = Path(
            tempfile.mkdtemp(prefix="deadpool-node-", dir=shm if shm.is_dir() else None)
        )
        self.procs: dict[str, subprocess.Popen] = {}
        self.folders: dict[str, Path] = {}
        self.membership: Membership | None = None
        self.orders_seen = 0
        self.respawned = 0

    # ------------------------------------------------------------------ processes
    def start(self) -> None:
        """Start the node's initial processes."""
        log.info("node %d: processes' memory in %s", self.node, self.root)
        first = self.node * self.per_node
        for task in range(first, min(first + self.per_node, self.processes)):
            self._start(member_of(task, self.world_size), task - first, None)

    def _start(self, member: str, gpu: int, replaces: str | None) -> None:
        task = task_of(member, self.world_size)
        folder = self.folders.get(replaces or "", self.root / f"m-{member}")
        folder.mkdir(exist_ok=True)
        self.folders[member] = folder
        env = {  # as `srun` with one task per GPU would set them (the agent's own: node's)
            **self.env,
            "RANK": str(task),
            "SLURM_PROCID": str(task),
            "LOCAL_RANK": str(gpu),
            "SLURM_LOCALID": str(gpu),
            segments.ENV: str(folder),
        }
        with open(self.log_dir / f"task-{task}.log", "ab") as out:
            self.procs[member] = subprocess.Popen(
                self.cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        log.info("node %d: started %s (task %d, GPU %d)", self.node, member, task, gpu)

    def _carry_out(self, order: RespawnOrder) -> None:
        old = self.procs.get(order.replaces)
        if old is not None and old.poll() is None:  # hung: the coordinator named it dead
            kill_groups([old])
            log.info(
                "node %d: killed %s (named dead while still running)", self.node, order.replaces
            )
        if order.member in self.procs:
            return  # an order read twice (after a reconnection)
        self._start(order.member, order.local_rank, order.replaces)
        self.respawned += 1
        log.info("node %d: %s takes rank %d in place of %s", self.node, order.member, order.rank,
                 order.replaces)  # fmt: skip

    def running(self) -> list[str]:
        return [m for m, p in self.procs.items() if p.poll() is None]

    # ------------------------------------------------------------------ the coordinator
    def _connect(self) -> Membership | None:
        """The coordinator serving the job (the first listed that does), or None."""
        for address in self.coordinators:
            try:
                store = BoundedStore(open_client(address, 2.0), max(2.0, self.beat_s * 4))
                membership = Membership(store, f"agent{self.node}", self.seal)
                if membership.serves_job():
                    return membership
            except STORE_ERRORS:
                continue
        return None

    def _look(self) -> bool:
        """Beat and carry out new orders; False when the coordinator could not be reached."""
        if self.membership is None:
            self.membership = self._connect()
            if self.membership is None:
                return False
        try:
            self.membership.agent_beat(self.node)
            self.orders_seen, orders = self.membership.respawn_orders(self.node, self.orders_seen)
            for order in orders:
                self._carry_out(order)
            return True
        except STORE_ERRORS as exc:
            log.warning("node %d: coordinator lost (%s)", self.node, first_line(exc))
            self.membership = None
            return False

    def _job_over(self) -> bool:
        try:
            return self.membership is not None and self.membership.shutdown_requested()
        except STORE_ERRORS:
            return False

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Supervise until the job is over and every process exited; 0."""
        self.start()
        unreachable_since: float | None = None
        over_since: float | None = None
        try:
            while True:
                now = time.monotonic()
                reached = self._look()
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
                time.sleep(self.beat_s)
        finally:
            self.close()

    def close(self) -> None:
        """Kill what is left of the node's processes and delete their folders."""
        kill_groups(self.procs.values())
        shutil.rmtree(self.root, ignore_errors=True)


def stop_on_term(agent: NodeAgent) -> None:
    """SIGTERM (Slurm ending the step) ends the agent with its processes."""

    def handler(signum: int, frame: object) -> None:
        agent.close()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
