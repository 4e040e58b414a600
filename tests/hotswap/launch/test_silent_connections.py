"""Connections to the job's store that never made a request are dropped; the job's clients are not
(`hotswap/launch/silent_connections.py`). torch's real store server, hosted in this process as the
coordinator hosts it; the command under a tight open-files limit is tested in
tests/cli/test_coordinator_open_files.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from megatron_deadpool.hotswap.launch.silent_connections import (
    OPENING_BYTES,
    Silence,
    accepted,
    drop_silent,
    own_clients,
    silence,
)
from megatron_deadpool.hotswap.protocol.membership import host_store
from megatron_deadpool.hotswap.protocol.store_files import OpenFiles


def _reads_end_of_file(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except (TimeoutError, ConnectionResetError):
        return False


def test_a_connection_is_silent_if_no_more_than_an_opening_arrived_and_nothing_for_long() -> None:
    assert Silence(received=0, quiet_ms=1500).silent_for(1.0)
    assert not Silence(received=0, quiet_ms=500).silent_for(1.0)
    assert Silence(received=1, quiet_ms=1500).silent_for(1.0)
    assert not Silence(received=1, quiet_ms=500).silent_for(1.0)
    assert Silence(received=OPENING_BYTES, quiet_ms=1500).silent_for(1.0)
    assert not Silence(received=OPENING_BYTES + 1, quiet_ms=60_000).silent_for(1.0)


_OPEN_FILES = """
import os, socket
from megatron_deadpool.hotswap.protocol.store_files import OpenFiles
files = OpenFiles()
before = files.list()
listed = {int(n) for n in os.listdir("/proc/self/fd")}  # with listdir's own descriptor
assert set(before) < listed and len(listed - set(before)) == 1, (before, listed)
extra = [socket.socket() for _ in range(50)]
after = files.list()
assert set(after) == set(before) | {s.fileno() for s in extra}, (before, after)
assert files.count() == len(after), (files.count(), after)
for sock in extra:
    sock.close()
assert files.count() == len(before), (files.count(), before)
print("ok")
"""


def test_open_files_are_counted_and_listed_without_opening_one_more() -> None:
    """In a process of its own: no other thread opens or closes a file meanwhile (this test's
    pytest worker has many)."""
    done = subprocess.run(
        [sys.executable, "-c", _OPEN_FILES],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


_CLIENTS = """
import datetime, json, socket, sys, threading
import torch.distributed as dist
port = int(sys.argv[1])
silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
silent[-1].sendall(b"\\x00")  # a byte, then nothing
opened = socket.create_connection(("127.0.0.1", port))
# torch's validation message and a ping, answered, then silence
opened.sendall(b"\\x00" + (0x3C85F7CE).to_bytes(4, "little") + b"\\x0d\\x01\\x00\\x00\\x00")
assert opened.recv(4) == b"\\x01\\x00\\x00\\x00"
timeout = datetime.timedelta(seconds=30)
idle, client, waiting = (
    dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout) for _ in range(3)
)
client.set("before", "1")
woken = []
waiter = threading.Thread(target=lambda: woken.append(waiting.wait(["wake"]) is None))
waiter.start()
print(json.dumps([s.getsockname()[1] for s in [*silent, opened]]), flush=True)
sys.stdin.readline()  # the host dropped what it would
for sock in [*silent, opened]:
    sock.settimeout(5.0)
    assert sock.recv(1) == b"", "a silent connection was not closed"
assert client.get("before") == b"1" and client.get("after") == b"2"
waiter.join(10.0)
assert woken == [True], woken
print("ok", flush=True)
"""


def test_silent_connections_are_dropped_and_the_stores_clients_keep_theirs() -> None:
    """Dropped: connections (from another process) that sent nothing, a byte, or a torch
    client's whole opening and no request - and a real client that connected and asked nothing.
    Kept: clients that made requests, one blocked in a wait, and the store's own client in this
    process, which made no request yet (without the exception for this process's own
    connections it would be dropped too)."""
    store = host_store("127.0.0.1", 0)
    clients = subprocess.Popen(
        [sys.executable, "-c", _CLIENTS, str(store.port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert clients.stdout is not None and clients.stdin is not None
        ports = set(json.loads(clients.stdout.readline()))
        time.sleep(0.5)
        files = OpenFiles()
        seen = {}
        for conn in accepted(store.port, files.list()):
            quiet = silence(conn)
            assert quiet is not None
            seen[conn.getpeername()[1]] = quiet
        assert ports <= set(seen) and len(seen) == len(ports) + 4  # 3 clients, the store's own
        assert all(seen[p].received <= OPENING_BYTES and seen[p].quiet_ms >= 400 for p in ports)
        assert max(seen[p].received for p in ports) == OPENING_BYTES
        own = own_clients(store.port, files.list())
        assert len(own) == 1 and seen[own.pop()[1]].received == OPENING_BYTES, (own, seen)

        assert drop_silent(store.port, files.list(), grace_s=60.0) == []  # none silent that long
        dropped = drop_silent(store.port, files.list(), grace_s=0.4)
        files.close()
        assert {f"127.0.0.1:{p}" for p in ports} < set(dropped)
        assert len(dropped) == len(ports) + 1, dropped  # and the client that asked nothing
        store.set("after", "2")  # the store's own client works
        store.set("wake", "1")
        out, _ = clients.communicate("go\n", timeout=60)
        assert clients.returncode == 0 and out.strip() == "ok", out
    finally:
        clients.kill()
        clients.wait()
