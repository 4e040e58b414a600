"""Connections to the job's store that never sent a request are dropped; the job's clients are not
(`hotswap/silent_connections.py`). torch's real store server, hosted in this process as the
coordinator hosts it; the command under a tight open-files limit is tested in
tests/cli/test_coordinator_open_files.py."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
import time

import torch.distributed as dist

from megatron_deadpool.hotswap.membership import host_store
from megatron_deadpool.hotswap.silent_connections import (
    FIRST_MESSAGE_BYTES,
    Silence,
    accepted,
    drop_silent,
    silence,
)
from megatron_deadpool.hotswap.store_files import OpenFiles


def _reads_end_of_file(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except (TimeoutError, ConnectionResetError):
        return False


def test_a_connection_is_silent_if_less_than_a_first_message_arrived_and_nothing_for_long() -> None:
    assert Silence(received=0, quiet_ms=1500).silent_for(1.0)
    assert not Silence(received=0, quiet_ms=500).silent_for(1.0)
    assert Silence(received=1, quiet_ms=1500).silent_for(1.0)
    assert not Silence(received=1, quiet_ms=500).silent_for(1.0)
    assert not Silence(received=FIRST_MESSAGE_BYTES, quiet_ms=60_000).silent_for(1.0)


_OPEN_FILES = """
import os, socket
from megatron_deadpool.hotswap.store_files import OpenFiles
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


def test_silent_connections_are_dropped_and_the_stores_clients_keep_theirs() -> None:
    store = host_store("127.0.0.1", 0)
    silent = [socket.create_connection(("127.0.0.1", store.port)) for _ in range(3)]
    silent.append(socket.create_connection(("127.0.0.1", store.port)))
    silent[-1].sendall(b"\x00")  # a byte, then nothing: less than any client's first message
    talked = socket.create_connection(("127.0.0.1", store.port))
    # torch's validation message, then silence: as a client blocked in a wait looks
    talked.sendall(b"\x00" + (0x3C85F7CE).to_bytes(4, "little"))
    client = dist.TCPStore(
        "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    try:
        client.set("before", "1")
        time.sleep(0.5)
        ports = {s.getsockname()[1] for s in silent}
        seen = {}
        files = OpenFiles()
        for conn in accepted(store.port, files.list()):
            quiet = silence(conn)
            assert quiet is not None
            seen[conn.getpeername()[1]] = quiet
        assert ports <= set(seen) and talked.getsockname()[1] in seen
        assert all(seen[p].received <= 1 and seen[p].quiet_ms >= 400 for p in ports), seen
        assert seen[talked.getsockname()[1]].received == FIRST_MESSAGE_BYTES

        assert drop_silent(store.port, files.list(), grace_s=60.0) == []  # none silent that long
        dropped = drop_silent(store.port, files.list(), grace_s=0.4)
        files.close()
        assert sorted(dropped) == sorted(f"127.0.0.1:{p}" for p in ports)
        for sock in silent:  # torch's server closed them
            assert _reads_end_of_file(sock, 5.0)
        # The connection that sent a whole first message and the store's own clients are kept.
        assert not _reads_end_of_file(talked, 0.5)
        assert client.get("before") == b"1"
        store.set("after", "2")
        assert client.get("after") == b"2"
    finally:
        for sock in [*silent, talked]:
            sock.close()
