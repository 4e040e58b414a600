"""A job's processes on this machine, with its store and coordinator hosted in-process.

What `deadpool train` and `deadpool megatron-lm` share, like torchrun but without restarting
anyone when a rank dies: the store on loopback, sealed with the job's secret (`seal.py`; its
processes get the secret in their environment, `DEADPOOL_JOB_TOKEN`), the coordinator (DeadPool
on), one process per active rank and spare in its own session (so a process and its helpers can
be killed as a group), its log (RUN_DIR/{member}.log) and the end of it shown when the job ends
with that process's own error, the coordinator's ticks, exit codes, time limit, shutdown and the
final parameter digests. Each launcher decides what its job's progress and outcome look like,
and what its processes import: given that (`Preload`), they are forked from one interpreter that
imported it once (`hotswap.launch.warm_start`) instead of starting fresh. Given the launcher's way to
start a process (`spawn`), it is also every simulated node's agent (`respawn.NodeAgents`): with
deadpool-respawn-limit > 0 a failed process is replaced by a new one on its own node, forked
warm, and no spare is spent; a node is lost, and its ranks take spares, when a node fault
(`node:N@ITER`) took it. `local_agents.LocalAgents` instead starts one `deadpool agent` per
simulated node, as a cluster runs a job.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ...config.deadpool import DeadpoolConfig
from ...devices.gpus import GpuAssignment, assign_gpus, local_gpu_count
from ...errors import ConfigError, ExitCode
from ...replication import segments
from ...replication.placement import Placement
from ..coordinator.coordinator import Coordinator
from ..coordinator.events import EventLog, job_id
from ..coordinator.liveness import Liveness, ProcessLiveness, kill_groups
from ..coordinator.respawn import NodeAgents
from ..coordinator.settings import CoordinatorSettings
from ..protocol.membership import Membership, host_store
from ..protocol.messages import JobError, task_of
from ..protocol.seal import JOB_ID_ENV, JobSeal, job_binding, new_job_id
from ..protocol.store_files import reserve_files, store_files_needed
from ..report.job_status import publish_status
from .exit_watch import ExitWatch
from .forkserver import Preload
from .silent_connections import SilentConnections
from .warm_start import WarmStart

LAUNCHER_FILES_PER_PROCESS = 2
"""Files the launcher holds of each process besides its store connections: its output file
and its process handle (a pidfd, or the fork server's report of its exit)."""

PER_PROCESS_ENV = ("RANK", "LOCAL_RANK", segments.ENV)
"""Variables that differ between a job's processes: not given to their fork server."""


class LocalJob:
    """One job's store, coordinator and processes; `close()` ends whatever is left."""

    def __init__(
        self,
        cfg: DeadpoolConfig,
        *,
        world_size: int,
        token: str,
        run_dir: Path,
        placement: Placement | None = None,
        say: Callable[[str], None] = lambda text: None,
        spawn: Callable[[str], None] | None = None,
    ) -> None:
        """`placement` None: the coordinator learns the layout from rank 0 once it exists.
        `spawn(member)`: how the launcher starts a process (`spawn` below), for in-place
        respawns (none without it). Refuses (`ConfigError`) a node with fewer GPUs than
        actives + spares before anything starts."""
        if cfg.join:
            raise ConfigError(
                "deadpool-join: this launcher starts its own job; a process joins a running job "
                "started elsewhere (`python -m megatron_deadpool.embedded.worker --deadpool-join "
                "--deadpool-coordinator HOST:PORT`, or Megatron-LM's pretrain_gpt.py with "
                "--deadpool --deadpool-join)"
            )
        self.cfg = cfg
        self.world_size = world_size
        self.run_dir = run_dir
        self.spares = cfg.spares if cfg.enabled else 0
        self.gpus = self._assign_gpus()
        self.procs: dict[str, subprocess.Popen] = {}
        self._spawn = spawn
        self._local_ranks: dict[str, int] = {}  # a respawned process: its predecessor's GPU
        self._nodes: dict[str, int] = {}  # ... and its node
        need = store_files_needed(world_size, self.spares, per_process=LAUNCHER_FILES_PER_PROCESS)
        reserve_files(
            need,
            f"this launcher (the store and processes of {world_size} ranks and "
            f"{self.spares} spare(s))",
        )
        self.starter = WarmStart(log=say, log_dir=run_dir)
        # With respawns, each simulated node keeps its processes' snapshots and replicas in
        # memory that outlives them (`replication.segments`): a folder per process, which a
        # process respawned in its place inherits; gone with the node or at the end.
        self.segments_root: Path | None = None
        if spawn is not None and cfg.respawn_limit > 0 and cfg.enabled:
            shm = Path("/dev/shm")
            self.segments_root = Path(
                tempfile.mkdtemp(prefix="deadpool-segments-", dir=shm if shm.is_dir() else None)
            )
        self._segments: dict[str, Path] = {}
        host = self._store_host()
        self.silent = SilentConnections(need)
        store = host_store(host, 0, keepalive_s=cfg.store_keepalive, on_listen=self.silent.watch)
        self.address = f"{host}:{store.port}"
        # This run's id (`seal.py`): the environment's, else a new one; every process this
        # launcher starts gets it in its environment (`spawn`), with the secret.
        self.job = job_binding() or new_job_id()
        self.membership = Membership(store, "launcher", JobSeal(token, self.job))
        self.membership.set_token()
        events = EventLog(run_dir / "events.jsonl", job=job_id(token))
        events("store", address=self.address, run=self.job)  # where it listens (for tools)
        settings = CoordinatorSettings.of(
            cfg, world_size, self.spares, suspect_after=self._suspect_after()
        )
        self.coordinator = Coordinator.from_settings(
            settings,
            self.membership,
            liveness=self._liveness(),
            events=events,
            placement=placement,
            say=say,
            agents=self._node_agents(placement),
        )
        publish_status(events, self.coordinator, standbys=0)
        self.coordinator.start()
        self._ended = threading.Event()  # DeadPool off: a pause ends at an exit
        self._exits = ExitWatch(self.coordinator.wake if cfg.enabled else self._ended.set)

    # ------------------------------------------------------------------ where it runs
    def _assign_gpus(self) -> GpuAssignment | None:
        """Every process on this node: refuses too few GPUs."""
        return assign_gpus(actives=self.world_size, spares=self.spares, gpus=local_gpu_count())

    def _store_host(self) -> str:
        return "127.0.0.1"  # loopback only: every process is on this machine

    def _liveness(self) -> Liveness:
        return ProcessLiveness(self.procs)  # sees exits: no need to suspect silence

    def _suspect_after(self) -> float | None:
        """None: exits seen at once, a silence after a peer's failure proves nothing more."""
        return None

    def _node_agents(self, placement: Placement | None) -> NodeAgents | None:
        """Who respawns a failed process on its node: this launcher, given `spawn`."""
        return self if self._spawn is not None and self.cfg.respawn_limit > 0 else None

    @property
    def members(self) -> list[str]:
        """Every member of the job at start: actives a0.., then spares s0.."""
        return [f"a{r}" for r in range(self.world_size)] + [f"s{i}" for i in range(self.spares)]

    def local_rank(self, member: str) -> int:
        """The GPU (``LOCAL_RANK``) of process `member`: actives 0.., spares after them; a spare
        added later (`add_spare`) takes the GPUs round-robin."""
        if member in self._local_ranks:
            return self._local_ranks[member]
        task = task_of(member, self.world_size)
        if self.gpus is None:
            raise RuntimeError("this job's GPUs are each node's (Slurm's SLURM_LOCALID)")
        return self.gpus.local_rank(task % (self.world_size + self.spares))

    def spawn(
        self,
        member: str,
        cmd: list[str],
        env: dict[str, str],
        output: IO[Any] | int,
        preload: Preload | None = None,
    ) -> None:
        """Start member `member` in a session of its own (``LOCAL_RANK`` set), its output to
        `output` (a file, or `subprocess.PIPE`: read `procs[member].stdout`). With `preload`
        (what the command imports), fork it from the job's warm interpreter (started on first
        use)."""
        common = {k: v for k, v in env.items() if k not in PER_PROCESS_ENV}
        own = {"LOCAL_RANK": str(self.local_rank(member))}
        if self.segments_root is not None:  # its node's memory that outlives it
            folder = self._segments.setdefault(member, self.segments_root / f"m-{member}")
            folder.mkdir(exist_ok=True)
            own[segments.ENV] = str(folder)
        self.procs[member] = self.starter.start(  # type: ignore[assignment]  # Popen-like
            cmd,
            {**env, JOB_ID_ENV: self.job, **own},
            output,
            preload=preload,
            server_env=common,
        )
        self._exits.watch(self.procs[member])

    def add_spare(self, spawn: Callable[[str], None]) -> str:
        """Grow the pool by one spare (as a cluster's scheduler would add a node)."""
        member = self.coordinator.membership.claim_spare_name()
        self._nodes[member] = self._new_node()
        spawn(member)
        self.coordinator.add_spare(member)
        return member

    # ------------------------------------------------------------------ the nodes' agent
    def node_of(self, member: str) -> int:
        """The simulated node of `member`: rank r's first process on node r // R (R ranks per
        node), spare i on spare node (W + i) // R, a respawned process on its predecessor's."""
        if member in self._nodes:
            return self._nodes[member]
        placement = self.coordinator.placement()
        assert placement is not None  # the coordinator asks only once it knows the layout
        return task_of(member, self.world_size) // placement.layout.ranks_per_node

    def _new_node(self) -> int:
        """A simulated node of its own, after every node so far (a spare added later)."""
        placement = self.coordinator.placement()
        per_node = placement.layout.ranks_per_node if placement is not None else 1
        first = -(-(self.world_size + self.spares) // per_node)  # after the initial spares'
        return max([first - 1, *self._nodes.values()]) + 1

    def alive(self, node: int) -> bool:
        """Whether simulated node `node` is still there: no node fault took one of its
        processes (a node fault takes the node whole)."""
        members = [m for m in list(self.procs) if self.node_of(m) == node]
        if not any(self.membership.node_lost(m) for m in members):
            return True
        for m in members:  # the node's memory is gone with it
            if m in self._segments:
                shutil.rmtree(self._segments.pop(m), ignore_errors=True)
        return False

    def respawn(self, rank: int, dead: str, node: int) -> str:
        """A new process on `node` (this machine) with `dead`'s GPU, waiting for `rank`'s slot
        in the coordinator's next plan, as a spare would; its member name."""
        assert self._spawn is not None
        member = self.coordinator.membership.claim_spare_name()
        self._local_ranks[member] = self.local_rank(dead)
        self._nodes[member] = node
        if dead in self._segments:  # the dead process's segment files: the same node's memory
            self._segments[member] = self._segments[dead]
        self._spawn(member)
        return member

    # ------------------------------------------------------------------ monitoring
    @property
    def deadpool(self) -> bool:
        return self.cfg.enabled

    def tick(self) -> None:
        """One round of failure handling (DeadPool on)."""
        if self.cfg.enabled:
            self.coordinator.tick()

    def wait(self, timeout_s: float) -> None:
        """Pause between ticks; it ends early when a process ends (`exit_watch`) or, DeadPool
        on, notifies the coordinator."""
        if self.cfg.enabled:
            self.coordinator.wait(timeout_s)
        else:
            self._ended.wait(timeout_s)
            self._ended.clear()

    def actives(self) -> list[str]:
        """The processes that hold the ranks now."""
        return list(self.coordinator.roster.slots.values())

    def exit_codes(self, members: list[str]) -> dict[str, int | None]:
        return {member: self.procs[member].poll() for member in members if member in self.procs}

    def failed(self) -> dict[str, int]:
        """Actives that exited with an error and that no recovery accounts for."""
        dead = self.coordinator.dead if self.cfg.enabled else frozenset()
        return {
            member: code
            for member, code in self.exit_codes(self.actives()).items()
            if code not in (None, 0) and member not in dead
        }

    def finished(self) -> bool:
        """Every active exited - with 0, or lost after its training was complete - and no
        recovery is under way."""
        return not self.coordinator.recovering and not self._not_ended()

    def _not_ended(self) -> dict[str, int | None]:
        """The actives that have not ended as in a finished job: not exited (None), or exited
        with an error (its code) without having been lost after its training was complete."""
        gone = self.coordinator.after_work
        codes = self.exit_codes(self.actives())
        return {m: c for m, c in codes.items() if c != 0 and (c is None or m not in gone)}

    def await_salvage(self) -> None:
        """Out of redundancy: the ranks save what survives, then exit (within a minute)."""
        self.wait_exit(self.actives(), 60.0)

    def unfinished(self) -> str:
        """What keeps `finished` false: a recovery under way, and each active that has not
        ended (`_not_ended`) with its log's last lines."""
        parts = ["a recovery is under way"] if self.coordinator.recovering else []
        for member, code in self._not_ended().items():
            state = "no exit seen" if code is None else f"exit code {code}"
            parts.append(
                f"{member} ({state}); its log ({self.log_path(member)}) ends:\n"
                + self.log_tail(member)
            )
        return "\n".join(parts)

    def log_path(self, member: str) -> Path:
        """Where process `member`'s output goes (written by the launcher)."""
        return self.run_dir / f"{member}.log"

    def log_tail(self, member: str, lines: int = 15) -> str:
        """The last `lines` lines of `member`'s log, each indented and marked with its name."""
        path = self.log_path(member)
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(f"    {member}| {line}" for line in text[-lines:])

    def job_error(
        self,
        verdict: JobError,
        say: Callable[[str], None],
        flush: Callable[[str], None] = lambda member: None,
    ) -> int:
        """The job ended with its own error (the coordinator said which): once that process
        exited (its traceback is the end of its log) and `flush(member)` wrote what is left of
        its output, show its log's last lines; exit code 9."""
        member = verdict.report.member
        self.wait_exit([member], 5.0)
        flush(member)
        say(f"{member}'s log ({self.log_path(member)}) ends:\n" + self.log_tail(member))
        return ExitCode.JOB_ERROR

    def wait_exit(self, members: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(
            c is None for c in self.exit_codes(members).values()
        ):
            time.sleep(0.05)

    # ------------------------------------------------------------------ the end
    def digests(self) -> dict[int, str]:
        """Each rank's final parameter digest (equal digests: equal weights)."""
        out = {}
        for r in range(self.world_size):
            digest = self.membership.digest(r)
            if digest is not None:
                out[r] = digest
        return out

    def close(self, grace_s: float) -> None:
        """Tell waiting spares to leave, give the ranks `grace_s` and the spares a second to
        exit on their own, then kill every process group (a spare still starting up cannot see
        the shutdown yet)."""
        self._exits.stop()
        self.membership.request_shutdown()
        self.wait_exit(self.actives(), grace_s)
        self.wait_exit(list(self.procs), 1.0)
        kill_groups(self.procs.values())
        self.starter.close()  # after the processes it forked: it reports their exits
        if self.segments_root is not None:
            shutil.rmtree(self.segments_root, ignore_errors=True)
        self.silent.stop()
        self.coordinator.close()
