"""Local launcher of the embedded job: actives + spares on this machine, progress, JSON log.

Like torchrun, but nobody is restarted on a failure: the job's store and coordinator are hosted
in-process (`hotswap.local_job`), one worker process is started per active rank and spare, and
rank 0's per-iteration records are rendered live and written to the JSON log.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from ..config.deadpool import DeadpoolConfig
from ..config.job import JobConfig
from ..digest import final_digest
from ..hotswap.local_job import LocalJob
from ..replication.placement import Layout, place_replicas
from ..replication.save_dir import resume_point
from .progress import Progress


@dataclass
class RunResult:
    """What a launched run produced."""

    returncode: int
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    run_dir: Path | None = None


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
    ) -> None:
        self.job = job
        self.replenish_spares = replenish_spares
        self.json_log = json_log
        self.run_dir = Path(run_dir or job.deadpool.log_dir or tempfile.mkdtemp(prefix="deadpool-"))
        self.timeout_s = timeout_s
        self.progress = Progress(job.train.iters, stream=stream, quiet=quiet)
        self.token = job.deadpool.job_token or secrets.token_hex(8)
        self.local: LocalJob | None = None

    # ------------------------------------------------------------------ processes
    def _worker_command(self) -> list[str]:
        """The program each process runs (before its arguments); benchmarks substitute theirs."""
        return [sys.executable, "-m", "megatron_deadpool.embedded.worker"]

    def _worker_env(self) -> dict[str, str]:
        return dict(os.environ)

    def _env(self) -> dict[str, str]:
        """Every process's environment."""
        env = self._worker_env()
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
        return env

    def _command(self, pid: str | None, address: str) -> list[str]:
        """Process `pid`'s command line, the coordinator's store at `address` (`pid` None:
        the process takes its own from SLURM_PROCID)."""
        return [
            *self._worker_command(),
            "--config",
            str(self.run_dir / "job.yaml"),
            *(["--pid", pid] if pid else []),
            "--deadpool-coordinator",
            address,
            "--deadpool-job-token",
            self.token,
        ]

    def _host(self, cfg: DeadpoolConfig, **kwargs: Any) -> LocalJob:
        """The job's store and coordinator, and where its processes run: this machine."""
        return LocalJob(cfg, **kwargs)

    def _start(self) -> None:
        """Start every process of the job: actives, then spares."""
        for pid in self.local.pids:
            self._spawn(pid)

    def _spawn(self, pid: str) -> None:
        with open(self.run_dir / f"{pid}.log", "w") as log:  # the child keeps its own copy
            self.local.spawn(pid, self._command(pid, self.local.address), self._env(), log)

    def _tail(self, pid: str, lines: int = 15) -> str:
        path = self.run_dir / f"{pid}.log"
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(f"    {pid}| {line}" for line in text[-lines:])

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        job, cfg = self.job, self.job.deadpool
        layout = Layout(job.parallel.tp, job.parallel.pp, job.parallel.dp, job.ranks_per_node)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "job.yaml").write_text(yaml.safe_dump(job.to_dict(), sort_keys=False))
        self.local = local = self._host(
            cfg,
            world_size=layout.world_size,
            token=self.token,
            run_dir=self.run_dir,
            placement=place_replicas(layout, cfg.replicas) if cfg.enabled else None,
            on_event=lambda text: self.progress.event(text),
        )
        self.progress.header(
            f"deadpool train: tp={job.parallel.tp} pp={job.parallel.pp} dp={job.parallel.dp} "
            f"({layout.world_size} ranks, {job.ranks_per_node} per node) + {local.spares} "
            f"spare(s), {job.train.iters} iterations, DeadPool {'on' if cfg.enabled else 'off'}"
            + (f", k={cfg.replicas}" if cfg.enabled else "")
            + f"; logs in {self.run_dir}"
        )
        t_start = time.monotonic()
        self._start()
        records: list[dict[str, Any]] = []
        # Closed in the `finally` below, after the monitor loop that writes it.
        log_file = open(self.json_log, "w") if self.json_log else None  # noqa: SIM115
        self._sigterm = False

        def on_sigterm(*_: object) -> None:
            self._sigterm = True

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            rc = self._monitor(records, log_file, t_start)
            summary = self._summary(records, rc, time.monotonic() - t_start)
            if log_file:
                log_file.write(json.dumps(summary) + "\n")
        finally:
            signal.signal(signal.SIGTERM, previous)
            local.close(grace_s=10.0)
            if log_file:
                log_file.close()
        return RunResult(returncode=rc, records=records, summary=summary, run_dir=self.run_dir)

    def _monitor(self, records: list, log_file: TextIO | None, t_start: float) -> int:
        local = self.local
        coord, members = local.coordinator, local.members
        deadpool = self.job.deadpool.enabled
        preempt_sent = False
        next_it, generation = self._first_iteration(), 0
        while True:
            if self._sigterm and not preempt_sent:  # preemption: save and stop, together
                members.request_preempt()
                preempt_sent = True
                self.progress.event(
                    "SIGTERM: every rank stops after the current iteration"
                    + (" and saves a checkpoint" if self.job.train.save else "")
                )
            local.tick()
            while deadpool and self.replenish_spares and len(coord.spares) < local.spares:
                local.add_spare(self._spawn)  # as a cluster's scheduler would add nodes
            if coord.roster.generation != generation:  # a recovery agreed: rewind the display
                generation = coord.roster.generation
                next_it = (coord.roster.restore_iteration or 0) + 1
                del records[next_it - 1 :]
            rec = members.metrics(generation, next_it)
            if rec is not None:
                records.append(rec)
                self.progress.iteration(rec, deadpool)
                if log_file:
                    log_file.write(json.dumps(rec) + "\n")
                    log_file.flush()
                next_it += 1
                continue
            if coord.aborted is not None:
                local.wait_exit(local.actives(), 30.0)
                return 3  # out of redundancy, as the workers and the Megatron-LM launcher
            failed = local.failed()
            if failed and not deadpool:
                for pid, code in failed.items():
                    self.progress.event(f"process {pid} exited with code {code}")
                    self.progress.event("its log ends:\n" + self._tail(pid))
                return 1
            if local.finished():
                if members.preempted() is not None:
                    return 143  # 128 + SIGTERM: stopped on purpose, resumable with --load
                return 0 if next_it > self.job.train.iters else 1
            if time.monotonic() - t_start > self.timeout_s:
                self.progress.event(f"run exceeded its {self.timeout_s:.0f}s limit; stopping")
                return 124
            local.wait(0.02)

    def _first_iteration(self) -> int:
        """1, or the iteration after the checkpoint `--load` resumes from."""
        load = self.job.train.load
        point = resume_point(load) if load else None
        return point[1] + 1 if point else 1

    def _summary(self, records: list, rc: int, wall_s: float) -> dict[str, Any]:
        layout = Layout(
            self.job.parallel.tp,
            self.job.parallel.pp,
            self.job.parallel.dp,
            self.job.ranks_per_node,
        )
        local = self.local
        digests = local.digests()
        digest, identical = final_digest(layout.dp_groups, digests)
        complete = rc == 0 and digest is not None
        summary = {
            "event": "summary",
            "returncode": rc,
            "iterations": len(records),
            "losses": [r["loss"] for r in records],
            "final_param_digest": digest if complete else None,
            "rank_digests": {str(r): d for r, d in sorted(digests.items())},
            "dp_replicas_identical": complete and identical,
            "committed_iteration": local.members.final_replication().get("committed_iteration"),
            "deadpool": self.job.deadpool.enabled,
            "recoveries": local.coordinator.finished,
            "out_of_redundancy": local.coordinator.aborted,
            "lost_after_training": local.coordinator.ended,
            "preempted": local.members.preempted(),
            "wall_s": wall_s,
            "median_iter_time_s": (
                statistics.median(r["iter_time_s"] for r in records) if records else None
            ),
        }
        if complete:
            loss = f", final loss {records[-1]['loss']:.4f}" if records else ""
            self.progress.header(
                f"done: {len(records)} iterations in {wall_s:.1f}s{loss}, digest "
                f"{summary['final_param_digest'][:16]}"
            )
        return summary
