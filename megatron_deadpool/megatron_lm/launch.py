"""`deadpool megatron-lm`: start a Megatron-LM script on this machine, like torchrun, with spares.

One process per rank plus `--deadpool-spares` spares, each running the script through the
zero-edit runner (`python -m megatron_deadpool.megatron_lm SCRIPT ARGS`, or the script itself
with `--patched`), with torchrun's environment (RANK = task index, WORLD_SIZE = active ranks
- tasks at or beyond it are the spares -, LOCAL_RANK, MASTER_ADDR/PORT). With `--deadpool` the launcher also hosts the job's store and
the coordinator on loopback (address and job token reach the processes through
DEADPOOL_COORDINATOR / DEADPOOL_JOB_TOKEN, so they never land in Megatron's saved args).
Unlike torchrun it does not stop the job when a rank dies: the coordinator hands the dead
rank's slot to a spare. Every process's output is forwarded as it comes (Megatron prints its
iteration lines on the last rank) and kept in RUN_DIR/{a0,a1,...,s0}.log; coordinator events
print as `[deadpool] ...` lines; RUN_DIR/summary.json records the outcome and each recovery.
Out of redundancy it waits for the survivors to save what survives and exits with code 3.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from ..devices.gpus import assign_gpus, local_gpu_count
from ..errors import ConfigError
from ..hotswap.coordinator import kill_groups
from .runner import preparse

CONFIG_ERROR_EXIT = 2
OUT_OF_REDUNDANCY_EXIT = 3


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
        self.spares = self.cfg.spares if self.cfg.enabled else 0
        self.gpus = assign_gpus(actives=nproc, spares=self.spares, gpus=local_gpu_count())
        self.run_dir = Path(run_dir or self.cfg.log_dir or tempfile.mkdtemp(prefix="deadpool-mlm-"))
        self.timeout_s = timeout_s
        self.stream = stream or sys.stdout
        self.extra_env = dict(env or {})
        self.procs: dict[str, subprocess.Popen] = {}
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.coordinator: Any = None
        self.store: Any = None

    # ------------------------------------------------------------------ output
    def _print(self, text: str) -> None:
        with self.lock:
            print(text, file=self.stream, flush=True)

    def _forward(self, pid: str, proc: subprocess.Popen) -> None:
        with open(self.run_dir / f"{pid}.log", "w") as log:
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                log.flush()
                with self.lock:
                    self.stream.write(line)
                    self.stream.flush()

    # ------------------------------------------------------------------ processes
    def _spawn(self, task: int, env: dict[str, str]) -> None:
        pid = f"a{task}" if task < self.nproc else f"s{task - self.nproc}"
        if self.patched:
            cmd = [sys.executable, self.script, *self.script_args]
        else:
            cmd = [
                sys.executable,
                "-m",
                "megatron_deadpool.megatron_lm",
                self.script,
                *self.script_args,
            ]
        child_env = {**env, "RANK": str(task), "LOCAL_RANK": str(self.gpus.local_rank(task))}
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env,
            start_new_session=True,
            bufsize=1,
        )
        self.procs[pid] = proc
        thread = threading.Thread(target=self._forward, args=(pid, proc), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _kill_all(self) -> None:
        kill_groups(self.procs.values())

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tasks = self.nproc + self.spares
        env = {**os.environ, **self.extra_env}
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(
            PYTHONUNBUFFERED="1",
            WORLD_SIZE=str(self.nproc),  # the active world; tasks beyond it are spares
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            CUDA_DEVICE_MAX_CONNECTIONS="1",
        )
        store = None
        if self.cfg.enabled:
            from ..hotswap.coordinator import Coordinator, EventLog, ProcessLiveness
            from ..hotswap.membership import Membership, host_store

            store, self._listener = host_store("127.0.0.1", 0)  # loopback only
            self.store = store
            token = self.cfg.job_token or secrets.token_hex(8)
            store.set("job/token", token)
            env.update(DEADPOOL_COORDINATOR=f"127.0.0.1:{store.port}", DEADPOOL_JOB_TOKEN=token)
            self.coordinator = Coordinator(
                Membership(store, "launcher"),
                self.nproc,
                None,  # the layout arrives from rank 0 once Megatron's groups exist
                [f"s{i}" for i in range(self.spares)],
                heartbeat_timeout=self.cfg.heartbeat_timeout,
                agree_timeout=self.cfg.heartbeat_timeout + 30.0,
                liveness=ProcessLiveness(self.procs),
                events=EventLog(self.run_dir / "events.jsonl"),
                on_event=lambda text: self._print(f"[deadpool] {text}"),
            )
            self.coordinator.start()
        self._print(
            f"[deadpool] megatron-lm: {self.nproc} rank(s) + {self.spares} spare(s) of "
            f"{os.path.basename(self.script)}{' (patched)' if self.patched else ''}, DeadPool "
            f"{'on' if self.cfg.enabled else 'off'}; logs in {self.run_dir}"
        )
        t0 = time.monotonic()
        rc = 1
        try:
            for task in range(tasks):
                self._spawn(task, env)
            rc = self._monitor(t0)
        finally:
            if store is not None:
                store.set("shutdown", "1")  # waiting spares leave
            deadline = time.monotonic() + (10 if rc == 0 else 0)
            while time.monotonic() < deadline and any(
                p.poll() is None for p in self.procs.values()
            ):
                time.sleep(0.05)
            self._kill_all()
            self._write_summary(rc, time.monotonic() - t0)
        return rc

    def _monitor(self, t0: float) -> int:
        coord = self.coordinator
        while True:
            if coord is not None:
                coord.tick()
            actives = (
                list(coord.roster.slots.values())
                if coord is not None
                else [f"a{r}" for r in range(self.nproc)]
            )
            codes = {pid: self.procs[pid].poll() for pid in actives}
            config_errors = [p for p, c in codes.items() if c == CONFIG_ERROR_EXIT]
            if config_errors:
                self._print(f"[deadpool] {config_errors[0]} exited with a configuration error")
                return CONFIG_ERROR_EXIT
            if coord is None:
                failed = {p: c for p, c in codes.items() if c not in (None, 0)}
                if failed:
                    pid, code = next(iter(failed.items()))
                    self._print(f"[deadpool] {pid} exited with code {code}; stopping the job")
                    return code
            elif coord.aborted is not None:  # survivors save what survives, then exit 3
                self._wait_exit(actives, 60.0)
                return OUT_OF_REDUNDANCY_EXIT
            if all(c == 0 for c in codes.values()) and (coord is None or coord.recovery is None):
                return 0
            if time.monotonic() - t0 > self.timeout_s:
                self._print(f"[deadpool] the job exceeded its {self.timeout_s:.0f}s limit")
                return 124
            time.sleep(0.05)

    def _wait_exit(self, pids: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(self.procs[p].poll() is None for p in pids):
            time.sleep(0.05)

    def _digests(self) -> dict[str, str]:
        """Each rank's final parameter digest (DeadPool runs): equal digests, equal weights."""
        out: dict[str, str] = {}
        for r in range(self.nproc):
            if self.store is not None and self.store.check([f"digest/{r}"]):
                out[str(r)] = self.store.get(f"digest/{r}").decode()
        return out

    def _write_summary(self, rc: int, wall_s: float) -> None:
        coord = self.coordinator
        summary = {
            "returncode": rc,
            "wall_s": round(wall_s, 3),
            "ranks": self.nproc,
            "spares": self.spares,
            "deadpool": self.cfg.enabled,
            "recoveries": coord.finished if coord else [],
            "out_of_redundancy": coord.aborted if coord else None,
            "exit_codes": {pid: p.poll() for pid, p in self.procs.items()},
            "param_digests": self._digests(),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
