"""`deadpool selftest --slurm`: the selftest's runs across the nodes of a Slurm allocation.

Run inside an allocation (sbatch, salloc; `DEADPOOL_MODE=selftest` in scripts/slurm does it
with the site's settings): every training run is one job step over all its nodes, one task
per GPU, the last `--spare-nodes` nodes' tasks the spares, started as deadpool_launch.sh starts
a job (`hotswap.launch.srun_job`), with the store and coordinator in the selftest's own process on the
batch host. `Allocation.from_env` reads and checks the allocation (pure); `SrunLauncher` is the
local launcher with its processes moved into that job step.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config.deadpool import DeadpoolConfig
from ..config.job import JobConfig
from ..embedded.launch import LocalLauncher
from ..errors import ConfigError
from ..hotswap.launch.srun_job import SrunJob


@dataclass(frozen=True)
class Allocation:
    """The nodes the selftest spreads over: `nodes` x `tasks_per_node` tasks, the last
    `spare_nodes` nodes' tasks are spares."""

    job_id: str
    nodes: int
    tasks_per_node: int
    spare_nodes: int
    nodelist: str = ""
    srun_args: tuple[str, ...] = ()

    @property
    def actives(self) -> int:
        return (self.nodes - self.spare_nodes) * self.tasks_per_node

    @property
    def spares(self) -> int:
        return self.spare_nodes * self.tasks_per_node

    @classmethod
    def from_env(
        cls, env: Mapping[str, str], nproc_per_node: int | None, spare_nodes: int
    ) -> Allocation:
        """The allocation this process runs in; `ConfigError` naming the flag and the fix when
        it cannot host the selftest."""
        job_id = env.get("SLURM_JOB_ID")
        nodes = env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES"))
        if not job_id or not nodes:
            raise ConfigError(
                "--slurm: not inside a Slurm allocation (SLURM_JOB_ID is unset); run it in "
                "one, e.g. DEADPOOL_MODE=selftest sbatch --nodes=3 scripts/slurm/vista.sbatch, "
                "or drop --slurm and give --nproc for this machine only"
            )
        per_node = nproc_per_node
        if per_node is None:  # sbatch --ntasks-per-node=G sets "G"; heterogeneous: "4(x2),2"
            given = env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0].split(",")[0]
            per_node = int(given) if given.isdigit() else 1
        if per_node < 1:
            raise ConfigError(f"--nproc-per-node: {per_node} is too few; one task per GPU (>= 1)")
        if spare_nodes < 1:
            raise ConfigError(
                f"--spare-nodes: {spare_nodes} is too few; the 'peer killed' and 'peer frozen' "
                "checks replace a rank by a spare (use --spare-nodes 1)"
            )
        if int(nodes) - spare_nodes < 2:
            raise ConfigError(
                f"--spare-nodes: the allocation's {nodes} node(s) leave "
                f"{int(nodes) - spare_nodes} active; a replica lives on another node than its "
                f"rank, so the selftest needs 2 active nodes: allocate {2 + spare_nodes} nodes "
                "or more"
            )
        return cls(
            job_id=job_id,
            nodes=int(nodes),
            tasks_per_node=per_node,
            spare_nodes=spare_nodes,
            nodelist=env.get("SLURM_JOB_NODELIST", ""),
            srun_args=tuple(shlex.split(env.get("SRUN_EXTRA_ARGS", ""))),
        )

    def describe(self) -> str:
        return (
            f"Slurm job {self.job_id}: {self.nodes} nodes ({self.nodelist}) x "
            f"{self.tasks_per_node} task(s), the last {self.spare_nodes} node(s) spare"
        )


class SrunLauncher(LocalLauncher):
    """`LocalLauncher` whose processes are one job step over the allocation's nodes (spares
    only as the job asks for: none in a failure-free run)."""

    def __init__(self, job: JobConfig, allocation: Allocation, **kwargs: Any) -> None:
        super().__init__(job, **kwargs)
        self.allocation = allocation

    def _host(self, cfg: DeadpoolConfig, **kwargs: Any) -> SrunJob:
        kwargs.pop("spawn")  # srun starts the tasks: no node agent here respawns one
        if cfg.respawn_limit:
            raise ConfigError(
                "deadpool-respawn-limit: the selftest's tasks are one srun job step, without a "
                "`deadpool agent` to respawn a process in place; set it to 0"
            )
        return SrunJob(cfg, **kwargs)

    def _start(self) -> None:
        a = self.allocation
        nodes = a.nodes if self.job.deadpool.spares else a.nodes - a.spare_nodes
        assert isinstance(self.local, SrunJob)
        self.local.start(
            self._command(None, self.local.address),
            self._env(),
            nodes=nodes,
            tasks_per_node=a.tasks_per_node,
            extra=a.srun_args,
        )
