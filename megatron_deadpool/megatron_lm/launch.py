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
failing as the rank it replaced did: `hotswap/job_error.py`) it prints `JOB ERROR: ...` and the
end of that rank's log, stops every process and exits with code 9.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from ..config.paths import check_writable_dir
from ..durable import write_durably
from ..errors import ConfigError, ExitCode
from ..hotswap.forkserver import Preload
from ..hotswap.local_job import LocalJob
from ..hotswap.messages import JobError, task_of
from ..hotswap.seal import SECRET_ENV, SECRET_FILE_ENV, job_secret, new_secret
from ..hotswap.supervisor import Supervisor
from .interplay import check_megatron_flags
from .runner import preparse

RUNNER_IMPORTS = (
    *(
        f"megatron_deadpool.megatron_lm.{name}"
        for name in ("hooks", "log_level", "resume", "session", "workers")
    ),
    "megatron_deadpool.hotswap.private_world",
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
    ) -> None:
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
        for path, flag in ((run_dir, "--run-dir"), (self.cfg.log_dir, "--deadpool-log-dir")):
            if path:
                check_writable_dir(path, flag)
        save = megatron_save_dir(self.script_args)
        if save:
            check_writable_dir(save, "--save")
        self.run_dir = Path(run_dir or self.cfg.log_dir or tempfile.mkdtemp(prefix="deadpool-mlm-"))
        self.timeout_s = timeout_s
        self.stream = stream or sys.stdout
        self.extra_env = dict(env or {})
        self.threads: dict[str, threading.Thread] = {}  # member -> its output's forwarder
        self.lock = threading.Lock()
        self._local: LocalJob | None = None
        self.ended = False  # every active rank finished its work (`LocalJob.finished`)
        self.unsaved: dict[int, str] = {}  # Megatron's checkpoints not saved, each one's line
        self._next_look = 0.0  # when `_show_unsaved` next reads the store

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
        thread = threading.Thread(
            target=self._forward, args=(member, self.local.procs[member]), daemon=True
        )
        thread.start()
        self.threads[member] = thread

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
        self._local = local = LocalJob(
            self.cfg,
            world_size=self.nproc,
            token=token,
            run_dir=self.run_dir,
            say=lambda text: self._print(f"[deadpool] {text}"),
            spawn=lambda member: self._spawn(member, env),  # env: complete before any spawn
        )
        if self.cfg.enabled:
            env.pop(SECRET_FILE_ENV, None)
            env.update({"DEADPOOL_COORDINATOR": local.address, SECRET_ENV: token})
        self._print(
            f"[deadpool] megatron-lm: {self.nproc} rank(s) + {self.spares} spare(s) of "
            f"{os.path.basename(self.script)}{' (patched)' if self.patched else ''}, DeadPool "
            f"{'on' if self.cfg.enabled else 'off'}; logs in {self.run_dir}"
        )
        t0 = time.monotonic()
        rc = 1
        try:
            for member in local.members:
                self._spawn(member, env)
            rc = self._monitor(t0)
        finally:
            with contextlib.suppress(RuntimeError, OSError, ValueError):  # the store is gone
                self._show_unsaved()
            local.close(grace_s=10 if self.ended else 0)
            self._write_summary(rc, time.monotonic() - t0)
        return rc

    def _monitor(self, t0: float) -> int:
        """Supervise the job (`hotswap.supervisor`)."""
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
                flush=lambda member: self.threads[member].join(timeout=2.0),  # all forwarded
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
                self._show_unsaved()
            return False

        return Supervisor(
            local,
            limit_s=self.timeout_s - (time.monotonic() - t0),
            say=lambda text: self._print(f"[deadpool] {text}"),
            finished=finished,
            on_failed=failed,
            on_job_error=job_error,
            on_tick=look_for_unsaved,
            checks=[config_error],
        ).run()

    def _show_unsaved(self) -> None:
        """Print each of Megatron's checkpoints that could not be written, once (rank 0
        publishes its line: `megatron_lm/save.py`)."""
        if not self.cfg.enabled:
            return
        failures = self.local.membership.checkpoint_failures()
        for iteration, line in sorted(failures.lines.items()) if failures else ():
            if iteration not in self.unsaved:
                self.unsaved[iteration] = line
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
            "checkpoints_not_saved": {str(t): line for t, line in sorted(self.unsaved.items())},
            "exit_codes": {member: p.poll() for member, p in local.procs.items()},
            # each rank's digest of its final parameters and buffers (`digest.rank_digest`)
            "param_digests": {str(r): d for r, d in local.digests().items()},
        }
        write_durably(self.run_dir / "summary.json", json.dumps(summary, indent=2).encode())
