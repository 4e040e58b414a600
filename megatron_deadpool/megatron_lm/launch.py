"""`deadpool megatron-lm`: start a Megatron-LM script on this machine, like torchrun, with spares.

One process per rank plus `--deadpool-spares` spares, each running the script through the
zero-edit runner (`python -m megatron_deadpool.megatron_lm SCRIPT ARGS`, or the script itself
with `--patched`), with torchrun's environment (RANK = task index, WORLD_SIZE = active ranks
- tasks at or beyond it are the spares -, LOCAL_RANK, MASTER_ADDR/PORT). With `--deadpool` the
launcher also hosts the job's store and the coordinator on loopback (address and job secret
reach the processes through DEADPOOL_COORDINATOR / DEADPOOL_JOB_TOKEN, so they never land in
Megatron's saved args nor on a command line).
Unlike torchrun it does not stop the job when a rank dies: the coordinator hands the dead
rank's slot to a spare. Every process's output is forwarded as it comes (Megatron prints its
iteration lines on the last rank) and kept in RUN_DIR/{a0,a1,...,s0}.log; coordinator events
print as `[deadpool] ...` lines, and so does each of Megatron's checkpoints that could not be
written (`save.py`); RUN_DIR/summary.json records the outcome, each recovery and those lines.
Out of redundancy it waits for the survivors to save what survives and exits with code 3. When
the coordinator finds the job's own error (every rank failing in Megatron's start-up, a spare
failing as the rank it replaced did: `hotswap/coordinator/job_error.py`) it prints `JOB ERROR: ...` and the
end of that rank's log, stops every process and exits with code 9.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from ..config.paths import check_writable_dir, check_writable_file
from ..devices.threads import start_thread
from ..durable import write_durably
from ..errors import ConfigError, ExitCode
from ..hotswap.launch.forkserver import Preload
from ..hotswap.launch.local_agents import LocalAgents
from ..hotswap.launch.local_job import LocalJob
from ..hotswap.launch.monitor import Monitor
from ..hotswap.protocol.messages import JobError, OutOfRedundancy, task_of
from ..hotswap.protocol.seal import SECRET_ENV, SECRET_FILE_ENV, job_secret, new_secret
from ..hotswap.report.metrics_file import MetricsFile, watch_events
from ..hotswap.report.salvage_note import salvage_lines
from ..replication.save_dir import choose_resume
from .interplay import check_megatron_flags
from .runner import preparse

RUNNER_IMPORTS = (
    *(
        f"megatron_deadpool.megatron_lm.{name}"
        for name in ("hooks", "log_level", "resume", "session", "workers")
    ),
    "megatron_deadpool.hotswap.worker.private_world",
)
"""What the runner imports once the script calls `pretrain` (preloaded with the script's imports)."""


def runner_preload(script: str) -> Preload:
    """What every process of `script` imports, as the runner imports it: the script's
    Megatron-LM tree first on the import path (never the installed megatron-core), `prepare()`
    (Python for the tree's release, the CPU mode), then the script's own top-level imports."""
    return Preload(
        ("megatron_deadpool.megatron_lm.runner:prepare", *RUNNER_IMPORTS),
        path=(os.path.dirname(script),),
        scripts=(script,),
    )


def deadpool_settings(script_args: Sequence[str]) -> list[str]:
    """The `--deadpool-*` flags of the script's command line (each with its value), for the
    node agents, which judge the job by the same settings."""
    out: list[str] = []
    args = list(script_args)
    for i, arg in enumerate(args):
        if not arg.startswith("--deadpool-") or arg.startswith("--deadpool-job-token"):
            continue
        if "=" in arg or arg.startswith("--deadpool-no-") or arg == "--deadpool-join":
            out.append(arg)
        elif i + 1 < len(args):
            out += [arg, args[i + 1]]
    return out


def megatron_load_dir(script_args: Sequence[str]) -> str | None:
    """Megatron-LM's `--load` on the script's command line, if any."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--load")
    return parser.parse_known_args(list(script_args))[0].load


def resume_args(script_args: Sequence[str], save: str) -> list[str]:
    """`script_args` to resume from `save`: its injected faults (--deadpool-fail) and its
    `--load` dropped, `--load SAVE` added."""
    out: list[str] = []
    skip = False
    for arg in script_args:
        if skip:
            skip = False
            continue
        if arg in ("--deadpool-fail", "--load"):
            skip = True
            continue
        if arg.startswith(("--deadpool-fail=", "--load=")):
            continue
        out.append(arg)
    return [*out, "--load", save]


def megatron_save_dir(script_args: Sequence[str]) -> str | None:
    """Megatron-LM's `--save` on the script's command line, if any: checked before any process
    starts (Megatron itself finds an unwritable one at its first save). Its `--load` is left to
    Megatron: a folder without a checkpoint starts the run from scratch there, which is how a
    job that saves and resumes in one folder starts the first time."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--save")
    return parser.parse_known_args(list(script_args))[0].save


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MegatronLauncher:
    """Runs `nproc` ranks (+ spares) of a Megatron-LM script; `run()` returns the exit code."""

    def __init__(
        self,
        script: str,
        script_args: Sequence[str],
        nproc: int,
        *,
        patched: bool = False,
        run_dir: str | None = None,
        timeout_s: float = 3600.0,
        stream: TextIO | None = None,
        env: dict[str, str] | None = None,
        node_agents: bool = False,
    ) -> None:
        """`node_agents`: one `deadpool agent` per simulated node starts and respawns its
        processes, as on a cluster (`hotswap.launch.local_agents`), and their output is followed in
        their logs; needs --deadpool and --deadpool-ranks-per-node."""
        if nproc < 1:
            raise ConfigError("nproc-per-node: must be >= 1")
        if not os.path.isfile(script):
            raise ConfigError(f"script {script!r} does not exist")
        self.script = os.path.abspath(script)
        self.script_args = list(script_args)
        self.nproc = nproc
        self.patched = patched
        self.cfg = preparse(self.script_args)
        check_megatron_flags(self.script_args, self.cfg)  # before any process (and spare) starts
        self.spares = self.cfg.spares if self.cfg.enabled else 0
        if node_agents and not (self.cfg.enabled and self.cfg.ranks_per_node):
            raise ConfigError(
                "--node-agents: node agents serve DeadPool and start each node's ranks: give the "
                "script --deadpool and --deadpool-ranks-per-node N"
            )
        self.node_agents = node_agents
        for path, flag in ((run_dir, "--run-dir"), (self.cfg.log_dir, "--deadpool-log-dir")):
            if path:
                check_writable_dir(path, flag)
        save = megatron_save_dir(self.script_args)
        if save:
            check_writable_dir(save, "--save")
        if self.cfg.enabled and self.cfg.metrics_file:
            check_writable_file(self.cfg.metrics_file, "--deadpool-metrics-file")
        self.run_dir = Path(run_dir or self.cfg.log_dir or tempfile.mkdtemp(prefix="deadpool-mlm-"))
        self.timeout_s = timeout_s
        self.stream = stream or sys.stdout
        self.extra_env = dict(env or {})
        self.threads: dict[str, threading.Thread] = {}  # member -> its output's forwarder
        self.lock = threading.Lock()
        self._local: LocalJob | None = None
        self.ended = False  # every active rank finished its work (`LocalJob.finished`)
        self.ended_following = False  # the agents' logs read to their end (`_follow_logs`)
        self.metrics: MetricsFile | None = None  # --deadpool-metrics-file
        # The supervision loop, and Megatron's checkpoints not saved (each said once).
        self.monitor = Monitor(lambda text: self._print(f"[deadpool] {text}"), self.cfg.enabled)
        self._next_look = 0.0  # when the monitor next reads the store for checkpoints not saved

    @property
    def local(self) -> LocalJob:
        """The job's store, coordinator and processes (once `run` started them)."""
        if self._local is None:
            raise RuntimeError("the job has not started yet (`run`)")
        return self._local

    # ------------------------------------------------------------------ output
    def _print(self, text: str) -> None:
        with self.lock:
            print(text, file=self.stream, flush=True)

    def _forward(self, member: str, proc: subprocess.Popen) -> None:
        with open(self.local.log_path(member), "w") as log:
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                log.flush()
                with self.lock:
                    self.stream.write(line)
                    self.stream.flush()

    # ------------------------------------------------------------------ processes
    def _spawn(self, member: str, env: dict[str, str]) -> None:
        task = task_of(member, self.nproc)
        runner = [] if self.patched else ["-m", "megatron_deadpool.megatron_lm"]
        cmd = [sys.executable, *runner, self.script, *self.script_args]
        child_env = {**env, "RANK": str(task)}  # LOCAL_RANK: LocalJob.spawn
        self.local.spawn(
            member, cmd, child_env, subprocess.PIPE, preload=runner_preload(self.script)
        )
        self.threads[member] = start_thread(
            self._forward, member, self.local.procs[member], name=f"deadpool-output-{member}"
        )

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.extra_env}
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(
            PYTHONUNBUFFERED="1",
            WORLD_SIZE=str(self.nproc),  # the active world; tasks beyond it are spares
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            CUDA_DEVICE_MAX_CONNECTIONS="1",
        )
        token = job_secret(self.cfg.job_token) or new_secret()
        host = LocalAgents if self.node_agents else LocalJob
        self._local = local = host(
            self.cfg,
            world_size=self.nproc,
            token=token,
            run_dir=self.run_dir,
            say=lambda text: self._print(f"[deadpool] {text}"),
            spawn=None if self.node_agents else lambda member: self._spawn(member, env),
        )  # env: complete before any spawn
        if self.cfg.enabled and self.cfg.metrics_file:  # events, and rank 0's progress
            coord = local.coordinator
            self.metrics = watch_events(
                coord.events, self.cfg.metrics_file, lambda: len(coord.spares)
            )
        if self.cfg.enabled:
            env.pop(SECRET_FILE_ENV, None)
            env.update({"DEADPOOL_COORDINATOR": local.address, SECRET_ENV: token})
        self._print(
            f"[deadpool] megatron-lm: {self.nproc} rank(s) + {self.spares} spare(s) of "
            f"{os.path.basename(self.script)}{' (patched)' if self.patched else ''}, DeadPool "
            f"{'on' if self.cfg.enabled else 'off'}; logs in {self.run_dir}"
        )
        self._say_load()
        t0 = time.monotonic()
        rc = 1
        try:
            if isinstance(local, LocalAgents):
                self._start_agents(local, env)
            else:
                for member in local.members:
                    self._spawn(member, env)
            rc = self._monitor(t0)
            oor = local.coordinator.out_of_redundancy if self.cfg.enabled else None
            if rc == ExitCode.OUT_OF_REDUNDANCY and oor is not None:
                self._say_salvage(oor)
        finally:
            with contextlib.suppress(RuntimeError, OSError, ValueError):  # the store is gone
                self.monitor.show_unsaved(local.membership)
                self._show_progress()  # its last step, however soon after it the job ended
            local.close(grace_s=10 if self.ended else 0)
            self.ended_following = True
            if "agents" in self.threads:
                self.threads["agents"].join(timeout=2.0)
            self._write_summary(rc, time.monotonic() - t0)
        return rc

    def _show_progress(self) -> None:
        """Rank 0's progress (`Progress`: iteration, committed iteration, replica bytes) into
        the metrics file (--deadpool-metrics-file)."""
        progress = self.local.membership.progress_record() if self.metrics else None
        if self.metrics is not None and progress is not None:
            self.metrics.on_progress(progress)

    def _start_agents(self, local: LocalAgents, env: dict[str, str]) -> None:
        """One `deadpool agent` per simulated node, with the script's --deadpool-* settings;
        their processes' output followed in RUN_DIR/task-*.log."""
        runner = [] if self.patched else ["-m", "megatron_deadpool.megatron_lm"]
        worker = [sys.executable, *runner, self.script, *self.script_args]
        local.start_agents(worker, env, deadpool_settings(self.script_args))
        self.threads["agents"] = start_thread(self._follow_logs, name="deadpool-output-agents")

    def _follow_logs(self) -> None:
        """Print what the agents' processes write to their logs, line by line, as it comes
        (a respawned process appends to its predecessor's task log)."""
        offsets: dict[Path, int] = {}
        partial: dict[Path, str] = {}
        while True:
            for path in sorted(self.run_dir.glob("task-*.log")):
                with contextlib.suppress(OSError), open(path, errors="replace") as f:
                    f.seek(offsets.get(path, 0))
                    text = partial.pop(path, "") + f.read()
                    offsets[path] = f.tell()
                *lines, rest = text.split("\n")
                if rest:
                    partial[path] = rest
                if lines:
                    with self.lock:
                        self.stream.write("".join(line + "\n" for line in lines))
                        self.stream.flush()
            if self.ended_following:
                return
            time.sleep(0.2)

    def _monitor(self, t0: float) -> int:
        """Supervise the job (`hotswap.launch.supervisor`)."""
        local = self.local

        def config_error() -> int | None:
            codes = local.exit_codes(local.actives())
            refused = [m for m, c in codes.items() if c == ExitCode.BAD_INPUT]
            if not refused:
                return None
            self._print(f"[deadpool] {refused[0]} exited with a configuration error")
            return ExitCode.BAD_INPUT

        def failed(members: dict[str, int]) -> int:
            member, code = next(iter(members.items()))
            self._print(f"[deadpool] {member} exited with code {code}; stopping the job")
            return code

        def job_error(verdict: JobError) -> int:
            return local.job_error(
                verdict,
                lambda text: self._print(f"[deadpool] {text}"),
                flush=lambda member: self._flush(member),  # all forwarded
            )

        def finished() -> int:
            self.ended = True
            # The same exit code from every rank is the job's own (Megatron's rerun state
            # machine ends a job with 16 or 17 on all of them); a rank lost after its work was
            # done (killed: a negative code) is not.
            ends = {c for c in local.exit_codes(local.actives()).values() if c is not None}
            return ends.pop() if len(ends) == 1 and min(ends) > 0 else ExitCode.OK

        def look_for_unsaved() -> bool:
            if time.monotonic() >= self._next_look:
                self._next_look = time.monotonic() + 0.5
                self.monitor.show_unsaved(local.membership)
                self._show_progress()
            return False

        return self.monitor.run(
            local,
            deadline=t0 + self.timeout_s,
            finished=finished,
            on_failed=failed,
            on_job_error=job_error,
            on_tick=look_for_unsaved,
            checks=[config_error],
        )

    def _flush(self, member: str) -> None:
        """Wait (a little) until `member`'s output was forwarded."""
        thread = self.threads.get(member) or self.threads.get("agents")
        if thread is not None:
            thread.join(timeout=2.0)

    def _say_load(self) -> None:
        """A `--load` folder that holds nothing to resume: said here (Megatron says it only in
        the ranks' logs, and starts at iteration 1)."""
        load = megatron_load_dir(self.script_args)
        if load and os.path.isdir(load) and choose_resume(load).kind is None:
            self._print(
                f"[deadpool] --load {load}: nothing to resume there (no checkpoint, no snapshot "
                "set); Megatron starts at iteration 1"
            )

    def _say_salvage(self, oor: OutOfRedundancy) -> None:
        """Out of redundancy: what the survivors saved in Megatron's --save and how to resume."""
        save = megatron_save_dir(self.script_args)
        command = shlex.join(
            ["deadpool", "megatron-lm", "--nproc-per-node", str(self.nproc),
             *(["--patched"] if self.patched else []), self.script,
             *resume_args(self.script_args, save or "SAVE")]
        )  # fmt: skip
        for line in salvage_lines(oor, save, command):
            self._print(f"[deadpool] {line}")

    def _write_summary(self, rc: int, wall_s: float) -> None:
        local = self.local
        coord = local.coordinator if self.cfg.enabled else None
        oor = coord.out_of_redundancy if coord else None
        job_error = coord.job_error if coord else None
        ended = coord.ended if coord else None
        summary = {
            "returncode": rc,
            "wall_s": round(wall_s, 3),
            "ranks": self.nproc,
            "spares": self.spares,
            "deadpool": self.cfg.enabled,
            "recoveries": coord.recoveries if coord else [],
            "spares_left": list(coord.spares) if coord else [],
            "out_of_redundancy": oor.to_dict() if oor else None,
            "job_error": job_error.to_dict() if job_error else None,
            "lost_after_training": ended.to_dict() if ended else None,
            "checkpoints_not_saved": {
                str(t): line for t, line in sorted(self.monitor.unsaved.items())
            },
            "exit_codes": {member: p.poll() for member, p in local.procs.items()},
            # each rank's digest of its final parameters and buffers (`digest.rank_digest`)
            "param_digests": {str(r): d for r, d in local.digests().items()},
        }
        write_durably(self.run_dir / "summary.json", json.dumps(summary, indent=2).encode())
