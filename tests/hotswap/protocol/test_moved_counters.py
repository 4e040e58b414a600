"""A stranger's add to a counter hides no value, overwrites none and reports nothing false.

Error reports (`errors` / `error/{n}`), the agents' orders (`agent/{node}/orders` /
`agent/{node}/order/{n}`) and the agents' exits (`agents/exits` / `agents/exit/{n}`) are
numbered by a counter anyone can add to. Moved back, it once handed the next writer a number
already written and read: the writer overwrote a sealed value and the reader, past that number,
never saw the new one. Writers now claim an empty number (`SealedStore.append`); readers
(`numbered.py`) see every value with the counter moved back, far ahead, or both. The count of
stale group handles (`gen{g}/stale_refs`) is a hint the ranks' sealed counts confirm: a
stranger's add no longer makes a clean recovery report stale handles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from decisions_job import Job
from stores import SEAL, Recording

from megatron_deadpool.hotswap.protocol import sealed_store
from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.hotswap.protocol.messages import (
    ErrorReport,
    Keys,
    Phase,
    ProcessExit,
    RespawnOrder,
)
from megatron_deadpool.hotswap.protocol.seal import ForgedValue

MOVES = {
    "back by one": [-1],
    "back below zero": [-(10**9)],
    "far ahead": [10**9],
    "far ahead, then back": [10**9, -(2 * 10**9)],
}
"""What the stranger adds to the counter, one add before each further write."""


def _moves() -> Any:
    return pytest.mark.parametrize("moves", MOVES.values(), ids=MOVES.keys())


def test_error_reports_are_read_whatever_a_stranger_adds_to_their_counter() -> None:
    for moves in MOVES.values():
        job = Job(spares=1)
        job.raised("a1", Phase.TRAINING, rank=1)
        job.tick()
        first = job.m().error_report(1)
        assert first is not None and first.member == "a1"
        for i, amount in enumerate(moves):
            job.store.add(Keys.ERRORS, amount)
            job.raised(f"a{i + 2}", Phase.TRAINING, rank=i + 2)
            job.tick()
        reported = {e["member"] for e in job.events.of("error_reported")}
        assert reported == {f"a{r}" for r in range(1, len(moves) + 2)}, moves
        assert job.m().error_report(1) == first  # never overwritten
        assert job.events.of("rejected_value") == []


@_moves()
def test_orders_reach_their_agent_whatever_a_stranger_adds_to_their_counter(
    moves: list[int],
) -> None:
    store = MemoryStore()
    coord, agent = Membership(store, "coordinator", SEAL), Membership(store.clone(), "agent", SEAL)
    coord.order_respawn(1, RespawnOrder("s0", "a1", 1))
    seen, orders = agent.respawn_orders(1, 0)
    assert [o.member for o in orders] == ["s0"]
    for i, amount in enumerate(moves):
        store.add(Keys.AGENT_ORDERS.format(node=1), amount)
        coord.order_respawn(1, RespawnOrder(f"s{i + 1}", "a1", 1))
        seen, orders = agent.respawn_orders(1, seen)
        assert [o.member for o in orders] == [f"s{i + 1}"]
    again = Membership(store.clone(), "agent", SEAL)  # (a reader that read none yet)
    assert again.respawn_orders(1, 0)[1][0] == RespawnOrder("s0", "a1", 1)  # not overwritten


@_moves()
def test_exits_reach_the_coordinator_whatever_a_stranger_adds_to_their_counter(
    moves: list[int],
) -> None:
    store = MemoryStore()
    coord, agent = Membership(store, "coordinator", SEAL), Membership(store.clone(), "agent", SEAL)
    agent.report_exit(ProcessExit("a0", -9, 0))
    seen, exits = coord.process_exits(0)
    assert [e.member for e in exits] == ["a0"]
    for i, amount in enumerate(moves):
        store.add(Keys.AGENT_EXITS, amount)
        agent.report_exit(ProcessExit(f"a{i + 1}", -9, 0))
        seen, exits = coord.process_exits(seen)
        assert [e.member for e in exits] == [f"a{i + 1}"]


def _error(member: str = "a1") -> ErrorReport:
    return ErrorReport(1, member, 1, 0, Phase.TRAINING, "KeyError", "x", 1.0)


def test_a_report_is_written_with_one_add_and_one_compare_and_set() -> None:
    recording = Recording(MemoryStore())
    Membership(recording, "a1", SEAL).report_error(_error())  # type: ignore[arg-type]
    assert [op for op, _ in recording.ops] == ["add", "compare_set", "queue_push"]


def test_a_report_carries_the_number_it_is_published_under() -> None:
    store = MemoryStore()
    worker, coord = Membership(store, "a1", SEAL), Membership(store, "coordinator", SEAL)
    store.add(Keys.ERRORS, 41)
    worker.report_error(_error())
    report = coord.error_report(42)
    assert report is not None and report.number == 42


class Squatter:
    """A store where a stranger writes each numbered key (an error report's, an exit's, an
    order's) right before the writer's compare-and-set on it."""

    def __init__(self, store: MemoryStore) -> None:
        self.store, self.adds = store, 0

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        if key.startswith(("error/", "agents/exit/")) or "/order/" in key:
            self.store.set(key, "mine")
        return self.store.compare_set(key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        self.adds += 1
        return self.store.add(key, amount)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


@pytest.mark.parametrize(
    "write",
    [
        lambda m: m.report_error(_error()),
        lambda m: m.report_exit(ProcessExit("a1", -9, 0)),
        lambda m: m.order_respawn(0, RespawnOrder("s1", "a1", 1)),
    ],
    ids=["error", "exit", "order"],
)
def test_a_stranger_that_squats_every_number_ends_the_write_with_a_stated_error(
    write: Callable[[Membership], None],
) -> None:
    squatter = Squatter(MemoryStore())
    with pytest.raises(ForgedValue, match="no free number"):
        write(Membership(squatter, "a1", SEAL))  # type: ignore[arg-type]
    assert squatter.adds <= sealed_store.APPEND_ATTEMPTS + 1


def test_a_strangers_add_to_the_stale_handles_count_reports_none_on_a_clean_recovery() -> None:
    job = Job(spares=1)
    job.tick()
    job.decided("a2")
    job.store.add(Keys.STALE_REFS.format(g=1), 5)
    job.complete(1)
    (recovered,) = job.events.of("recovered")
    assert recovered["stale_group_refs"] == 0
    assert Keys.STALE_REFS.format(g=1) in {e["key"] for e in job.events.of("rejected_value")}


def test_the_ranks_sealed_counts_of_stale_handles_are_what_the_coordinator_reports() -> None:
    store = MemoryStore()
    coord = Membership(store, "coordinator", SEAL)
    rejected: list[str] = []
    coord.on_rejected = lambda key, why: rejected.append(key)
    Membership(store.clone(), "a1", SEAL).report_stale_refs(1, 1, 2)
    Membership(store.clone(), "a3", SEAL).report_stale_refs(1, 3, 1)
    Membership(store.clone(), "a0", SEAL).report_stale_refs(1, 0, 0)  # none: nothing written
    assert coord.stale_refs(1) == 3 and rejected == []
    store.add(Keys.STALE_REFS.format(g=1), -5)  # the stranger
    assert coord.stale_refs(1) == 3
    store.add(Keys.STALE_REFS.format(g=1), 15)
    store.set(Keys.STALE_REF.format(g=1, rank=2), "7")  # unsealed
    assert coord.stale_refs(1) == 3
    assert set(rejected) == {Keys.STALE_REFS.format(g=1), Keys.STALE_REF.format(g=1, rank=2)}
