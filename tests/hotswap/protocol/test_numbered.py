"""A counter a stranger moved far ahead costs a reader of a numbered list a few reads, not one
per number (`numbered.py`), and the job's own values before and after the bump are still read."""

from __future__ import annotations

from stores import SEAL

from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.hotswap.protocol.messages import Keys, ProcessExit
from megatron_deadpool.hotswap.protocol.numbered import WINDOW, numbers_to_read


def test_a_wide_gap_is_read_at_both_ends_only() -> None:
    assert numbers_to_read(3, 6, set()) == [4, 5, 6]
    wide = numbers_to_read(3, 3 + 10**9, {2})
    assert len(wide) == 2 * WINDOW + 1 and wide[:2] == [2, 4] and wide[-1] == 3 + 10**9
    assert len(numbers_to_read(0, 0, set(range(10**5)))) == WINDOW  # the newest unread kept


def test_agents_exits_are_read_past_a_strangers_add() -> None:
    store = MemoryStore()
    agent, coordinator = Membership(store, "agent", SEAL), Membership(store, "coordinator", SEAL)
    agent.report_exit(ProcessExit("a1", -9, 0))
    store.add(Keys.AGENT_EXITS, 10**9)  # the stranger
    agent.report_exit(ProcessExit("a2", -9, 0))
    seen, exits = coordinator.process_exits(0)
    assert [e.member for e in exits] == ["a1", "a2"] and seen == 10**9 + 2


def test_a_counter_moved_back_is_read_up_to_it_and_never_below_one() -> None:
    assert numbers_to_read(100, 3, set()) == [1, 2, 3]
    assert numbers_to_read(100, 90, set()) == list(range(90 - WINDOW + 1, 91))
    assert numbers_to_read(5, -(10**9), {4}) == [4]
