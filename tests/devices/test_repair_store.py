"""The store a process's repairable groups rendezvous on (`devices.repair_store`), on a real TCP
store in this process: it passes everything through, and `abandon` ends the waits under way -
through another connection, writing only where no value is - and every later read of them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from megatron_deadpool.devices import gloo
from megatron_deadpool.devices.repair_store import ABANDONED, RepairAbandoned, RepairStore


@pytest.fixture()
def clients() -> Iterator[tuple[Any, Any, int]]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    one = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    other = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    yield one, other, server.port


def _waiting_in(call: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """`call()` on a thread of its own; what it returned or raised, and after how long."""
    out: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["value"] = call()
        except Exception as exc:  # noqa: BLE001 - what the test looks at
            out["error"] = exc
        out["s"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_operations_pass_through_and_groups_find_the_tcp_store_port(clients: Any) -> None:
    one, other, port = clients
    store = RepairStore(dist.PrefixStore("gen0", one))
    group = dist.PrefixStore("tp/", store)  # as torch prefixes a subgroup's store
    group.set("a", b"1")
    assert dist.PrefixStore("gen0", other).get("tp//a") == b"1"
    assert group.get("a") == b"1" and group.check(["a"]) and not group.check(["b"])
    assert group.add("n", 2) == 2 and group.add("n", 3) == 5
    group.wait(["a"])
    assert gloo.store_port_of(group) == port == store.port


def test_abandon_ends_a_wait_and_marks_only_the_keys_without_a_value(clients: Any) -> None:
    one, other, _ = clients
    store = RepairStore(dist.PrefixStore("gen0", one))
    group = dist.PrefixStore("tp/", store)
    side = dist.PrefixStore("gen0", other)
    side.set("tp//there", b"address")
    with store.abandonable():
        thread, out = _waiting_in(lambda: group.wait(["there", "missing"]))
        time.sleep(0.3)  # blocked in the TCP store's wait
        assert store.abandon(side) == ["tp//missing", "tp//there"]
        thread.join(10)
        assert isinstance(out.get("error"), RepairAbandoned), out
        assert out["s"] < 5
        with pytest.raises(RepairAbandoned):  # and what follows in the same repair
            group.get("there")
    assert side.get("tp//there") == b"address"  # a value already there is kept
    assert side.get("tp//missing") == ABANDONED
    assert group.get("there") == b"address"  # the block ended: the mark is cleared


def test_a_blocked_get_ends_and_another_process_reading_the_mark_raises(clients: Any) -> None:
    one, other, port = clients
    store = RepairStore(dist.PrefixStore("gen0", one))
    with store.abandonable():
        thread, out = _waiting_in(lambda: store.get("k"))
        time.sleep(0.3)
        assert store.abandon(dist.PrefixStore("gen0", other)) == ["k"]
        thread.join(10)
        assert isinstance(out.get("error"), RepairAbandoned), out
    # a peer whose repair of the same generation reads the key later: the mark, not an address
    third = dist.TCPStore("127.0.0.1", port, is_master=False)
    peer = RepairStore(dist.PrefixStore("gen0", third))
    with pytest.raises(RepairAbandoned, match="abandoned for a later plan"):
        peer.get("k")


def test_nothing_waited_for_nothing_written(clients: Any) -> None:
    one, other, _ = clients
    store = RepairStore(dist.PrefixStore("gen0", one))
    with store.abandonable():
        assert store.abandon(dist.PrefixStore("gen0", other)) == []
        with pytest.raises(RepairAbandoned):
            store.wait(["later"])
    assert not store.check(["later"])
