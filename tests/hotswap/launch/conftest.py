"""What the launcher tests share: processes killed whatever happens, fork servers of a test's own,
and one fork server per test module (of the module's `LIGHT` preload and `ENV` environment)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from megatron_deadpool.hotswap.coordinator.liveness import kill_groups
from megatron_deadpool.hotswap.launch.warm_start import ForkServer


@pytest.fixture
def own_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `WarmStart` has servers of its own, as a launcher process has by default (the test
    session lends kept ones: tests/conftest.py); the kept ones are tested with a pool of their
    own."""
    monkeypatch.setenv("DEADPOOL_WARM_START", "1")


@pytest.fixture
def started() -> Iterator[list[Any]]:
    """Processes a test starts; their groups are killed whatever happens."""
    procs: list[Any] = []
    try:
        yield procs
    finally:
        kill_groups(procs)


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[ForkServer]:
    """A fork server importing the test module's `LIGHT`, in its `ENV`; ended and reaped after
    the module's tests."""
    srv = ForkServer(request.module.LIGHT, request.module.ENV)
    try:
        yield srv
    finally:
        srv.close()
        assert srv.proc.returncode is not None
