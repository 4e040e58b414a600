"""A job's processes as one Slurm job step across an allocation, its coordinator hosted here.

What `deadpool selftest --slurm` runs its checks with: the tasks are started the way
scripts/slurm/deadpool_launch.sh starts a job - one `srun` task per GPU, in blocks (node i
holds ranks i*G .. i*G+G-1, the last nodes' tasks are the spares), RANK/LOCAL_RANK from
SLURM_PROCID/SLURM_LOCALID, and the survivors kept alive when tasks or nodes die
(--kill-on-bad-exit=0 --no-kill --wait=0) - while the store and the coordinator are hosted in
this process, as `local_job.LocalJob` hosts them, on this host's name. The coordinator sees no
process of the step (heartbeats are everything, as on a cluster); the job is done when every
rank said so through the store. A task that never exits (a frozen one) is killed with the step.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ...devices.gpus import GpuAssignment
from ..coordinator.liveness import HeartbeatOnly, Liveness
from ..protocol.messages import task_of
from ..protocol.seal import JOB_ID_ENV
from .local_job import LocalJob

# Each task's RANK and LOCAL_RANK, expanded in the task (as deadpool_launch.sh does).
TASK_WRAPPER = ["bash", "-c", 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID; exec "$@"']


def srun_command(
    worker: Sequence[str],
    *,
    nodes: int,
    tasks_per_node: int,
    name: str,
    output: Path,
    cpus_per_task: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The one `srun` of a job: `nodes` x `tasks_per_node` tasks running `worker`, each with
    its output in `output` (`%t`: the task's number)."""
    return [
        "srun",
        f"--nodes={nodes}",
        f"--ntasks={nodes * tasks_per_node}",
        f"--ntasks-per-node={tasks_per_node}",
        "--distribution=block",
        "--kill-on-bad-exit=0",
        "--no-kill",
        "--wait=0",
        *([f"--cpus-per-task={cpus_per_task}"] if cpus_per_task else []),
        f"--job-name={name}",
        f"--output={output}",
        *extra,
        *TASK_WRAPPER,
        "deadpool-task",
        *worker,
    ]


class SrunJob(LocalJob):
    """One job as a job step of the current Slurm allocation (`SLURM_JOB_ID`)."""

    srun: subprocess.Popen | None = None
    step_name = ""

    def _assign_gpus(self) -> GpuAssignment | None:
        return None  # each node's: Slurm's SLURM_LOCALID is the task's GPU

    def _store_host(self) -> str:
        return socket.gethostname()  # the tasks on other nodes reach this host by its name

    def _liveness(self) -> Liveness:
        return HeartbeatOnly()

    def log_path(self, member: str) -> Path:
        """Srun writes task i's output to task-{i}.log (actives first, then spares)."""
        return self.run_dir / f"task-{task_of(member, self.world_size)}.log"

    def start(
        self,
        worker: Sequence[str],
        env: dict[str, str],
        *,
        nodes: int,
        tasks_per_node: int,
        extra: Sequence[str] = (),
    ) -> None:
        """Start every process of the job (actives, then spares) as one job step."""
        self.step_name = f"deadpool-{secrets.token_hex(4)}"
        cmd = srun_command(
            worker,
            nodes=nodes,
            tasks_per_node=tasks_per_node,
            name=self.step_name,
            output=self.run_dir / "task-%t.log",
            cpus_per_task=env.get("SLURM_CPUS_PER_TASK"),
            extra=extra,
        )
        with open(self.run_dir / "srun.log", "w") as log:  # srun's own lines
            self.srun = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**env, JOB_ID_ENV: self.job},  # the run's id (`seal.py`)
                start_new_session=True,
            )

    def finished(self) -> bool:
        """Every rank said it is done and no recovery is under way - or the step is over."""
        return (self.srun is not None and self.srun.poll() is not None) or (
            self.coordinator.training_done()
        )

    def close(self, grace_s: float) -> None:
        """Tell the spares to leave and give the step `grace_s` to end; then kill what is left
        of it (a frozen task never exits on its own) through Slurm, and srun last."""
        self.membership.request_shutdown()
        if self.srun is not None:
            if not self._wait_srun(grace_s):
                self._kill_step()
                self._wait_srun(15.0)
            if self.srun.poll() is None:
                os.killpg(self.srun.pid, signal.SIGKILL)
                self.srun.wait()
        self.coordinator.close()

    def _wait_srun(self, timeout_s: float) -> bool:
        assert self.srun is not None
        try:
            self.srun.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _kill_step(self) -> None:
        """SIGKILL every task of this job's step, wherever it runs (`scancel JOB.STEP`)."""
        job = os.environ.get("SLURM_JOB_ID", "")
        listed = subprocess.run(
            ["squeue", "-h", "--steps", "-j", job, "-o", "%i %j"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout.split("\n")
        for line in listed:
            step, _, name = line.strip().partition(" ")
            if name == self.step_name:
                self.coordinator.events("step_killed", step=step, why="tasks left at the end")
                subprocess.run(
                    ["scancel", "--signal=KILL", step], capture_output=True, timeout=30, check=False
                )
