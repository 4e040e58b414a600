"""The pieces of a coordinator failover, in one process on loopback stores.

A process's `CoordinatorLink` and `FailoverStore` (its side), and a `Standby`'s withdrawal
when the primary answers again before anyone re-registered (the rule that keeps a job from
splitting across two stores). The whole failover with real processes is `test_failover.py`.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist
from procs import free_port, wait_until

from megatron_deadpool.config.deadpool import DeadpoolConfig
from megatron_deadpool.errors import CoordinatorUnreachableError, JobTokenError
from megatron_deadpool.hotswap.coordinator.events import EventLog
from megatron_deadpool.hotswap.coordinator.standby import PeerWatch, Standby
from megatron_deadpool.hotswap.protocol.membership import Membership, host_store
from megatron_deadpool.hotswap.protocol.messages import CoordinatorIdentity, Registration
from megatron_deadpool.hotswap.protocol.seal import JobSeal
from megatron_deadpool.hotswap.worker.failover import CoordinatorLink, FailoverStore

TOKEN = "job-A"
SEAL = JobSeal(TOKEN)


class Server:
    """A coordinator's store on loopback, reached through a TCP relay whose `stop()` closes
    every connection and refuses new ones, as the coordinator's crash would; `index`: its entry
    in the job's coordinator list (its values sealed for it: `seal.py`)."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.store = host_store("127.0.0.1", 0)
        backend = ("127.0.0.1", self.store.port)
        self.membership = Membership(self.store, "coordinator", SEAL.for_store(index))
        self.relay = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.relay.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        self.frozen = threading.Event()  # set: connections stay open, nothing is answered
        threading.Thread(target=self._accept, args=(backend,), daemon=True).start()

    def _accept(self, backend: tuple[str, int]) -> None:
        while True:
            try:
                client, _ = self.relay.accept()
            except OSError:
                return  # stopped
            server = socket.create_connection(backend)
            self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self.frozen.is_set():
                    dst.sendall(data)
        except OSError:
            pass

    def serve(self, epoch: int, nonce: str, token: str = TOKEN) -> None:
        """Serve the job of secret `token` (another job's: `token` other than `TOKEN`)."""
        serving = Membership(self.store, "coordinator", JobSeal(token).for_store(self.index))
        serving.set_identity(CoordinatorIdentity(epoch, nonce))
        serving.set_token()

    def freeze(self) -> None:
        """Stop answering and keep every connection open (SIGSTOP, a hung node)."""
        self.frozen.set()

    def stop(self) -> None:
        self.relay.close()
        self.cut()

    def cut(self) -> None:
        """Reset every open connection (a network blip); new ones are accepted."""
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def link(addresses: list[str], connect_timeout: float = 20.0, **kw: Any) -> CoordinatorLink:
    record = kw.pop("record", lambda: Registration(member="a2", rank=2, generation=0))
    return CoordinatorLink(
        addresses,
        SEAL,
        connect_timeout=connect_timeout,
        op_timeout=2.0,
        rebuild_timeout=10.0,
        beat_s=0.2,
        member=lambda: "a2",
        record=record,
    )


@pytest.mark.timeout(60)
def test_a_standby_that_has_not_taken_over_is_never_joined() -> None:
    primary, standby = Server(0), Server(1)
    primary.stop()  # the primary is gone; the standby serves no job (no token)
    t0 = time.monotonic()
    with pytest.raises(CoordinatorUnreachableError, match="serves no job yet"):
        link([primary.address, standby.address], connect_timeout=2.0).connect()
    assert time.monotonic() - t0 < 20
    assert standby.membership.registration("a2") is None


@pytest.mark.timeout(60)
def test_a_coordinator_that_refuses_connections_is_given_up_on_after_the_connect_timeout() -> None:
    """What a worker does when no coordinator listens (test_faults runs the worker itself,
    whose start-up on a loaded machine would dominate any time measured there)."""
    address = f"127.0.0.1:{free_port()}"  # nothing listens: every attempt is refused
    t0 = time.monotonic()
    with pytest.raises(CoordinatorUnreachableError, match=f"{address} unreachable after 2s"):
        link([address], connect_timeout=2.0).connect()
    assert 2.0 <= time.monotonic() - t0 < 20


@pytest.mark.timeout(60)
def test_another_jobs_coordinator_is_refused() -> None:
    other = Server()
    other.serve(0, "x", token="job-B")
    with pytest.raises(JobTokenError, match="deadpool-job-token"):
        link([other.address]).connect()


@pytest.mark.timeout(120)
def test_a_process_re_registers_with_the_standby_that_took_over() -> None:
    primary, standby = Server(0), Server(1)
    primary.serve(0, "primary")
    primary.membership.set_progress(7)
    records = [Registration(member="a2", rank=2, generation=0, last_completed=7)]
    lk = link([primary.address, standby.address], record=lambda: records[-1])
    lk.connect()
    membership = Membership(FailoverStore(lk), "a2", lk.store_seal)
    assert membership.progress() == 7 and lk.identity == CoordinatorIdentity(0, "primary")

    def take_over() -> None:  # what `Standby` does, by hand
        # Only once the process, having lost the primary, has found the standby serving no job.
        wait_until(lambda: len(standby.sockets) > tried, 30, "a connection to the standby")
        standby.serve(1, "standby")
        wait_until(lambda: standby.membership.registration("a2"), 30, "a2's re-registration")
        standby.membership.set_progress(7)
        standby.membership.publish_rebuilt(1)

    tried = len(standby.sockets)
    helper = threading.Thread(target=take_over)
    helper.start()
    primary.stop()
    t0 = time.monotonic()
    membership.publish_digest(2, "d")  # a `set` is not answered: it may vanish with the primary
    assert membership.progress() == 7  # fails on the lost primary, repeated on the standby
    membership.publish_digest(2, "d")
    helper.join()
    assert time.monotonic() - t0 < 30
    assert standby.membership.digest(2) == "d"
    assert lk.identity == CoordinatorIdentity(1, "standby") and lk.address == standby.address
    assert standby.membership.registration("a2") == records[-1]
    assert standby.membership.announced("a2")  # announced itself there
    # A second connection of the same process (its heartbeat's) follows without searching.
    beat = Membership(FailoverStore(lk), "a2", lk.store_seal)
    beat.heartbeat()
    assert lk.switches == 1


