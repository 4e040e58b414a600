"""Runs the selftest's checks in order, printing each row as it finishes.

The training-run checks are `deadpool train` runs of a tiny GPT (the CPU demo's sizes): on this
machine through the same launcher (`embedded.launch.LocalLauncher`, each run with its own
store and coordinator on a free port), tp=1, pp=1, dp=N with one rank per failure domain, so
every replica lands on another "node" by the real placement; with `--slurm` across the nodes
of the allocation, one job step per run (`selftest.slurm`), G ranks per node. One failure-free
run (`replication`), then the same job with rank 1 SIGKILLed (`peer killed`) and SIGSTOPped
(`peer frozen`) as iteration 3 starts, each ending bitwise equal to the failure-free run. The
device checks (settings, replica memory, pack kernel) run in this process, on this host.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
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
from ..embedded.launch import LocalLauncher
from ..errors import ConfigError
from ..replication.placement import Layout, place_replicas
from . import device_checks, judge
from .slurm import Allocation, SrunLauncher
from .table import Row, exit_code, header, render, report, verdict

ITERS = 5
FAILED_RANK = 1
FAIL_AT = 3
HEARTBEAT_TIMEOUT_S = 3.0
HEARTBEAT_INTERVAL_S = 0.5


@dataclass(frozen=True)
class Options:
    """`deadpool selftest`'s flags, validated: `ConfigError` names the flag and the fix.

    On this machine: `nproc` actives and `spares` spares. With `slurm`: across the allocation's
    nodes, `nproc_per_node` tasks each (default: Slurm's), the last `spare_nodes` nodes spare.
    `nproc` 1: a single rank has no peer to hold its replica, so only the settings and device
    checks run (what one GPU allows); with nothing failed the verdict is INCOMPLETE, exit code
    `table.EXIT_INCOMPLETE`, not OK."""

    nproc: int | None = None
    spares: int = 1
    timeout_s: float = 600.0
    json_path: str | None = None
    run_dir: str | None = None
    slurm: bool = False
    nproc_per_node: int | None = None
    spare_nodes: int = 1

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(
                f"--timeout: must be a positive number of seconds, got {self.timeout_s}"
            )
        if self.slurm:
            if self.nproc is not None:
                raise ConfigError(
                    "--nproc: not with --slurm (the allocation's nodes set the ranks); use "
                    "--nproc-per-node for the tasks per node"
                )
            return
        if self.nproc_per_node is not None or self.spare_nodes != 1:
            flag = "--nproc-per-node" if self.nproc_per_node is not None else "--spare-nodes"
            raise ConfigError(f"{flag}: only with --slurm; on this machine use --nproc/--spares")
        if self.nproc is None or self.nproc < 1:
            got = "missing" if self.nproc is None else f"{self.nproc} is too few"
            raise ConfigError(
                f"--nproc: {got}; give the ranks to run on this machine (>= 2 for the training "
                "checks, e.g. --nproc 4), or --slurm inside an allocation"
            )
        if self.spares < 1:
            raise ConfigError(
                f"--spares: {self.spares} is too few; the 'peer killed' and 'peer frozen' "
                "checks each replace a rank with a spare (use --spares 1)"
            )
        if self.nproc < 2:
            return  # no training runs: nothing to place on GPUs
        gpus = local_gpu_count()
        try:
            assign_gpus(actives=self.nproc, spares=self.spares, gpus=gpus)
        except ConfigError as exc:
            raise ConfigError(f"{exc}; or DEADPOOL_DEVICE=cpu to run the checks on gloo") from None


def job(actives: int, ranks_per_node: int, fail: list[str], spares: int) -> JobConfig:
    """The selftest's job: the default tiny GPT, dp=`actives`, fast heartbeats."""
    return JobConfig(
        parallel=ParallelConfig(tp=1, pp=1, dp=actives),
        train=TrainConfig(iters=ITERS),
        deadpool=DeadpoolConfig(
            enabled=True,
            spares=spares,
            respawn_limit=0,  # its 'peer killed'/'peer frozen' checks are of a spare's takeover
            replicas=1,
            ranks_per_node=ranks_per_node,
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
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.gpus = local_gpu_count()
        self.rows: list[Row] = []
        self.allocation: Allocation | None = None
        if options.slurm:
            self.allocation = a = Allocation.from_env(
                os.environ, options.nproc_per_node, options.spare_nodes
            )
            self.actives, self.spares, self.ranks_per_node = a.actives, a.spares, a.tasks_per_node
        else:
            self.actives, self.spares, self.ranks_per_node = options.nproc or 0, options.spares, 1

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _add(self, row: Row) -> None:
        self.rows.append(row)
        self._print(render(row))

    def _launch(self, check: str, fail: list[str], spares: int) -> Any | None:
        """One training run for `check` (its logs in a folder of that name); None when it
        cannot run: the check's row is then added here."""
        if self.rows and self.rows[0].status == "fail":  # the workers would refuse it too
            self._add(Row(check, "skipped", 0.0, "skipped: not run, the settings check failed"))
            return None
        if self.actives < 2:
            self._add(Row(check, "skipped", 0.0, "skipped: one rank has no peer to hold its "
                          "replica; give --nproc 2 or more (on one GPU: DEADPOOL_DEVICE=cpu, or "
                          "--slurm across nodes)"))  # fmt: skip
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            limit = f"{self.options.timeout_s:g}"
            self._add(Row(check, "fail", 0.0, f"not run: --timeout ({limit} s) spent"))
            return None
        run_dir = self.run_dir / check.replace(" ", "-")
        config = job(self.actives, self.ranks_per_node, fail, spares)
        kwargs: dict[str, Any] = {
            "json_log": str(run_dir / "run.jsonl"),
            "run_dir": str(run_dir),
            "timeout_s": max(1.0, left),
            "quiet": True,
        }
        if self.allocation is not None:
            return SrunLauncher(config, self.allocation, **kwargs).run()
        return LocalLauncher(config, **kwargs).run()

    def run(self) -> int:
        o = self.options
        where = self.allocation.describe() if self.allocation else "this machine, one per node"
        self._print(
            f"deadpool selftest: {self.actives} ranks (tp=1 pp=1 dp={self.actives}; {where}) + "
            f"{self.spares} spare(s), {ITERS} iterations per run, on "
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
        self._print(verdict(self.rows, judge.CROSS_RANK))
        if o.json_path:
            env = environment(self.gpus, self.run_dir)
            if self.allocation is not None:
                env["slurm"] = dataclasses.asdict(self.allocation)
            payload = report(self.rows, env, judge.CROSS_RANK)
            Path(o.json_path).write_text(json.dumps(payload, indent=2) + "\n")
        return exit_code(self.rows, judge.CROSS_RANK)

    def _replication(self) -> dict[str, Any] | None:
        """The failure-free run; its summary when it passed (the others' reference)."""
        t0 = time.monotonic()
        result = self._launch(judge.REPLICATION, [], spares=0)
        if result is None:
            return None
        layout = Layout(1, 1, self.actives, self.ranks_per_node)
        holders = place_replicas(layout, 1).holders
        row = judge.replication(
            time.monotonic() - t0,
            result.returncode,
            result.summary,
            result.records,
            ITERS,
            [list(h) for h in holders],
        )
        self._add(self._with_logs(row, result.run_dir))
        return result.summary if row.status == "pass" else None

    def _hot_swap(
        self, check: str, kind: str, reference: dict[str, Any] | None, limit: float | None
    ) -> None:
        """The run in which rank `FAILED_RANK` fails (`kind`) as iteration `FAIL_AT` starts."""
        fault = f"{FAILED_RANK}@{FAIL_AT}:{kind}"
        t0 = time.monotonic()
        result = self._launch(check, [fault], spares=self.spares)
        if result is None:
            return
        row = judge.hot_swap(
            check,
            time.monotonic() - t0,
            result.returncode,
            result.summary,
            reference,
            FAILED_RANK,
            limit,
        )
        row = dataclasses.replace(row, data={"fault": fault, **row.data})
        self._add(self._with_logs(row, result.run_dir))

    @staticmethod
    def _with_logs(row: Row, run_dir: Path | None) -> Row:
        """A failed run's row says where its logs are."""
        if row.status != "fail" or run_dir is None:
            return row
        return dataclasses.replace(row, detail=f"{row.detail}; logs in {run_dir}")
