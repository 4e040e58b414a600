"""Runs the selftest's checks in order, printing each row as it finishes.

The training-run checks are `deadpool train` runs of a tiny GPT (the CPU demo's sizes) on this
machine, through the same launcher (`embedded.launch.LocalLauncher`, each run with its own
store and coordinator on a free port): tp=1, pp=1, dp=N with one rank per failure domain, so
every replica lands on another "node" by the real placement. One failure-free run
(`replication`), then the same job with rank 1 SIGKILLed (`peer killed`) and SIGSTOPped
(`peer frozen`) as iteration 3 starts, each ending bitwise equal to the failure-free run.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..config.deadpool import DeadpoolConfig
from ..config.job import JobConfig, ParallelConfig, TrainConfig
from ..devices.gpus import assign_gpus, local_gpu_count
from ..errors import ConfigError
from ..replication.placement import Layout, place_replicas
from . import device_checks, judge
from .table import Row, exit_code, header, render, report, verdict

ITERS = 5
FAILED_RANK = 1
FAIL_AT = 3
HEARTBEAT_TIMEOUT_S = 3.0
HEARTBEAT_INTERVAL_S = 0.5


@dataclass(frozen=True)
class Options:
    """`deadpool selftest`'s flags, validated: `ConfigError` names the flag and the fix."""

    nproc: int
    spares: int = 1
    timeout_s: float = 600.0
    json_path: str | None = None
    run_dir: str | None = None

    def __post_init__(self) -> None:
        if self.nproc < 2:
            raise ConfigError(
                f"--nproc: {self.nproc} is too few; a replica needs a peer on another node, "
                "so the selftest needs at least 2 ranks (e.g. --nproc 4)"
            )
        if self.spares < 1:
            raise ConfigError(
                f"--spares: {self.spares} is too few; the 'peer killed' and 'peer frozen' "
                "checks each replace a rank with a spare (use --spares 1)"
            )
        if not self.timeout_s > 0:
            raise ConfigError(
                f"--timeout: must be a positive number of seconds, got {self.timeout_s}"
            )
        gpus = local_gpu_count()
        try:
            assign_gpus(actives=self.nproc, spares=self.spares, gpus=gpus)
        except ConfigError as exc:
            raise ConfigError(f"{exc}; or DEADPOOL_DEVICE=cpu to run the checks on gloo") from None


def job(options: Options, fail: list[str], spares: int) -> JobConfig:
    """The selftest's job: the default tiny GPT, dp=N, one rank per node, fast heartbeats."""
    return JobConfig(
        parallel=ParallelConfig(tp=1, pp=1, dp=options.nproc),
        train=TrainConfig(iters=ITERS),
        deadpool=DeadpoolConfig(
            enabled=True,
            spares=spares,
            replicas=1,
            ranks_per_node=1,
            heartbeat_timeout=HEARTBEAT_TIMEOUT_S,
            heartbeat_interval=HEARTBEAT_INTERVAL_S,
            fail=fail,
        ),
    )


def device_name(gpus: int | None) -> str:
    if gpus is None:
        return "cpu (gloo, CPU development mode)"
    import torch

    return f"cuda: {gpus} x {torch.cuda.get_device_name(0)} (nccl)"


def environment(gpus: int | None, run_dir: Path) -> dict[str, Any]:
    """What a bug report needs to know about this machine and its software."""
    import torch

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "megatron_core": version("megatron-core"),
        "megatron_deadpool": version("megatron-deadpool"),
        "device": device_name(gpus),
        "run_dir": str(run_dir),
    }


class Suite:
    """The checks of one `deadpool selftest`, their rows in order."""

    def __init__(self, options: Options, stream: TextIO | None = None) -> None:
        self.options = options
        self.stream = stream or sys.stdout
        self.deadline = time.monotonic() + options.timeout_s
        self.run_dir = Path(options.run_dir or tempfile.mkdtemp(prefix="deadpool-selftest-"))
        self.gpus = local_gpu_count()
        self.rows: list[Row] = []

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _add(self, row: Row) -> None:
        self.rows.append(row)
        self._print(render(row))

    def _launch(self, name: str, fail: list[str], spares: int) -> tuple[Any, float]:
        from ..embedded.launch import LocalLauncher

        run_dir = self.run_dir / name
        launcher = LocalLauncher(
            job(self.options, fail, spares),
            json_log=str(run_dir / "run.jsonl"),
            run_dir=str(run_dir),
            timeout_s=max(1.0, self.deadline - time.monotonic()),
            quiet=True,
        )
        t0 = time.monotonic()
        result = launcher.run()
        return result, time.monotonic() - t0

    def _not_run(self, check: str, why: str) -> Row | None:
        if self.rows and self.rows[0].status == "fail":
            return Row(check, "skipped", 0.0, f"skipped: not run, {why}")
        if time.monotonic() >= self.deadline:
            return Row(
                check, "fail", 0.0, f"not run: --timeout ({self.options.timeout_s:g} s) spent"
            )
        return None

    def run(self) -> int:
        o = self.options
        self._print(
            f"deadpool selftest: {o.nproc} ranks (tp=1 pp=1 dp={o.nproc}, one per node) + "
            f"{o.spares} spare(s), {ITERS} iterations per run, on "
            f"{device_name(self.gpus)}; logs in {self.run_dir}"
        )
        self._print(header())
        cuda = self.gpus is not None
        self._add(device_checks.settings(cuda))
        reference = self._replication()
        for check, kind, limit in (
            (judge.PEER_KILLED, "kill", None),
            (judge.PEER_FROZEN, "hang", HEARTBEAT_TIMEOUT_S + HEARTBEAT_INTERVAL_S),
        ):
            self._hot_swap(check, kind, reference, limit)
        self._add(device_checks.replica_memory(cuda))
        self._add(device_checks.pack_kernel(cuda))
        self._print(verdict(self.rows))
        if o.json_path:
            payload = report(self.rows, environment(self.gpus, self.run_dir))
            Path(o.json_path).write_text(json.dumps(payload, indent=2) + "\n")
        return exit_code(self.rows)

    def _replication(self) -> dict[str, Any] | None:
        skipped = self._not_run(judge.REPLICATION, "the settings check failed")
        if skipped:
            self._add(skipped)
            return None
        result, seconds = self._launch("replication", [], spares=0)
        layout = Layout(1, 1, self.options.nproc, 1)
        holders = [list(h) for h in place_replicas(layout, 1).holders]
        row = judge.replication(
            seconds, result.returncode, result.summary, result.records, ITERS, holders
        )
        self._add(self._with_logs(row, result.run_dir))
        return result.summary if row.status == "pass" else None

    def _hot_swap(
        self, check: str, kind: str, reference: dict[str, Any] | None, limit: float | None
    ) -> None:
        skipped = self._not_run(check, "the settings check failed")
        if skipped:
            self._add(skipped)
            return
        name = check.replace(" ", "-")
        fault = f"{FAILED_RANK}@{FAIL_AT}:{kind}"
        result, seconds = self._launch(name, [fault], spares=self.options.spares)
        row = judge.hot_swap(
            check, seconds, result.returncode, result.summary, reference, FAILED_RANK, limit
        )
        self._add(
            self._with_logs(
                dataclasses.replace(row, data={"fault": fault, **row.data}), result.run_dir
            )
        )

    @staticmethod
    def _with_logs(row: Row, run_dir: Path | None) -> Row:
        """A failed run's row says where its logs are."""
        if row.status != "fail" or run_dir is None:
            return row
        return dataclasses.replace(row, detail=f"{row.detail}; logs in {run_dir}")
