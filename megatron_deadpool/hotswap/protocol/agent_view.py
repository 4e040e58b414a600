"""What a node's agent (`deadpool agent`, `launch/node_agent.py`) may read and write of the
job's store.

An agent takes a node number, beats, reads the coordinator's orders to respawn a process,
reports the exits of the processes it started and keeps its node's respawn history. Every
read everyone makes is `store_view.StoreView`'s; the keys are documented on `messages.Keys`.
"""

from __future__ import annotations

from .messages import (
    Keys,
    ProcessExit,
    RespawnHistory,
    RespawnOrder,
)
from .store_view import StoreView


class AgentView(StoreView):
    """A node agent's view of the job's store."""

    # ------------------------------------------------------------------ this agent
    def claim_agent_node(self) -> int:
        """A node number of its own for an agent that joins the running job."""
        return self.core.add(Keys.AGENTS_NEXT, 1) - 1

    def agent_beat(self, node: int) -> None:
        """One beat of node `node`'s agent (its next beat number, sealed, as a process's)."""
        self.core.beat(Keys.AGENT_BEAT.format(node=node))

    def respawn_orders(self, node: int, seen: int) -> tuple[int, list[RespawnOrder]]:
        """Node `node`'s orders after the first `seen`: how many were read now, and those that
        arrived (`_numbered`)."""
        count, values = self.core.numbered(
            Keys.AGENT_ORDERS.format(node=node),
            lambda n: Keys.AGENT_ORDER.format(node=node, n=n),
            seen,
        )
        return count, [RespawnOrder.decode(key, value) for key, value in values]

    def set_respawn_history(self, node: int, history: RespawnHistory) -> None:
        """Node `node`'s respawns so far, for a coordinator that took the job over."""
        key = Keys.AGENT_RESPAWNS.format(node=node)
        self.core.set(key, history.encode())

    def report_exit(self, exit: ProcessExit) -> None:
        """An agent saw a process it started exit (the coordinator need not wait for its
        silence), under a number no exit holds yet (`SealedStore.append`)."""
        self.core.append(
            Keys.AGENT_EXITS, lambda n: Keys.AGENT_EXIT.format(n=n), lambda n: exit.encode()
        )

    def node_lost(self, member: str) -> bool:
        """Whether a node fault took the node `member` ran on."""
        return self.core.seconds(Keys.NODE_LOST.format(member=member)) is not None
