"""`deadpool coordinator`'s command line (megatron_deadpool/cli/coordinator.py) through the
installed `deadpool` command: bad settings are refused with exit code 2 and one line. What the
coordinator does is tested in tests/hotswap/ (test_failover.py, test_frozen_peer.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest


@pytest.mark.timeout(60)
def test_coordinator_refuses_timeouts_out_of_order(
    deadpool_cli: Callable[..., subprocess.CompletedProcess],
) -> None:
    proc = deadpool_cli("coordinator", "--world-size", "4", "--deadpool-heartbeat-timeout", "200")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "deadpool-pg-timeout (120.0s) must exceed deadpool-heartbeat-timeout (200.0s)" in line
