"""Who an iteration fault strikes, and when (`FaultInjector.at_iteration`), on an in-memory
store: the decision without the signal (`strike` is replaced by a recorder)."""

from __future__ import annotations

import pytest
from stores import SEAL

from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.hotswap.worker import injection
from megatron_deadpool.hotswap.worker.injection import FaultInjector

PER_NODE = 2


@pytest.fixture
def struck(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kinds of fault struck, in order, instead of signals."""
    kinds: list[str] = []
    monkeypatch.setattr(injection, "strike", kinds.append)
    return kinds


def _injector(store: MemoryStore, member: str, specs: list[str]) -> FaultInjector:
    return FaultInjector(specs, Membership(store.clone(), member, SEAL))


def test_a_node_fault_strikes_each_rank_of_its_node_once(struck: list[str]) -> None:
    store = MemoryStore()
    for rank, member in ((2, "a2"), (3, "a3")):
        for _ in range(2):  # a rank that reaches the iteration again is not struck again
            _injector(store, member, ["node:1@3"]).at_iteration(rank, 3, PER_NODE, None, 0)
    _injector(store, "a1", ["node:1@3"]).at_iteration(1, 3, PER_NODE, None, 0)  # node 0
    assert struck == ["kill", "kill"]


def test_a_node_fault_spares_the_process_that_took_a_rank_of_its_node_later(
    struck: list[str],
) -> None:
    """Rank 2 reached the fault in generation 0 and went down with its node, rank 3 before
    it got there (its agent killed it): the spare that holds rank 3 in generation 1 runs on
    another node, and recomputes iteration 3 unharmed (CI once lost the job to it: the spare
    took the fault, its node went down, out of redundancy)."""
    store = MemoryStore()
    _injector(store, "a2", ["node:1@3"]).at_iteration(2, 3, PER_NODE, None, 0)
    assert struck == ["kill"]
    _injector(store, "s1", ["node:1@3"]).at_iteration(3, 3, PER_NODE, None, 1)
    assert struck == ["kill"]


def test_a_node_fault_first_reached_in_a_later_generation_strikes_there(
    struck: list[str],
) -> None:
    """An earlier failure's recovery rolled back before the node fault's iteration: it strikes
    the node's ranks of the generation that first reaches it."""
    store = MemoryStore()
    for rank in (2, 3):
        _injector(store, f"a{rank}", ["node:1@5"]).at_iteration(rank, 5, PER_NODE, None, 1)
    assert struck == ["kill", "kill"]


def test_a_repair_fault_strikes_the_first_process_of_its_rank_to_repair_once(
    struck: list[str],
) -> None:
    store = MemoryStore()
    _injector(store, "a1", ["1@repair:hang"]).in_repair(1)
    _injector(store, "a0", ["1@repair:hang"]).in_repair(0)  # another rank
    _injector(store, "s0", ["1@repair:hang"]).in_repair(1)  # the process that took rank 1
    assert struck == ["hang"]


def test_a_handles_fault_strikes_before_the_handles_and_a_repair_fault_after(
    struck: list[str],
) -> None:
    store = MemoryStore()
    _injector(store, "a1", ["1@handles:hang"]).in_repair(1)  # published: not this one's point
    assert struck == []
    _injector(store, "a1", ["1@handles:hang"]).in_repair(1, published=False)
    _injector(store, "a1", ["1@repair"]).in_repair(1, published=False)
    assert struck == ["hang"]
