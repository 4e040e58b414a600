"""Nothing unsealed decides: a stranger's counters and racing writes can delay a decision, never
make one or stall it.

A counter (`add`) carries no MAC, so the coordinator takes `gen{g}/holdings/count` as a hint:
a count out of its range is rejected and reported like a forged value, and the sealed reports
decide (at once, or by the agreement timeout at the latest). A newcomer's claim of its slot
replaces a stranger's values for as long as it takes, not for a fixed number of rounds.
"""

from __future__ import annotations

from typing import Any

import pytest
from decisions_job import AGREE_TIMEOUT, Job
from stores import SEAL

from megatron_deadpool.hotswap.protocol import sealed_store
from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.hotswap.protocol.messages import CLAIMED, Decision, Keys
from megatron_deadpool.hotswap.protocol.seal import ForgedValue


def _rejected(job: Job) -> set[str]:
    return {e["key"] for e in job.events.of("rejected_value")}


@pytest.mark.parametrize("forged", [-1_000_000, -1])
def test_a_strangers_add_to_the_report_count_cannot_stall_agreement(forged: int) -> None:
    """A large negative add is out of range: rejected and reported, and agreement goes on at
    once. A small one stays in range: the reports decide by the agreement timeout, and the
    coordinator never waits for a report that every survivor already made."""
    job = Job(spares=1)
    job.tick()
    job.die("a2")
    job.tick()
    assert job.m().plan(1) is not None
    job.store.add(Keys.HOLDINGS_COUNT.format(g=1), forged)
    job.report(1, [0, 1, 3])
    job.tick()
    if forged < -job.world:
        assert job.decision(1) == Decision.roster(job.world)
        assert Keys.HOLDINGS_COUNT.format(g=1) in _rejected(job)
        return
    assert job.decision(1) is None  # the hint says one report is missing: it waits
    job.tick(AGREE_TIMEOUT + 1)
    assert job.decision(1) == Decision.roster(job.world)
    assert job.events.of("process_dead")[-1]["member"] == "a2"  # nobody else presumed dead


class RacingStranger:
    """A store where a stranger overwrites `key` with a value of its own right before each of
    the first `rounds` compare-and-sets on it (the fastest writer there can be)."""

    def __init__(self, store: MemoryStore, key: str, rounds: int) -> None:
        self.store, self.key, self.rounds = store, key, rounds

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        if key == self.key and self.rounds > 0:
            self.rounds -= 1
            self.store.set(key, f"lost{self.rounds}")
        return self.store.compare_set(key, expected, desired)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_fast_stranger_cannot_make_a_newcomer_give_its_slot_up() -> None:
    store = MemoryStore()
    key = Keys.CLAIM.format(g=1, rank=2)
    racing = RacingStranger(store, key, rounds=100)
    m = Membership(racing, "s0", SEAL)  # type: ignore[arg-type]
    assert m.claim_slot(1, 2) == CLAIMED
    assert racing.rounds == 0


def test_a_stranger_that_never_stops_ends_the_claim_with_a_stated_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sealed_store, "FORGED_WAIT_S", 0.2)
    store = MemoryStore()
    key = Keys.CLAIM.format(g=1, rank=2)
    m = Membership(RacingStranger(store, key, rounds=10**9), "s0", SEAL)  # type: ignore[arg-type]
    with pytest.raises(ForgedValue, match="gen1/ready/2"):
        m.claim_slot(1, 2)


@pytest.mark.timeout(60)  # b213e7a's coordinator blocks here on a missing stamp
def test_a_strangers_add_to_the_phase_counts_neither_blocks_nor_stalls_the_coordinator() -> None:
    """Counted ahead of the stamps, the coordinator reads them without waiting for missing
    ones (a blocking read would hold its tick for the store's timeout); counted short, the
    stamps complete the recovery by the agreement timeout."""
    job = Job(spares=2)
    job.tick()
    job.decided("a2")
    for phase in ("joined", "restored", "first_iteration"):
        job.store.add(Keys.STAMP_COUNT.format(g=1, phase=phase), 100)
    job.tick()  # returns: the stamps are not there
    assert job.coord.recovering
    job.complete(1)  # every rank stamps: recovered
    assert [r["generation"] for r in job.coord.recoveries] == [1]

    job.die("a3")
    job.tick()
    job.report(2, [0, 1, 2])
    job.tick()
    assert job.decision(2) == Decision.roster(job.world)
    for phase in ("joined", "restored", "first_iteration"):
        job.store.add(Keys.STAMP_COUNT.format(g=2, phase=phase), -1000)
    for phase in ("joined", "restored", "first_iteration"):
        for rank, member in job.coord.roster.slots.items():
            job.m(member).stamp(2, phase, rank)
    job.tick()
    assert job.coord.recovering  # the counts say not yet
    job.tick(AGREE_TIMEOUT + 1)
    assert not job.coord.recovering
    assert [r["generation"] for r in job.coord.recoveries] == [1, 2]
