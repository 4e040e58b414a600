"""Local launcher of the embedded job: actives + spares on this machine, progress, JSON log.

Like torchrun, but nobody is restarted on a failure: the job's store and coordinator are hosted
in-process (`hotswap.launch.local_job`), one worker process is started per active rank and spare, and
rank 0's per-iteration records are rendered live and written to the JSON log. A caller that
watches a run (a benchmark) passes `LaunchHooks` and, to run another program in each process,
`worker_command` and `worker_env`, instead of subclassing.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import yaml

from ..config.deadpool import DeadpoolConfig
from ..config.job import JobConfig
from ..digest import final_digest
from ..errors import ConfigError, ExitCode
from ..hotswap.launch.forkserver import Preload
from ..hotswap.launch.local_agents import LocalAgents
from ..hotswap.launch.local_job import LocalJob
from ..hotswap.launch.monitor import Monitor
from ..hotswap.protocol.messages import OutOfRedundancy
from ..hotswap.protocol.seal import SECRET_ENV, SECRET_FILE_ENV, job_secret, new_secret
from ..hotswap.report.metrics_file import MetricsFile, watch_events
from ..hotswap.report.salvage_note import salvage_lines
from ..hotswap.report.timeline import ITERATIONS_FILE
from ..replication.placement import Layout, place_replicas
from ..replication.save_dir import choose_resume
from .iteration_log import IterationLog
from .progress import Progress

WORKER_PRELOAD = Preload(("megatron_deadpool.embedded.worker", "megatron_deadpool.embedded.job"))
"""What every process imports (torch, megatron-core): its processes fork from a warm interpreter."""


@dataclass
class RunResult:
    """What a launched run produced."""

    returncode: int
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    run_dir: Path | None = None


def _nothing(*_: object) -> None:
    pass


@dataclass(frozen=True)
class LaunchHooks:
    """What a caller may do at three moments of a run (all optional; a benchmark's timers)."""

    started: Callable[[LocalJob], None] = _nothing
    """The job's store and coordinator exist; its first process is about to be started."""
    failed: Callable[[LocalJob, dict[str, int]], None] = _nothing
    """DeadPool off: processes failed (member -> exit code), before the run ends (e.g. stop
    every other process at once, as torchrun does)."""
    ended: Callable[[LocalJob], None] = _nothing
    """Supervision ended, before the summary and the shutdown: the store still answers."""


class LocalLauncher:
    """Runs a job on this machine; `run()` returns when every process has exited."""

    def __init__(
        self,
        job: JobConfig,
        *,
        json_log: str | None = None,
        run_dir: str | None = None,
        timeout_s: float = 900.0,
        stream: TextIO | None = None,
        quiet: bool = False,
        replenish_spares: bool = False,
        hooks: LaunchHooks = LaunchHooks(),
        worker_command: Sequence[str] | None = None,
        worker_env: Mapping[str, str] | None = None,
        node_agents: bool = False,
    ) -> None:
        """`worker_command`: the program each process runs, before its arguments (default: the
        embedded worker); `worker_env`: the environment it starts from (default: this
        process's); `node_agents`: start one `deadpool agent` per simulated node, which starts
        and respawns that node's processes, as on a cluster (`hotswap.launch.local_agents`), instead
        of being every node's agent itself. Refuses (`ConfigError`) agents with DeadPool off."""
        if node_agents and not job.deadpool.enabled:
            raise ConfigError("--node-agents: node agents serve DeadPool; drop --no-deadpool")
        if node_agents and replenish_spares:  # a spare added later would have no agent
            raise ConfigError("node_agents: spares cannot be replenished; pick one of the two")
        self.node_agents = node_agents
        self.job = job
        self.hooks = hooks
        self.worker_command = list(worker_command) if worker_command else None
        self.worker_env = dict(worker_env) if worker_env is not None else None
        self.replenish_spares = replenish_spares
        self.json_log = json_log
        self.run_dir = Path(run_dir or job.deadpool.log_dir or tempfile.mkdtemp(prefix="deadpool-"))
        self.timeout_s = timeout_s
        self.progress = Progress(job.train.iters, stream=stream, quiet=quiet)
        # The job's secret (`hotswap/protocol/seal.py`): to the processes in their environment only.
        self.token = job_secret(job.deadpool.job_token) or new_secret()
        self._local: LocalJob | None = None
        self._metrics: MetricsFile | None = None  # --deadpool-metrics-file
        train = job.train
        self.monitor = Monitor(self.progress.event, bool(train.save and train.save_interval))
        """The supervision loop, and the periodic checkpoints not written (each said once)."""

    @property
    def local(self) -> LocalJob:
        """The job's store, coordinator and processes (once `run` started them)."""
        if self._local is None:
            raise RuntimeError("the job has not started yet (`run`)")
        return self._local

    # ------------------------------------------------------------------ processes
    def _worker_command(self) -> list[str]:
        """The program each process runs (before its arguments)."""
        return self.worker_command or [sys.executable, "-m", "megatron_deadpool.embedded.worker"]

    def _worker_env(self) -> dict[str, str]:
        return dict(os.environ) if self.worker_env is None else dict(self.worker_env)

    def _env(self) -> dict[str, str]:
        """Every process's environment (the job's secret in it: never on a command line)."""
        env = self._worker_env()
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
        env.pop(SECRET_FILE_ENV, None)
        env[SECRET_ENV] = self.token
        return env

    def _command(self, member: str | None, address: str) -> list[str]:
        """Member `member`'s command line, the coordinator's store at `address` (`member`
        None: the process takes its own from SLURM_PROCID)."""
        return [
            *self._worker_command(),
            "--config",
            str(self.run_dir / "job.yaml"),
            *(["--member", member] if member else []),
            "--deadpool-coordinator",
            address,
        ]

    def _host(self, cfg: DeadpoolConfig, **kwargs: Any) -> LocalJob:
        """The job's store and coordinator, and where its processes run: this machine."""
        if self.node_agents:
            return LocalAgents(cfg, **{**kwargs, "spawn": None})  # the agents start them
        return LocalJob(cfg, **kwargs)

    def _start(self) -> None:
        """Start every process of the job: actives, then spares (or the nodes' agents)."""
        if isinstance(self.local, LocalAgents):
            settings = ["--config", str(self.run_dir / "job.yaml")]
            self.local.start_agents(self._command(None, self.local.address), self._env(), settings)
            return
        for member in self.local.members:
            self._spawn(member)

    def _spawn(self, member: str) -> None:
        with open(self.local.log_path(member), "w") as log:  # the child keeps its own copy
            cmd = self._command(member, self.local.address)
            self.local.spawn(member, cmd, self._env(), log, preload=WORKER_PRELOAD)

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        job, cfg = self.job, self.job.deadpool
        layout = self._layout()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        spec = replace(job, deadpool=replace(cfg, job_token=None))  # the secret: not in a file
        (self.run_dir / "job.yaml").write_text(yaml.safe_dump(spec.to_dict(), sort_keys=False))
        self._local = local = self._host(
            cfg,
            world_size=layout.world_size,
            token=self.token,
            run_dir=self.run_dir,
            placement=place_replicas(layout, cfg.replicas) if cfg.enabled else None,
            say=self.progress.event,
            spawn=self._spawn,
        )
        metrics = (
            watch_events(
                local.coordinator.events, cfg.metrics_file, lambda: len(local.coordinator.spares)
            )
            if cfg.enabled and cfg.metrics_file
            else None
        )
        self._metrics = metrics
        self.progress.header(
            f"deadpool train: tp={job.parallel.tp} pp={job.parallel.pp} dp={job.parallel.dp} "
            + (f"ep={layout.ep} etp={layout.expert_tp} " if layout.has_experts else "")
            + f"({layout.world_size} ranks, {job.ranks_per_node} per node) + {local.spares} "
            f"spare(s), {job.train.iters} iterations, DeadPool {'on' if cfg.enabled else 'off'}"
            + (f", k={cfg.replicas}" if cfg.enabled else "")
            + f"; logs in {self.run_dir}"
        )
        t_start = time.monotonic()
        self.hooks.started(local)
        self._start()
        # The records go to the run folder (`deadpool report` reads them) and --json-log;
        # closed in the `finally` below, after the monitor loop that writes them.
        paths = [self.run_dir / ITERATIONS_FILE, *([Path(self.json_log)] if self.json_log else [])]
        paths = list({path.resolve(): path for path in paths}.values())  # the same file once
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
        log_files = [open(path, "w") for path in paths]  # noqa: SIM115
        log = IterationLog(self._first_iteration(), *log_files)
        self._sigterm = False

        def on_sigterm(*_: object) -> None:
            self._sigterm = True

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        rc: int = ExitCode.FAILED
        try:
            rc = self._monitor(log, t_start)
            if rc == ExitCode.OUT_OF_REDUNDANCY and local.coordinator.out_of_redundancy:
                self._say_salvage(local.coordinator.out_of_redundancy)
            self.hooks.ended(local)
            summary = self._summary(log.records, rc, time.monotonic() - t_start)
            log.write(summary)
        finally:
            signal.signal(signal.SIGTERM, previous)
            # The job's own error: the survivors wait on peers that are gone; nothing to save.
            local.close(grace_s=0.0 if rc == ExitCode.JOB_ERROR else 10.0)
            for f in log_files:
                f.close()
        return RunResult(returncode=rc, records=log.records, summary=summary, run_dir=self.run_dir)

    def _monitor(self, log: IterationLog, t_start: float) -> int:
        """Supervise the job (`hotswap.launch.supervisor`), rendering rank 0's records as they come."""
        local = self.local
        coord, membership = local.coordinator, local.membership
        deadpool = self.job.deadpool.enabled

        def show_progress() -> bool:
            """Spares added, the display rewound after a recovery, the next record shown;
            True when a record was shown (look for the next one at once)."""
            while deadpool and self.replenish_spares and len(coord.spares) < local.spares:
                local.add_spare(self._spawn)  # as a cluster's scheduler would add nodes
            roster = coord.roster  # a recovery agreed: the records rewind to its restore
            rec = log.next_record(
                roster.generation, roster.restore_iteration or 0, membership.metrics
            )
            if rec is None:
                return False
            log.append(rec.to_dict())
            if self._metrics is not None:
                self._metrics.on_record(log.records[-1])
            self.progress.iteration(log.records[-1], deadpool)
            self.monitor.show_unsaved(membership)
            return True

        def failed(members: dict[str, int]) -> int:
            self.hooks.failed(local, members)
            for member, code in members.items():
                self.progress.event(f"process {member} exited with code {code}")
                self.progress.event("its log ends:\n" + local.log_tail(member))
            return ExitCode.FAILED

        def finished() -> int:
            self.monitor.show_unsaved(membership)
            preempted = membership.preempted()
            if preempted is not None:
                if preempted.unsaved:
                    self.progress.event(preempted.unsaved)
                return ExitCode.PREEMPTED  # stopped on purpose, resumable with --load
            return ExitCode.OK if log.next_iteration > self.job.train.iters else ExitCode.FAILED

        def preempt() -> str | None:
            if not self._sigterm:
                return None
            return "SIGTERM: every rank stops after the current iteration" + (
                " and saves a checkpoint" if self.job.train.save else ""
            )

        return self.monitor.run(
            local,
            deadline=t_start + self.timeout_s,
            finished=finished,
            on_failed=failed,
            on_job_error=lambda verdict: local.job_error(verdict, self.progress.event),
            on_tick=show_progress,
            interval_s=0.02,
            preempt=preempt,
        )

    def _say_salvage(self, oor: OutOfRedundancy) -> None:
        """Out of redundancy: what the survivors saved and how to resume (RUN_DIR/resume.yaml:
        this job without its injected faults, loading the save folder)."""
        save = self.job.train.save
        resume = self.run_dir / "resume.yaml"
        if save:
            train = replace(self.job.train, load=save)
            spec = replace(self.job, train=train, deadpool=replace(self.job.deadpool, fail=[]))
            spec = replace(spec, deadpool=replace(spec.deadpool, job_token=None))
            resume.write_text(yaml.safe_dump(spec.to_dict(), sort_keys=False))
        for line in salvage_lines(oor, save, f"deadpool train --config {resume}"):
            self.progress.header(line)

    def _first_iteration(self) -> int:
        """1, or the iteration after the checkpoint `--load` resumes from."""
        load = self.job.train.load
        if not load:
            return 1
        resume = choose_resume(load)
        fallback = resume.fallback(load)
        if fallback:
            self.progress.event(fallback)
        elif resume.kind is None:
            self.progress.header(
                f"--load {load}: nothing to resume there (no snapshot set, no checkpoint); "
                "training starts at iteration 1"
            )
        return resume.iteration + 1

    def _layout(self) -> Layout:
        """The job's rank layout (Megatron's default order), experts included."""
        p = self.job.parallel
        return Layout(p.tp, p.pp, p.dp, self.job.ranks_per_node, ep=p.ep, etp=p.etp)

    def _summary(self, records: list, rc: int, wall_s: float) -> dict[str, Any]:
        layout = self._layout()
        local = self.local
        coord, membership = local.coordinator, local.membership
        final, preempted = membership.final_replication(), membership.preempted()
        oor, ended = coord.out_of_redundancy, coord.ended
        digests = local.digests()
        digest, identical = final_digest(layout.peer_groups, digests)
        complete = rc == 0 and digest is not None
        summary = {
            "event": "summary",
            "returncode": rc,
            "iterations": len(records),
            "losses": [r["loss"] for r in records],
            "final_param_digest": digest if complete else None,
            "rank_digests": {str(r): d for r, d in sorted(digests.items())},
            "dp_replicas_identical": complete and identical,
            "committed_iteration": final.committed_iteration if final else None,
            "deadpool": self.job.deadpool.enabled,
            "recoveries": coord.recoveries,
            "spares_left": list(coord.spares),
            "out_of_redundancy": oor.to_dict() if oor else None,
            "job_error": coord.job_error.to_dict() if coord.job_error else None,
            "lost_after_training": ended.to_dict() if ended else None,
            "preempted": asdict(preempted) if preempted else None,
            "checkpoints_not_saved": {
                str(t): line for t, line in sorted(self.monitor.unsaved.items())
            },
            "wall_s": wall_s,
            "median_iter_time_s": (
                statistics.median(r["iter_time_s"] for r in records) if records else None
            ),
        }
        if complete and digest is not None:
            loss = f", final loss {records[-1]['loss']:.4f}" if records else ""
            self.progress.header(
                f"done: {len(records)} iterations in {wall_s:.1f}s{loss}, digest {digest[:16]}"
            )
        return summary
