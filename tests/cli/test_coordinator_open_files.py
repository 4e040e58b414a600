"""`deadpool coordinator` started under the common default soft limit of 1,024 open files serves a
job of more than 2,048 connections: it raises its own limit (`hotswap/protocol/store_files.py`); and it
refuses, with one line naming `ulimit -n` and the number, a job its hard limit cannot hold.

Real connections: store clients held by this test process (one descriptor each, its own soft
limit raised for them) against the real command, started through `prlimit` with the limits under
test. The clients are `bench/scale/store_wire.py`'s, which send torch's client's bytes
(tests/bench/test_store_wire.py) without its ~0.1 s per connection (torch's client connects in
about 100 ms here, which made 2,100 of them take 3.5 minutes)."""

from __future__ import annotations

import os
import re
import resource
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import REPO_ROOT, deadpool_command
from procs import free_port, wait_until

from megatron_deadpool.bench.scale.store_wire import Hub, WireStore
from megatron_deadpool.config.deadpool import DeadpoolConfig
from megatron_deadpool.hotswap.launch.silent_connections import GRACE_S
from megatron_deadpool.hotswap.protocol.connection import open_client
from megatron_deadpool.hotswap.protocol.store_files import (
    CONNECTIONS_PER_PROCESS,
    store_files_needed,
)

CLIENTS = 2100
"""Connections the test opens: more than 2,048 (twice the default soft limit)."""
DEFAULT_SOFT = 1024


def _coordinator(world: int, port: int, soft: int, hard: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            "prlimit",
            f"--nofile={soft}:{hard}",  # the child's limits, set before it starts
            *deadpool_command(),
            "coordinator",
            "--world-size",
            str(world),
            "--deadpool-coordinator",
            f"127.0.0.1:{port}",
            "--deadpool-job-token",
            "open-files-test",
            "--max-wait",
            "300",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
    except OSError:
        return False
    return True


def _soft_limit_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-files line in /proc/PID/limits")


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux's prlimit")
def test_a_coordinator_under_a_soft_limit_of_1024_serves_more_than_2048_connections() -> None:
    world = -(-CLIENTS // CONNECTIONS_PER_PROCESS)  # a job whose ranks keep that many
    need = store_files_needed(world, DeadpoolConfig().spares)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    own = CLIENTS + 256  # this process: one descriptor per client, and its own files
    if hard != resource.RLIM_INFINITY and hard < max(need, own):
        pytest.skip(f"this machine's hard open-files limit ({hard}) is below {max(need, own)}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, own), hard))
    port = free_port()
    proc = _coordinator(world, port, DEFAULT_SOFT, hard)
    hub = Hub()
    clients: list[WireStore] = []
    try:
        wait_until(lambda: _accepts(port) or proc.poll() is not None, 60, "the coordinator")
        assert proc.poll() is None, proc.communicate()
        assert _soft_limit_of(proc.pid) >= need
        for _ in range(CLIENTS):  # each connects and passes torch's handshake
            clients.append(WireStore(hub, f"127.0.0.1:{port}", 20.0))

        def talk() -> None:
            hub.each(lambda i: clients[i].set(f"probe/{i}", str(i)), range(CLIENTS))
            for i, client in enumerate(clients):  # every connection still answers
                j = (i + 1) % CLIENTS
                assert client.get(f"probe/{j}") == str(j).encode()

        hub.run(talk)
        assert proc.poll() is None
    finally:
        for client in clients:
            client.sock.close()
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux's prlimit")
def test_a_coordinator_refuses_a_job_its_hard_limit_cannot_hold() -> None:
    world = 600  # a job of 600 ranks keeps ~1,200 connections
    need = store_files_needed(world, DeadpoolConfig().spares)
    assert need > DEFAULT_SOFT
    proc = _coordinator(world, free_port(), DEFAULT_SOFT, DEFAULT_SOFT)
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 2, (out, err)
    (line,) = err.strip().splitlines()
    assert f"ulimit -n {need}" in line and f"at most {DEFAULT_SOFT}" in line, line


def _lock_out(port: int, need: int, flood: list[socket.socket], held: list[object]) -> None:
    """Fill the store's descriptors with connections that send nothing (into `flood`) until a
    client of the job is refused; the clients that got in meanwhile go into `held` (to be kept
    open: each is silent past its opening). A descriptor the server held during the flood and
    closed after it - a reachability probe's connection whose end it had not yet read - lets
    one client in; another round of the flood takes that place too."""
    for _ in range(3):
        for _ in range(need + 20):  # more than it may hold; those past its limit are reset
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5.0))
        try:
            held.append(open_client(f"127.0.0.1:{port}", 2.0))
        except dist.DistError:
            return  # locked out
    raise AssertionError("three floods of silent connections did not lock a client out")


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux's prlimit")
def test_silent_connections_that_lock_the_job_out_are_dropped() -> None:
    """A coordinator whose hard limit is exactly what its job needs; connections that never send
    a byte fill its descriptors, and a client of the job is refused ("Connection reset by
    peer": the server is at its limit). Within the grace and a look, the coordinator drops the
    silent ones, says so, and the client gets in."""
    world = 4
    need = store_files_needed(world, DeadpoolConfig().spares)
    port = free_port()
    proc = _coordinator(world, port, need, need)
    flood: list[socket.socket] = []
    held: list[object] = []  # open until the end: their places stay taken
    try:
        wait_until(lambda: _accepts(port) or proc.poll() is not None, 60, "the coordinator")
        assert proc.poll() is None, proc.communicate()
        _lock_out(port, need, flood, held)
        t0 = time.monotonic()
        client = None
        while client is None and time.monotonic() - t0 < GRACE_S + 30:
            try:
                client = open_client(f"127.0.0.1:{port}", 2.0)
            except dist.DistError:
                time.sleep(0.5)
        if client is None:
            proc.terminate()
            raise AssertionError(f"not let in: {proc.communicate(timeout=30)[1][-3000:]}")
        print(f"the job's client got in {time.monotonic() - t0:.1f}s after the flood")
        client.set("in", "1")
        assert client.get("in") == b"1"
    finally:
        for sock in flood:
            sock.close()
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    dropped = re.findall(
        r"dropped (\d+) connection\(s\) to the job's store that sent no request", err
    )
    assert dropped and sum(map(int, dropped)) >= 1, err
