"""A stranger cannot beat for a hung process: a beat is the member's own beat number, sealed.

`hb/{member}` (and a node agent's `agent/{node}/hb`) once was a counter every beat added 1 to:
a stranger's adds kept a hung member "beating" for ever. Now a beat sets the next beat number,
sealed; the coordinator's sweep (one batched read) opens what changed, and a value that is not
the job's, or a number below one it saw (a replay of an earlier beat), is no beat and is
reported once.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch.distributed as dist
from decisions_job import HEARTBEAT_TIMEOUT, Job
from stores import SEAL, Recording

from megatron_deadpool.hotswap.coordinator.node_agents import BEATS_AWAITED, StoreAgents
from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.hotswap.protocol.messages import Keys


def _add(store: MemoryStore, key: str, earlier: bytes) -> None:
    try:
        store.add(key, 1)
    except dist.DistStoreError:  # (a sealed value holds no integer to add to)
        pass


def _forge(store: MemoryStore, key: str, earlier: bytes) -> None:
    store.set(key, "9" * 12)


def _replay(store: MemoryStore, key: str, earlier: bytes) -> None:
    store.set(key, earlier)


STRANGERS = {"add": _add, "forge": _forge, "replay": _replay}


@pytest.mark.parametrize("stranger", STRANGERS.values(), ids=STRANGERS.keys())
def test_a_stranger_cannot_keep_a_hung_member_beating(
    stranger: Callable[[MemoryStore, str, bytes], None],
) -> None:
    job = Job(spares=1)
    key = Keys.HEARTBEAT.format(member="a2")
    job.tick()
    earlier = job.store.get(key)
    job.tick()
    job.tick()
    job.silent.add("a2")  # hung: its heartbeat thread stops
    for _ in range(int(HEARTBEAT_TIMEOUT) + 2):
        stranger(job.store, key, earlier)
        job.tick()
    dead = [e for e in job.events.of("process_dead") if e["member"] == "a2"]
    assert dead and "hung" in dead[0]["why"]
    rejected = [e for e in job.events.of("rejected_value") if e["key"] == key]
    assert len(rejected) == (0 if stranger is _add else 1)  # once, not once per sweep


def test_a_live_member_beats_through_a_strangers_values_and_after_a_restart() -> None:
    store = MemoryStore()
    coord = Membership(store, "coordinator", SEAL)
    coord.watch_heartbeats(["a1"])
    assert coord.heartbeat_counts(["a1"]) == [0]
    member = Membership(store.clone(), "a1", SEAL)
    member.heartbeat()
    assert coord.heartbeat_counts(["a1"]) == [1]
    key = Keys.HEARTBEAT.format(member="a1")
    store.set(key, "garbage")  # the stranger, between two beats
    assert coord.heartbeat_counts(["a1"]) == [1]
    member.heartbeat()
    assert coord.heartbeat_counts(["a1"]) == [2]
    Membership(store.clone(), "a1", SEAL).heartbeat()  # another connection (or process) of a1
    assert coord.heartbeat_counts(["a1"]) == [3]
    member.heartbeat()  # (goes on from 3: it may write that number again, never a lower one)
    member.heartbeat()
    assert coord.heartbeat_counts(["a1"]) == [4]
    store.delete_key(key)  # pruned, or a store failed over to
    member.heartbeat()
    assert store.check([key]) and coord.heartbeat_counts(["a1"]) == [5]


def test_a_beat_is_one_request_and_a_sweep_one_batched_read() -> None:
    store = MemoryStore()
    coord = Membership(store, "coordinator", SEAL)
    members = [f"a{r}" for r in range(3)]
    coord.watch_heartbeats(members)
    beating = Recording(store.clone())
    member = Membership(beating, "a1", SEAL)  # type: ignore[arg-type]
    member.heartbeat()  # the first reads the coordinator's 0 and goes on from it
    beating.ops.clear()
    member.heartbeat()
    assert [op for op, _ in beating.ops] == ["compare_set"]
    sweeping = Recording(store)
    view = Membership(sweeping, "coordinator", SEAL)  # type: ignore[arg-type]
    assert view.heartbeat_counts(members) == [0, 2, 0]
    assert [op for op, _ in sweeping.ops] == ["multi_get"]


@pytest.mark.parametrize("stranger", [_add, _forge], ids=["add", "forge"])
def test_a_stranger_cannot_keep_a_lost_nodes_agent_alive(
    stranger: Callable[[MemoryStore, str, bytes], None],
) -> None:
    store = MemoryStore()
    coord, agent = Membership(store, "coordinator", SEAL), Membership(store, "agent1", SEAL)
    key = Keys.AGENT_BEAT.format(node=1)
    now = [0.0]

    def sleep(s: float) -> None:  # the agent is lost: only the stranger writes
        now[0] += s
        stranger(store, key, b"")

    agents = StoreAgents(
        coord, world_size=4, processes=6, ranks_per_node=2, beat_s=1.0,
        clock=lambda: now[0], sleep=sleep,
    )  # fmt: skip
    agent.agent_beat(1)  # it beat once, before it was lost
    assert not agents.alive(1)
    assert now[0] >= BEATS_AWAITED  # (it waited that long for a beat)
