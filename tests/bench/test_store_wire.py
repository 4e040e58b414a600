"""`store_wire.WireStore` sends what torch's TCPStore client sends, call for call, and reads
the same answers: both talk to a real store through a proxy that records the bytes."""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from megatron_deadpool.bench.scale.sim_ranks import RankStore
from megatron_deadpool.bench.scale.store_wire import Hub, WireStore
from megatron_deadpool.hotswap.protocol.connection import BoundedStore
from megatron_deadpool.hotswap.protocol.membership import host_store
from megatron_deadpool.hotswap.protocol.sealed_store import ABSENT

pytestmark = pytest.mark.timeout(60)


class RecordingProxy:
    """Forwards one client connection to the store, recording what the client sends."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.sent = bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.listener.getsockname()[1]}"

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.port))
        threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()
        self._pump(client, server, self.sent)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        while data := src.recv(65536):
            if record is not None:
                record += data
            dst.sendall(data)


def _calls(store: Any) -> list[Any]:
    """Every call `Membership` makes on a rank's store, with their answers."""
    out: list[Any] = []

    def run(fn: Callable[[], Any]) -> None:
        try:
            out.append(fn())
        except dist.DistStoreError as exc:
            out.append(type(exc).__name__)

    run(lambda: store.set("k", "value"))
    run(lambda: store.get("k"))
    run(lambda: store.add("c", 3))
    run(lambda: store.add("c", 0))
    run(lambda: store.check(["k"]))
    run(lambda: store.check(["k", "missing"]))
    run(lambda: store.wait(["k"], datetime.timedelta(seconds=5)))
    run(lambda: store.multi_get(["k", "c"]))
    run(lambda: store.compare_set("k", "value", "other"))
    run(lambda: store.compare_set("gone", ABSENT, ABSENT))  # `SealedStore.peek`
    run(lambda: store.compare_set("slot", "", "ready"))
    run(lambda: store.queue_push("inbox", "holdings 1"))
    run(lambda: store.delete_key("k"))
    run(lambda: store.delete_key("k"))  # gone: False
    run(lambda: store.wait(["never"], datetime.timedelta(seconds=0.2)))
    run(lambda: store.add("c", 1))  # the connection still works after a cancelled wait
    return out


def test_wire_store_sends_the_bytes_of_torchs_client_and_reads_the_same_answers() -> None:
    torch_side, wire_side = host_store("127.0.0.1", 0), host_store("127.0.0.1", 0)
    proxy = RecordingProxy(torch_side.port)
    host, port = proxy.address.split(":")
    client = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))
    torch_answers = _calls(client)
    prefixed = dist.PrefixStore("gen1", client)
    prefixed.set("sim/unique_id", b"\0" * 4)
    torch_answers.append(prefixed.get("sim/unique_id"))
    client.check(["k"])  # answered: everything before it went through the proxy

    wire_proxy = RecordingProxy(wire_side.port)
    hub = Hub()

    def wire_calls() -> list[Any]:
        store = WireStore(hub, wire_proxy.address, 10.0)
        answers = _calls(store)
        view = store.prefixed("gen1")
        view.set("sim/unique_id", b"\0" * 4)
        answers.append(view.get("sim/unique_id"))
        store.check(["k"])
        return answers

    wire_answers = hub.run(wire_calls)
    assert wire_answers == torch_answers
    assert torch_answers[1] == b"value" and torch_answers[-3] == "DistStoreError"
    # The handshake (VALIDATE, magic number, PING) is the same but for its random nonce.
    torch_bytes, wire_bytes = bytes(proxy.sent), bytes(wire_proxy.sent)
    assert wire_bytes[:6] == torch_bytes[:6] == bytes.fromhex("00cef7853c0d")
    assert wire_bytes[10:] == torch_bytes[10:]
    assert len(torch_bytes) > 300


def test_hub_runs_greenlets_concurrently_and_parks_each_on_its_own_wait() -> None:
    store = host_store("127.0.0.1", 0)
    address = f"127.0.0.1:{store.port}"
    hub = Hub()
    order: list[str] = []

    def waiter(i: int) -> int:
        wire = WireStore(hub, address, 10.0)
        wire.wait([f"go/{i}"])
        order.append(f"woke {i}")
        return wire.add("woken", 1)

    def main() -> list[int]:
        def setter(_: Any) -> None:
            hub.sleep(0.05)
            for i in (2, 0, 1):  # in this order: each waiter is woken by its own key
                store.set(f"go/{i}", "1")
                hub.sleep(0.05)

        results = hub.each(lambda i: waiter(i) if i < 3 else setter(i), [0, 1, 2, 3])
        return results[:3]

    counts = hub.run(main)
    assert order == ["woke 2", "woke 0", "woke 1"]
    assert sorted(counts) == [1, 2, 3]


def test_a_simulated_ranks_store_sends_what_a_ranks_bounded_client_sends() -> None:
    """`sim_ranks.RankStore` and a rank's `connection.BoundedStore` over torch's client: the same
    bytes for a set (confirmed by a check) and a counted set (confirmed by its add)."""
    torch_side, wire_side = host_store("127.0.0.1", 0), host_store("127.0.0.1", 0)
    proxy = RecordingProxy(torch_side.port)
    host, port = proxy.address.split(":")
    timeout = datetime.timedelta(seconds=10)
    bounded = BoundedStore(dist.TCPStore(host, int(port), is_master=False, timeout=timeout), 10.0)
    answers = [
        bounded.set("k", "value"),
        bounded.set_then_add("report", "holds", "count", 1),
        bounded.get("report"),
    ]
    bounded.check(["k"])  # answered: everything before it went through the proxy

    wire_proxy = RecordingProxy(wire_side.port)
    hub = Hub()

    def wire_calls() -> list[Any]:
        store = RankStore(hub, wire_proxy.address, 10.0)
        out = [
            store.set("k", "value"),
            store.set_then_add("report", "holds", "count", 1),
            store.get("report"),
        ]
        store.check(["k"])
        return out

    assert hub.run(wire_calls) == answers == [None, 1, b"holds"]
    assert bytes(wire_proxy.sent)[10:] == bytes(proxy.sent)[10:]
