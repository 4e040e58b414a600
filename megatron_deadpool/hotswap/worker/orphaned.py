"""A worker with no coordinator left ends the Slurm job once Slurm agrees the coordinators are gone.

When the primary's and the standby's nodes are both lost, nothing can recover a failure or end
the job: the coordinators' wrappers (`scripts/slurm/deadpool_coordinator.sh`), which cancel a
finished job, are gone with their nodes, and srun with the batch host - Slurm then holds the
remaining nodes until the time limit. Each surviving worker, after saving what it holds, asks
Slurm about the coordinators' hosts: once Slurm itself reports every one of them not responding
or down, it gives the other survivors `DEADPOOL_END_GRACE` seconds (60) to save and exit, and
cancels the job. Slurm's view decides, not the worker's: a worker whose own node was cut off
sees the coordinators vanish while they live, and Slurm then says they respond; after
`DEADPOOL_NODE_DOWN_WAIT` seconds (600) without that verdict the worker cancels nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable

log = logging.getLogger("megatron_deadpool.hotswap.worker.orphaned")

POLL_S = 2.0


def node_states(hosts: list[str]) -> dict[str, str]:
    """Slurm's state of each of `hosts` it knows (sinfo's %T: "down*", "mixed", ...)."""
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-n", ",".join(hosts), "-o", "%N %T"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    states = {}
    for line in out.stdout.splitlines():
        name, _, state = line.partition(" ")
        states[name] = state.strip()
    return states


def gone(state: str) -> bool:
    """Slurm's verdict on a node: not responding (`*`) or down."""
    return state.endswith("*") or state.startswith("down")


def end_slurm_job(
    coordinators: list[str],
    *,
    states: Callable[[list[str]], dict[str, str]] = node_states,
    environ: dict[str, str] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Cancel this Slurm job once Slurm reports every coordinator host gone; say what was done.
    Outside a Slurm job (or without its commands) nothing is done."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if not job or not shutil.which("scancel") or not shutil.which("sinfo"):
        return "not in a Slurm job: nothing to end"
    hosts = sorted({address.rpartition(":")[0] or address for address in coordinators})
    wait_s = float(env.get("DEADPOOL_NODE_DOWN_WAIT", "600"))
    grace_s = float(env.get("DEADPOOL_END_GRACE", "60"))
    log.error(
        "no coordinator left: waiting up to %.0fs for Slurm to report %s not responding, "
        "then the Slurm job %s ends %.0fs later",
        wait_s,
        ",".join(hosts),
        job,
        grace_s,
    )
    waited = 0.0
    while True:
        seen = states(hosts)
        if set(seen) == set(hosts) and all(gone(s) for s in seen.values()):
            break
        if waited >= wait_s:
            return (
                f"Slurm still reports the coordinators' hosts as {seen or 'unknown'} after "
                f"{wait_s:.0f}s (this node may be the one cut off): not cancelling job {job}"
            )
        sleep(POLL_S)
        waited += POLL_S
    log.error("Slurm reports %s: cancelling job %s in %.0fs", seen, job, grace_s)
    sleep(grace_s)
    done = subprocess.run(["scancel", job], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0 and "already" not in done.stderr:  # another survivor was first
        return f"scancel {job} failed: {done.stderr.strip()[:200]}"
    return f"cancelled the Slurm job {job}: no coordinator left to end it"