@pytest.mark.timeout(60)
def test_a_blip_reconnects_to_the_same_coordinator_without_re_registering() -> None:
    primary, standby = Server(0), Server(1)
    primary.serve(0, "primary")
    lk = link([primary.address, standby.address])
    lk.connect()
    membership = Membership(FailoverStore(lk), "a2", lk.store_seal)
    membership.set_progress(3)
    primary.cut()
    assert membership.progress() == 3  # answered by the same coordinator on a new connection
    assert (
        lk.switches == 1 and lk.identity == CoordinatorIdentity(0, "primary") and lk.takeovers == []
    )
    assert primary.membership.registration("a2") is None
    assert standby.membership.registration("a2") is None


@pytest.mark.timeout(60)
def test_a_store_that_stops_answering_is_given_up_on_in_bounded_time() -> None:
    """torch's client waits without end for a server that accepted but never answers."""
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)  # accepts connections (the kernel does), never answers: a frozen server
    address = f"127.0.0.1:{mute.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(CoordinatorUnreachableError):
        link([address], connect_timeout=3.0).connect()
    assert time.monotonic() - t0 < 20
    mute.close()


@pytest.mark.timeout(60)
def test_standby_withdraws_when_the_primary_answers_before_anyone_came(tmp_path: Any) -> None:
    primary, standby = Server(0), Server(1)
    primary.serve(0, "primary")
    cfg = DeadpoolConfig(
        coordinator=f"{primary.address},{standby.address}",
        heartbeat_interval=0.2,
        heartbeat_timeout=1.0,
        connect_timeout=5.0,
        spares=1,
    )
    said: list[str] = []
    events = EventLog(tmp_path / "events.jsonl")
    sb = Standby(cfg, 1, 4, standby.membership, events, said.append)
    assert sb.take_over() is None  # the primary still answers: it steps back at once
    assert standby.membership.serves_job() is None and standby.membership.identity() is None
    assert [e["event"] for e in events.events] == ["taking_over", "withdrew"]
    # While the primary serves and then ends the job, the standby is not needed.
    primary.membership.request_shutdown()
    assert sb.wait_for_loss() is False
    assert isinstance(primary.store, dist.TCPStore)


@pytest.mark.timeout(60)
def test_a_primary_that_freezes_between_the_probe_and_the_next_read_is_silence() -> None:
    """CI: the primary froze after the standby's probe and before its read of the shutdown
    request; the read's timeout ended the standby (exit 1) instead of counting as silence."""
    primary = Server()
    primary.serve(0, "primary")
    watch = PeerWatch(SEAL, 0.5, [primary.address])
    found = watch.serving([primary.address])
    assert found is not None and watch.ended(*found) is False
    primary.freeze()
    assert watch.ended(*found) is None  # not an error: it did not answer this time
    assert primary.address not in watch.clients  # the next probe opens a fresh client
    assert watch.serving([primary.address]) is None


@pytest.mark.timeout(60)
def test_the_primarys_token_and_identity_copied_to_a_standby_are_not_the_primary_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An outsider copies the primary's sealed `job/token` and `coordinator` into the store of
    a standby that has not taken over. Sealed for the primary's store only, they do not open
    there: when the primary is lost, the standby is not taken for the primary answering again
    (the process would carry on against a store of nothing), and the copied identity is
    rejected and logged. (Before seals were bound to their store, the process moved to it.)"""
    primary, standby = Server(0), Server(1)
    primary.serve(0, "primary")
    outsider = dist.TCPStore("127.0.0.1", standby.store.port, is_master=False)
    for key in ("job/token", "coordinator"):
        outsider.set(key, primary.store.get(key))
    lk = link([primary.address, standby.address], connect_timeout=3.0)
    lk.connect()
    membership = Membership(FailoverStore(lk), "a2", lk.store_seal)
    membership.set_progress(3)
    primary.stop()
    with caplog.at_level("WARNING"), pytest.raises(CoordinatorUnreachableError):
        membership.progress()
    assert lk.address == primary.address and lk.switches == 0
    assert any("store key coordinator: rejected" in r.getMessage() for r in caplog.records)
    assert standby.membership.registration("a2") is None


@pytest.mark.timeout(60)
def test_a_write_repeated_on_the_standbys_store_is_sealed_for_it() -> None:
    """A value sealed for the primary's store, whose write is repeated on the standby's after a
    failover, is sealed again for the standby's store (`CoordinatorLink.rebind`); a value of
    no store of the job goes as it is."""
    lk = link(["127.0.0.1:1", "127.0.0.1:2"])
    sealed_for_primary = SEAL.seal("digest/2", "d")
    assert lk.rebind("digest/2", sealed_for_primary) == sealed_for_primary
    lk.current = lk.seals[1]  # the standby serves now
    again = lk.rebind("digest/2", sealed_for_primary)
    assert again != sealed_for_primary
    assert SEAL.for_store(1).open("digest/2", again) == b"d"
    assert lk.store_seal.open("digest/2", again) == b"d"
    assert lk.rebind("digest/2", "plain") == "plain"
    forged = JobSeal("another job").for_store(1).seal("digest/2", "d")
    assert lk.rebind("digest/2", forged) == forged
