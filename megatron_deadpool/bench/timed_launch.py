"""One run of the embedded job on this machine, with the times `bench recovery` needs.

`launch` runs a job through the local launcher (`embedded.launch.LocalLauncher`, as `deadpool
train` does) and records, through its hooks (`LaunchHooks`), what the recovery benchmark times:
when the first process started, when a failed run was seen failing and when every process was
gone, the injected fault's own stamp and the slowest rank's checkpoint load (both read from the
job's store at the end). With `stop_on_failure`, a failed run is stopped the way torchrun stops
one: every process killed at once, with what the dead one left in its process group.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.faults import parse_fault
from ..config.job import JobConfig
from ..hotswap.coordinator.liveness import kill_groups

if TYPE_CHECKING:
    from ..hotswap.launch.local_job import LocalJob


@dataclasses.dataclass
class Launch:
    """One launched run and what the bench recorded around it."""

    returncode: int
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    run_dir: Path
    spawned_at: float
    """Wall clock when the launcher started the first process."""
    failed_at: float | None = None
    """Earliest fault-injection stamp of a dying process (`fault/{member}` in the store)."""
    stopped_at: float | None = None
    """When every process of a failed run was gone (restart baseline only)."""
    detected_at: float | None = None
    """When the launcher saw the failure (restart baseline only)."""
    load_s: float | None = None
    """Slowest rank's `checkpoint.load` (`load/{rank}` in the store), if the run loaded one."""
    fired: tuple[int, ...] = ()
    """The indices of the job's `--fail` specs that struck (`fault/fired/...` in the store)."""


Runner = Callable[[JobConfig, Path, bool], Launch]
"""(job, run_dir, stop_on_failure) -> Launch."""


@dataclasses.dataclass
class _Stamps:
    """What the hooks record during one run."""

    stop_on_failure: bool
    world_size: int
    specs: Sequence[str] = ()
    ranks_per_node: int = 1
    fired: tuple[int, ...] = ()
    spawned_at: float = 0.0
    detected_at: float | None = None
    stopped_at: float | None = None
    failed_at: float | None = None
    load_s: float | None = None

    def started(self, local: LocalJob) -> None:
        self.spawned_at = time.time()

    def failed(self, local: LocalJob, members: dict[str, int]) -> None:
        if not self.stop_on_failure:
            return
        self.detected_at = time.time()
        # Like torchrun on a worker failure: stop everyone at once, including what the dead
        # process left behind in its process group (the checkpoint writer's helper).
        kill_groups(local.procs.values())
        self.stopped_at = time.time()

    def ended(self, local: LocalJob) -> None:
        m = local.membership
        # Every member at start and every process started since (node agents' processes are
        # not this launcher's: `procs` holds the agents then).
        members = sorted({*local.members, *local.procs})
        faults = [t for t in map(m.fault_time, members) if t is not None]
        loads = [t for t in map(m.load_time, range(self.world_size)) if t is not None]
        self.failed_at = min(faults) if faults else None
        self.load_s = max(loads) if loads else None
        self.fired = tuple(
            i
            for i, spec in enumerate(self.specs)
            if any(m.fired(i, r) for r in parse_fault(spec).ranks(self.ranks_per_node))
        )


def launch(
    job: JobConfig,
    run_dir: Path,
    stop_on_failure: bool,
    timeout_s: float,
    *,
    worker_command: Sequence[str] | None = None,
    worker_env: Mapping[str, str] | None = None,
    node_agents: bool = False,
) -> Launch:
    """Run `job` (its processes running `worker_command`, default the embedded worker; with
    `node_agents`, started by one `deadpool agent` per simulated node), recording the times
    the bench needs."""
    from ..embedded.launch import LaunchHooks, LocalLauncher

    stamps = _Stamps(
        stop_on_failure, job.parallel.world_size, job.deadpool.fail, job.ranks_per_node
    )
    hooks = LaunchHooks(started=stamps.started, failed=stamps.failed, ended=stamps.ended)
    result = LocalLauncher(
        job,
        run_dir=str(run_dir),
        quiet=True,
        timeout_s=timeout_s,
        hooks=hooks,
        worker_command=worker_command,
        worker_env=worker_env,
        node_agents=node_agents,
    ).run()
    return Launch(
        returncode=result.returncode,
        records=result.records,
        summary=result.summary,
        run_dir=run_dir,
        spawned_at=stamps.spawned_at,
        failed_at=stamps.failed_at,
        stopped_at=stamps.stopped_at,
        detected_at=stamps.detected_at,
        load_s=stamps.load_s,
        fired=stamps.fired,
    )
