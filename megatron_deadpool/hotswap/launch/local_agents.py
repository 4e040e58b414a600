"""A job on this machine run the way a cluster runs it with agents: one `deadpool agent` per node.

`local_job.LocalJob` is every simulated node's agent itself: it starts the processes and forks
their replacements. `LocalAgents` hosts the same store and coordinator but starts, instead of
the processes, one `deadpool agent` process per simulated node (`node_agent.py`), as
scripts/slurm/deadpool_launch.sh starts one per node with DEADPOOL_RESPAWN_LIMIT: each agent
starts its node's processes (tasks node*R .. node*R+R-1, actives first, then the spares), keeps
their memory, reports their exits and carries out the coordinator's respawn orders through the
store (`node_agents.StoreAgents`, `liveness.AgentExits`). A node fault (`node:N@ITER`) takes
node N's agent down with its processes, as a lost node would. What `deadpool train
--node-agents` runs, and `deadpool bench goodput` its two DeadPool ways.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ...replication.placement import Placement
from ..coordinator.liveness import AgentExits, Liveness, kill_tree
from ..coordinator.node_agents import StoreAgents
from ..coordinator.respawn import NodeAgents
from ..protocol.messages import task_of
from ..protocol.seal import JOB_ID_ENV
from .local_job import LocalJob

AGENT_COMMAND = [sys.executable, "-m", "megatron_deadpool.cli", "agent"]


class LocalAgents(LocalJob):
    """One job whose simulated nodes each run a `deadpool agent` (`start_agents`)."""

    exits: AgentExits
    agents: list[subprocess.Popen]

    def _liveness(self) -> Liveness:
        self.exits = AgentExits(self.membership)  # the exits the agents report
        return self.exits

    def _suspect_after(self) -> float | None:
        """As a cluster's coordinator: a lost node's processes report no exit (its agent is gone
        with them); once a peer reported a failed collective, their silence names them sooner
        than the heartbeat timeout."""
        return self.cfg.suspect_after

    def _node_agents(self, placement: Placement | None) -> NodeAgents | None:
        """The agents as the coordinator reaches them, where they may respawn (none: every
        failed rank takes a spare, with no wait for a verdict on its node's agent)."""
        if self.cfg.respawn_limit == 0:
            return None
        return StoreAgents(
            self.membership,
            world_size=self.world_size,
            processes=self.world_size + self.spares,
            ranks_per_node=self._ranks_per_node(placement),
            beat_s=self.cfg.heartbeat_interval,
            exits=self.exits,
        )

    def _ranks_per_node(self, placement: Placement | None) -> int:
        """Processes per node: the layout's, else (a Megatron-LM job, whose layout comes from
        rank 0 once it runs) --deadpool-ranks-per-node."""
        if placement is not None:
            return placement.layout.ranks_per_node
        if self.cfg.ranks_per_node is None:
            raise ValueError("LocalAgents: the job's layout or its ranks per node is needed")
        return self.cfg.ranks_per_node

    def start_agents(
        self, worker: Sequence[str], env: dict[str, str], settings: Sequence[str]
    ) -> None:
        """One `deadpool agent` per simulated node, each starting its node's processes of
        `worker` (their logs: task-{t}.log; the agent's: agent{n}.out); `settings`: the job's
        `--config` and `--deadpool-*` flags for the agents."""
        per_node = self._ranks_per_node(self.coordinator.placement())
        nodes = -(-(self.world_size + self.spares) // per_node)
        self.agents = []
        for node in range(nodes):
            cmd = [*AGENT_COMMAND, "--world-size", str(self.world_size), "--node", str(node),
                   *settings, "--deadpool-coordinator", self.address,
                   "--deadpool-ranks-per-node", str(per_node),
                   "--deadpool-log-dir", str(self.run_dir), "--", *worker]  # fmt: skip
            with open(self.run_dir / f"agent{node}.out", "w") as out:
                self.agents.append(
                    subprocess.Popen(
                        cmd,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env={**env, JOB_ID_ENV: self.job},  # the run's, for its processes too
                        start_new_session=True,
                    )
                )

    def log_path(self, member: str) -> Path:
        """The agent of a process's node writes its output to task-{t}.log."""
        return self.run_dir / f"task-{task_of(member, self.world_size)}.log"

    def exit_codes(self, members: list[str]) -> dict[str, int | None]:
        """As the agents reported them (None: running, or its node lost with its agent)."""
        codes = self.exits.exits()
        return {member: codes.get(member) for member in members}

    def _reachable_actives(self) -> list[str]:
        """The actives that may still exit and say so: not those named dead (a lost node's
        processes went with its agent, which reports no exit of theirs; a hung one is ended
        by its agent at `close`)."""
        return [m for m in self.actives() if m not in self.coordinator.dead]

    def await_salvage(self) -> None:
        """Out of redundancy: the surviving ranks save what they hold, then exit."""
        self.wait_exit(self._reachable_actives(), 60.0)

    def close(self, grace_s: float) -> None:
        """Tell the agents the job is over, give the ranks `grace_s` to exit, then stop the
        agents (SIGTERM: each kills what is left of its node's processes and deletes their
        memory; SIGKILL to what is still there 10 s later)."""
        self.membership.request_shutdown()
        self.wait_exit(self._reachable_actives(), grace_s)
        for agent in self.agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)  # its handler ends its node's processes
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(a.poll() is None for a in self.agents):
            time.sleep(0.05)
        for agent in self.agents:
            if agent.poll() is None:
                kill_tree(agent.pid)
                agent.wait()
        self.silent.stop()
        self.coordinator.close()
