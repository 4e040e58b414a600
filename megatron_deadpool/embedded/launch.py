"""Local launcher of the embedded job: store host, actives + spares, progress, JSON log.

It plays the coordinator's role in-process (hosts the TCPStore on loopback, publishes the
roster, watches the processes) and starts one process per active rank plus the spares, like
torchrun but without restarting anyone on a failure.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from ..config.job import JobConfig
from ..devices.gpus import assign_gpus, local_gpu_count
from ..digest import job_digest
from ..hotswap.coordinator import Coordinator, EventLog, ProcessLiveness, kill_groups
from ..hotswap.membership import Membership, host_store
from ..replication.placement import Layout, place_replicas
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
        self.procs: dict[str, subprocess.Popen] = {}
        self.token = job.deadpool.job_token or secrets.token_hex(8)
        spares = job.deadpool.spares if job.deadpool.enabled else 0
        self.gpus = assign_gpus(
            actives=job.parallel.world_size, spares=spares, gpus=local_gpu_count()
        )

    # ------------------------------------------------------------------ processes
    def _worker_command(self) -> list[str]:
        """The program each process runs (before its arguments); benchmarks substitute theirs."""
        return [sys.executable, "-m", "megatron_deadpool.embedded.worker"]

    def _worker_env(self) -> dict[str, str]:
        return dict(os.environ)

    def _spawn(self, pid: str, config_path: Path, address: str) -> None:
        env = self._worker_env()
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
        world = len(self.gpus.actives)
        task = int(pid[1:]) + (world if pid.startswith("s") else 0)
        slots = len(self.gpus.actives) + len(self.gpus.spares)
        env["LOCAL_RANK"] = str(self.gpus.local_rank(task % slots))  # replenished spares wrap
        cmd = [
            *self._worker_command(),
            "--config",
            str(config_path),
            "--pid",
            pid,
            "--deadpool-coordinator",
            address,
            "--deadpool-job-token",
            self.token,
        ]
        with open(self.run_dir / f"{pid}.log", "w") as log:  # the child keeps its own copy
            self.procs[pid] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        log.close()

    def _kill_all(self) -> None:
        kill_groups(self.procs.values())

    def _tail(self, pid: str, lines: int = 15) -> str:
        path = self.run_dir / f"{pid}.log"
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(f"    {pid}| {line}" for line in text[-lines:])

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        job, cfg = self.job, self.job.deadpool
        world = job.parallel.world_size
        layout = Layout(job.parallel.tp, job.parallel.pp, job.parallel.dp, job.ranks_per_node)
        placement = place_replicas(layout, cfg.replicas) if cfg.enabled else None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.run_dir / "job.yaml"
        config_path.write_text(yaml.safe_dump(job.to_dict(), sort_keys=False))
        store, self._listener = host_store("127.0.0.1", 0)  # loopback only
        address = f"127.0.0.1:{store.port}"
        members = Membership(store, "launcher")
        store.set("job/token", self.token)
        spares = cfg.spares if cfg.enabled else 0
        self.coordinator = Coordinator(
            members,
            world,
            placement,
            [f"s{i}" for i in range(spares)],
            heartbeat_timeout=cfg.heartbeat_timeout,
            agree_timeout=cfg.heartbeat_timeout + 30.0,
            liveness=ProcessLiveness(self.procs),
            events=EventLog(self.run_dir / "events.jsonl"),
            on_event=self.progress.event,
        )
        self.coordinator.start()
        self.progress.header(
            f"deadpool train: tp={job.parallel.tp} pp={job.parallel.pp} dp={job.parallel.dp} "
            f"({world} ranks, {job.ranks_per_node} per node) + {spares} spare(s), "
            f"{job.train.iters} iterations, DeadPool {'on' if cfg.enabled else 'off'}"
            + (f", k={cfg.replicas}" if cfg.enabled else "")
            + f"; logs in {self.run_dir}"
        )
        t_start = time.monotonic()
        for r in range(world):
            self._spawn(f"a{r}", config_path, address)
        for s in range(spares):
            self._spawn(f"s{s}", config_path, address)
        self._spawn_spare = lambda: self._spawn(f"s{self._next_spare}", config_path, address)
        self._next_spare = spares
        records: list[dict[str, Any]] = []
        # Closed in the `finally` below, after the monitor loop that writes it.
        log_file = open(self.json_log, "w") if self.json_log else None  # noqa: SIM115
        self._sigterm = False

        def on_sigterm(*_: object) -> None:
            self._sigterm = True

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            rc = self._monitor(members, records, log_file, t_start)
            summary = self._summary(members, records, rc, time.monotonic() - t_start)
            if log_file:
                log_file.write(json.dumps(summary) + "\n")
        finally:
            signal.signal(signal.SIGTERM, previous)
            store.set("shutdown", "1")
            # Ranks finish on their own; spares without a slot (maybe still starting up, and
            # unable to see the shutdown yet) are simply stopped.
            self._wait_exit(list(self.coordinator.roster.slots.values()), 10.0)
            self._kill_all()
            if log_file:
                log_file.close()
        return RunResult(returncode=rc, records=records, summary=summary, run_dir=self.run_dir)

    def _monitor(
        self, members: Membership, records: list, log_file: TextIO | None, t_start: float
    ) -> int:
        coord = self.coordinator
        deadpool = self.job.deadpool.enabled
        preempt_sent = False
        next_it, generation = self._first_iteration(), 0
        while True:
            if self._sigterm and not preempt_sent:  # preemption: save and stop, together
                members.store.set("preempt", "1")
                preempt_sent = True
                self.progress.event(
                    "SIGTERM: every rank stops after the current iteration"
                    + (" and saves a checkpoint" if self.job.train.save else "")
                )
            if deadpool:
                coord.tick()
                self._replenish(coord)
            if coord.roster.generation != generation:  # a recovery agreed: rewind the display
                generation = coord.roster.generation
                next_it = (coord.roster.restore_iteration or 0) + 1
                del records[next_it - 1 :]
            rec = members.read(f"metrics/g{generation}/{next_it}")
            if rec is not None:
                records.append(rec)
                self.progress.iteration(rec, deadpool)
                if log_file:
                    log_file.write(json.dumps(rec) + "\n")
                    log_file.flush()
                next_it += 1
                continue
            if coord.aborted is not None:
                self._wait_exit(list(coord.roster.slots.values()), 30.0)
                return 1
            actives = list(coord.roster.slots.values())
            codes = {pid: self.procs[pid].poll() for pid in actives}
            failed = {
                pid: c
                for pid, c in codes.items()
                if c not in (None, 0) and (not deadpool or pid not in coord.dead_pids)
            }
            if failed and not deadpool:
                for pid, code in failed.items():
                    self.progress.event(f"process {pid} exited with code {code}")
                    self.progress.event("its log ends:\n" + self._tail(pid))
                return 1
            if all(c == 0 for c in codes.values()) and coord.recovery is None:
                if members.store.check(["preempted"]):
                    return 143  # 128 + SIGTERM: stopped on purpose, resumable with --load
                return 0 if next_it > self.job.train.iters else 1
            if time.monotonic() - t_start > self.timeout_s:
                self.progress.event(f"run exceeded its {self.timeout_s:.0f}s limit; stopping")
                return 124
            time.sleep(0.02)

    def _replenish(self, coord: Coordinator) -> None:
        """Keep the spare pool full (as a cluster's scheduler would add nodes), if asked."""
        while self.replenish_spares and len(coord.spares) < self.job.deadpool.spares:
            pid = f"s{self._next_spare}"
            self._spawn_spare()
            self._next_spare += 1
            coord.spares.append(pid)
            coord.events("spare_added", pid=pid, spares=len(coord.spares))

    def _first_iteration(self) -> int:
        """1, or the iteration after the checkpoint `--load` resumes from."""
        from ..replication.save_dir import resume_point

        load = self.job.train.load
        point = resume_point(load) if load else None
        return point[1] + 1 if point else 1

    def _wait_exit(self, pids: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(
            self.procs[p].poll() is None for p in pids if p in self.procs
        ):
            time.sleep(0.05)

    def _summary(
        self, members: Membership, records: list, rc: int, wall_s: float
    ) -> dict[str, Any]:
        layout = Layout(
            self.job.parallel.tp,
            self.job.parallel.pp,
            self.job.parallel.dp,
            self.job.ranks_per_node,
        )
        digests = {}
        for r in range(layout.world_size):
            if members.store.check([f"digest/{r}"]):
                digests[r] = members.store.get(f"digest/{r}").decode()
        dp0 = {g[0] for g in layout.dp_groups}
        complete = rc == 0 and all(r in digests for r in range(layout.world_size))
        final = members.read("replication/final") or {}
        summary = {
            "event": "summary",
            "returncode": rc,
            "iterations": len(records),
            "losses": [r["loss"] for r in records],
            "final_param_digest": job_digest({r: digests[r] for r in dp0}) if complete else None,
            "rank_digests": {str(r): d for r, d in sorted(digests.items())},
            "dp_replicas_identical": complete
            and all(len({digests[r] for r in g}) == 1 for g in layout.dp_groups),
            "committed_iteration": final.get("committed_iteration"),
            "deadpool": self.job.deadpool.enabled,
            "recoveries": self.coordinator.finished,
            "out_of_redundancy": self.coordinator.aborted,
            "preempted": members.read("preempted"),
            "wall_s": wall_s,
            "median_iter_time_s": _median([r["iter_time_s"] for r in records]),
        }
        if complete:
            self.progress.header(
                f"done: {len(records)} iterations in {wall_s:.1f}s, final loss "
                f"{records[-1]['loss']:.4f}, digest {summary['final_param_digest'][:16]}"
            )
        return summary


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
