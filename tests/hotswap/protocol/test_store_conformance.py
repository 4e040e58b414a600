"""The in-memory store answers every call `Membership` makes as torch's TCPStore does.

Each behaviour runs on both stores (a real `TCPStore` on loopback, and `MemoryStore`): the
coordinator's decision tests (`test_decisions.py`) run on the in-memory one, so what they prove
holds on the real store only as far as this test holds.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist
from stores import SEAL

from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.hotswap.protocol.messages import CLAIMED, GIVEN_UP
from megatron_deadpool.hotswap.protocol.sealed_store import ABSENT

TIMEOUT = datetime.timedelta(seconds=0.5)


def _tcp() -> Any:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


@pytest.fixture(params=["tcp", "memory"])
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    yield _tcp() if request.param == "tcp" else MemoryStore(TIMEOUT)


def _raises_store_error(call: Callable[[], object]) -> float:
    """Seconds until `call` raised `DistStoreError` (it must)."""
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        call()
    return time.monotonic() - t0


def test_set_get_bytes_and_text(store: Any) -> None:
    store.set("t", "text")
    store.set("b", b"\x00\xff")
    assert store.get("t") == b"text"
    assert store.get("b") == b"\x00\xff"
    assert store.multi_get(["t", "b"]) == [b"text", b"\x00\xff"]


def test_missing_keys_block_until_the_timeout(store: Any) -> None:
    store.set("k", "v")
    for call in (
        lambda: store.get("missing"),
        lambda: store.multi_get(["k", "missing"]),
        lambda: store.wait(["missing"]),
        lambda: store.queue_pop("missing"),
    ):
        assert _raises_store_error(call) >= TIMEOUT.total_seconds() * 0.9
    short = datetime.timedelta(seconds=0.1)
    assert _raises_store_error(lambda: store.wait(["k", "missing"], short)) < 0.4


def test_a_wait_returns_when_another_connection_sets_the_key(store: Any) -> None:
    other = store.clone()
    other.set_timeout(datetime.timedelta(seconds=5))
    started = threading.Event()

    def later() -> None:
        started.set()
        time.sleep(0.1)
        store.set("late", "1")

    thread = threading.Thread(target=later)
    thread.start()
    started.wait()
    other.wait(["late"], datetime.timedelta(seconds=5))
    assert other.get("late") == b"1"
    thread.join()


def test_multi_set_sets_every_key_and_wakes_a_wait_on_one_of_them(store: Any) -> None:
    other = store.clone()
    other.set_timeout(datetime.timedelta(seconds=5))
    woke: list[float] = []

    def wait() -> None:
        other.wait(["m/b"], datetime.timedelta(seconds=5))
        woke.append(time.monotonic())

    waited = threading.Thread(target=wait)
    waited.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    store.multi_set(["m/a", "m/b"], ["1", b"\x00"])
    waited.join(5)
    assert woke and woke[0] - t0 < 1.0
    assert store.multi_get(["m/a", "m/b"]) == [b"1", b"\x00"]


def test_add_creates_counts_and_check_sees_it(store: Any) -> None:
    assert not store.check(["c"])
    assert store.add("c", 0) == 0
    assert store.check(["c"])
    assert store.add("c", 5) == 5
    assert store.add("c", -7) == -2
    assert store.get("c") == b"-2"


def test_compare_set(store: Any) -> None:
    assert store.compare_set("new", "", "x") == b"x"  # missing counts as ""
    assert store.compare_set("absent", "e", "x") == b"e"  # another expected: nothing created
    assert not store.check(["absent"])
    assert store.compare_set("new", "x", "y") == b"y"  # equal: set
    assert store.compare_set("new", "zz", "w") == b"y"  # not equal: the current value
    assert store.compare_set("new", "", "w") == b"y"
    store.set("empty", "")
    assert store.compare_set("empty", "", "q") == b"q"


def test_delete_key(store: Any) -> None:
    store.set("d", "1")
    assert store.delete_key("d") is True
    assert store.delete_key("d") is False
    assert not store.check(["d"])


def test_list_keys_and_num_keys_see_values_not_queues(store: Any) -> None:
    store.set("a/b", "1")
    store.add("c", 1)
    store.queue_push("q", "x")
    assert sorted(store.list_keys()) == ["a/b", "c"] and store.num_keys() == 2
    store.delete_key("a/b")
    assert store.list_keys() == ["c"] and store.num_keys() == 1


def test_queues(store: Any) -> None:
    store.queue_push("q", "a")
    store.queue_push("q", b"b")
    assert store.check(["q"])
    assert store.queue_pop("q") == b"a"
    assert store.queue_pop("q") == b"b"
    assert not store.check(["q"])
    other = store.clone()
    threading.Timer(0.1, lambda: other.queue_push("q", "c")).start()
    store.set_timeout(datetime.timedelta(seconds=5))
    assert store.queue_pop("q") == b"c"


def test_membership_reads_the_same_on_both(store: Any) -> None:
    """`Membership`'s one-request read (a compare-and-set no value matches) and its counters."""
    m = Membership(store, "a0", SEAL)
    assert m.core.peek("nothing") is None and not store.check(["nothing"])
    store.set("k", "v")
    assert m.core.peek("k") == b"v"
    assert store.compare_set("k", ABSENT, ABSENT) == b"v"
    assert m.claim_slot(1, 2) == CLAIMED
    m.give_up_slot(1, 2)  # a claim that came first stands
    assert m.wait_newcomers(1, [2], 1.0) is True
    m.give_up_slot(1, 3)
    assert m.claim_slot(1, 3) == GIVEN_UP
    assert m.wait_newcomers(1, [2, 3], 1.0) is False
    assert m.wait_newcomers(1, [4], 0.1) is None
    m.expect_reports(1, 2)
    assert m.reports_missing(1) == 2
