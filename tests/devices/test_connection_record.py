"""`devices.gloo.recording`: the connections a block opens are recorded for the next abort to
shut down - also when the block raises (a repair in place that fails part-way leaves the groups
it reconnected live). Real loopback TCP connections, no process group."""

from __future__ import annotations

import socket

import pytest

from megatron_deadpool.devices import gloo


def test_connections_opened_by_a_block_that_raises_are_recorded_for_the_abort() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    opened: list[socket.socket] = []
    try:
        lost = pytest.raises(RuntimeError, match="a member was lost")
        with lost, gloo.recording("repair 3", set()):
            opened.append(socket.create_connection(listener.getsockname()))
            opened.append(listener.accept()[0])
            raise RuntimeError("a member was lost")
        ends = {s.fileno() for s in opened}
        recorded = {fd for fd, inode in gloo.socket_fds().items() if inode in gloo.tracked()}
        assert recorded >= ends  # both ends, for `shutdown_connections`
        assert set(gloo.tracked().values()) >= {"repair 3"}
    finally:
        for s in opened:
            s.close()
        listener.close()
    assert "repair 3" not in gloo.tracked().values()  # closed: forgotten
