"""The job's store drops the connections of a host that vanished (`store_files.keep_alive`).

A host that loses power or its network never closes its connections: without keep-alive the
store's server (torch's, in this process) holds their descriptors for as long as it runs. Here
a client in a network namespace of its own connects to two stores hosted by this process - one
with DeadPool's keep-alive, one without (the control) - and then its link is cut. The store with
keep-alive must give the connection's descriptor back within the keep-alive time (plus the
probes' rounding); the control still holds its own after longer. The store then still serves
new clients.
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from procs import kill_sessions, spawn_logged, wait_until

from megatron_deadpool.devices.gloo import socket_fds
from megatron_deadpool.hotswap.protocol.membership import host_store

KEEPALIVE_S = 4.0

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2 to make a network namespace",
)

_CLIENT = """
import datetime, sys, time
import torch.distributed as dist
stores = [dist.TCPStore(sys.argv[1], int(p), is_master=False,
                        timeout=datetime.timedelta(seconds=30)) for p in sys.argv[2:]]
for s in stores:
    s.set("here", "1")
print("connected", flush=True)
time.sleep(600)
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespace() -> Iterator[tuple[str, str, str, str]]:
    """A network namespace joined to this one by a veth pair: (namespace, this side's device,
    this side's address, the namespace's address). Removed at the end, whatever happens."""
    tag = os.getpid() % 100000
    ns, near, far = f"dpka{tag}", f"dpka{tag}a", f"dpka{tag}b"
    net = f"10.254.{tag % 250}"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", near, "type", "veth", "peer", "name", far)
        _ip("link", "set", far, "netns", ns)
        _ip("addr", "add", f"{net}.1/30", "dev", near)
        _ip("link", "set", near, "up")
        _ip("-n", ns, "addr", "add", f"{net}.2/30", "dev", far)
        _ip("-n", ns, "link", "set", far, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, near, f"{net}.1", f"{net}.2"
    finally:
        for cmd in (["link", "del", near], ["netns", "del", ns]):
            subprocess.run(["ip", *cmd], check=False, capture_output=True, timeout=30)


def _connections(port: int, peer: str) -> int:
    """Descriptors this process holds that are TCP connections to its `port` from `peer`."""
    inodes = {str(inode) for inode in socket_fds().values()}
    want = socket.inet_aton(peer)[::-1].hex().upper()  # /proc/net/tcp: little-endian
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].split(":")[1], 16)
        if local_port == port and fields[2].split(":")[0] == want and fields[9] in inodes:
            count += 1
    return count


@pytest.mark.timeout(120)
def test_a_vanished_hosts_connections_are_dropped(
    namespace: tuple[str, str, str, str], tmp_path: Path
) -> None:
    ns, near, address, peer = namespace
    kept = host_store(address, 0, keepalive_s=KEEPALIVE_S)
    control = host_store(address, 0)
    log = tmp_path / "client.log"
    client = spawn_logged(
        ["ip", "netns", "exec", ns, sys.executable, "-c", _CLIENT, address]
        + [str(kept.port), str(control.port)],
        log,
        dict(os.environ),
    )
    try:
        wait_until(
            lambda: "connected" in log.read_text() or client.poll() is not None,
            60,
            "the client in the namespace to connect",
        )
        assert client.poll() is None, log.read_text()
        assert _connections(kept.port, peer) >= 1 and _connections(control.port, peer) >= 1
        _ip("link", "set", near, "down")  # the host is gone: nothing answers any more
        t0 = time.monotonic()
        wait_until(
            lambda: _connections(kept.port, peer) == 0,
            KEEPALIVE_S + 15,
            "the store with keep-alive to drop the vanished host's connections",
        )
        print(f"dropped {time.monotonic() - t0:.1f}s after the cut (keep-alive {KEEPALIVE_S}s)")
        time.sleep(KEEPALIVE_S)  # the control gets as long again: it never lets go
        assert _connections(control.port, peer) >= 1
        # The store serves new clients as before.
        fresh = dist.TCPStore(
            address, kept.port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        assert fresh.get("here") == b"1"
    finally:
        kill_sessions([client])
