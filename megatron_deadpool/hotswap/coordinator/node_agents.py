"""The agents of a cluster job's nodes, as the coordinator reaches them: through the store.

On a Slurm cluster every node runs one `deadpool agent` (`node_agent.py`) that starts and
supervises that node's processes. The coordinator, a process of its own, cannot call it; this is
`respawn.NodeAgents` over the job's store instead: an agent beats (`agent/{node}/hb`, a counter:
no clock travels), the coordinator asks whether it still does when a process of its node
failed (`alive`: the counter must move within a few beat intervals), and a respawn is an
order the coordinator writes for it (`agent/{node}/order/{n}`, a sealed
`RespawnOrder`: the new member's name, the process it replaces, its rank). The agent
starts the process; if it cannot (it died right after its last beat), the newcomer never claims
its slot and the coordinator moves on to a spare after the join timeout, as for a lost spare.

Nodes are numbered as Slurm numbers an allocation's nodes with block distribution: the
initial process of task t (actives first, then spares) runs on node t // R (R processes per
node, `--deadpool-ranks-per-node`); a process respawned by this coordinator on its
predecessor's node. An agent that joins the running job (`deadpool agent --deadpool-join`, a
revived node or one of another allocation) takes the next number from the store
(`agents/next`, counted from the job's own nodes). Any other process - one that joined, or one
a coordinator respawned before a standby took the job over - is on the node its agent gave it
and it announced (`messages.AGENT_NODE_ENV`), or, if it died before it announced that here,
that its agent named with its exit (`ProcessExit`); `UNKNOWN` otherwise: its failure takes a
spare.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..protocol.coordinator_view import CoordinatorView
from ..protocol.messages import RespawnOrder, task_of
from .liveness import AgentExits

UNKNOWN = -1
"""`node_of` a process whose node is not known here."""

BEATS_AWAITED = 2.5
"""Beat intervals `alive` waits for a node's agent to beat: one that does not is lost."""


class StoreAgents:
    """`respawn.NodeAgents` for a job whose nodes each run a `deadpool agent`."""

    def __init__(
        self,
        membership: CoordinatorView,
        *,
        world_size: int,
        processes: int,
        ranks_per_node: int,
        beat_s: float,
        exits: AgentExits | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`processes`: the job's initial processes (actives and spares); `beat_s`: the agents'
        beat interval (the job's heartbeat interval); `exits`: the exits the agents reported
        (the coordinator's liveness), which name the node of a process that exited."""
        self.membership = membership
        self.world_size = world_size
        self.processes = processes
        self.ranks_per_node = ranks_per_node
        self.beat_s = beat_s
        self.exits = exits
        self.clock = clock
        self.sleep = sleep
        self._verdicts: dict[int, tuple[bool, float]] = {}  # node -> (alive, when judged)
        self._nodes: dict[str, int] = {}  # respawned (or found) processes: their node
        membership.number_agent_nodes_from(-(-processes // ranks_per_node))

    def node_of(self, member: str) -> int:
        if member in self._nodes:
            return self._nodes[member]
        task = task_of(member, self.world_size)
        if task < self.processes:
            return task // self.ranks_per_node
        if self.exits is not None and member in self.exits.nodes:  # one that never announced
            return self.exits.nodes[member]  # here: respawned before a standby took over
        where = self.membership.announcement(member)
        if where is None or where.node < 0:
            return UNKNOWN
        self._nodes[member] = where.node
        return where.node

    def alive(self, node: int) -> bool:
        """Whether node `node`'s agent beats now: its counter moves within `BEATS_AWAITED`
        beat intervals (a verdict kept that long: a node's ranks lost together wait once). A
        counter's age alone would not do: the failure that makes the coordinator ask is often
        younger than the timeout that would tell a lost agent from a live one."""
        if node == UNKNOWN:
            return False
        now = self.clock()
        bound = BEATS_AWAITED * self.beat_s
        verdict = self._verdicts.get(node)
        if verdict is not None and now - verdict[1] < bound:
            return verdict[0]
        first = self.membership.agent_beat_count(node)
        deadline = now + bound
        beats = False
        while not beats and self.clock() < deadline:
            self.sleep(self.beat_s / 5)
            beats = self.membership.agent_beat_count(node) != first
        self._verdicts[node] = (beats, self.clock())
        return beats

    def respawn(self, rank: int, dead: str, node: int) -> str:
        member = self.membership.claim_spare_name()
        self.membership.order_respawn(node, RespawnOrder(member, dead, rank))
        self._nodes[member] = node
        return member
