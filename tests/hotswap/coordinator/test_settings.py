"""One constructor for every coordinator (`settings.py`, `Coordinator.from_settings`): the
settings a job's `DeadpoolConfig` gives, a bad number named by its field, and the coordinator
they build on an in-memory store."""

from __future__ import annotations

import math

import pytest
from decisions_job import Agents, Launcher
from stores import SEAL

from megatron_deadpool.config.deadpool import DeadpoolConfig
from megatron_deadpool.errors import ConfigError
from megatron_deadpool.hotswap.coordinator.clock import ManualClock
from megatron_deadpool.hotswap.coordinator.coordinator import Coordinator
from megatron_deadpool.hotswap.coordinator.events import EventLog
from megatron_deadpool.hotswap.coordinator.settings import CoordinatorSettings
from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.replication.placement import Layout, place_replicas


def test_a_jobs_config_gives_the_coordinators_numbers() -> None:
    cfg = DeadpoolConfig(
        enabled=True, spares=3, heartbeat_timeout=12.0, join_timeout=300.0, respawn_limit=1
    )
    settings = CoordinatorSettings.of(cfg, 8, cfg.spares, suspect_after=cfg.suspect_after)
    assert settings == CoordinatorSettings(
        world_size=8,
        spares=3,
        heartbeat_timeout=12.0,
        agree_timeout=cfg.agreement_timeout,
        join_timeout=300.0,
        suspect_after=cfg.suspect_after,
        respawn_limit=1,
        respawn_window=cfg.respawn_window,
    )
    assert settings.spare_names == ["s0", "s1", "s2"]
    local = CoordinatorSettings.of(cfg, 8, 0, suspect_after=None)  # a launcher sees exits
    assert local.suspect_after is None and local.spare_names == []


@pytest.mark.parametrize(
    "field, value",
    [("world_size", 0), ("spares", -1), ("heartbeat_timeout", math.nan), ("agree_timeout", 0.0)],
)
def test_a_bad_number_is_named_by_its_field(field: str, value: float) -> None:
    numbers: dict[str, float] = {"world_size": 4, "heartbeat_timeout": 10.0, "agree_timeout": 20.0}
    numbers[field] = value
    with pytest.raises(ConfigError, match=f"^{field}: expected"):
        CoordinatorSettings(**numbers)  # type: ignore[arg-type]


def test_the_settings_build_the_coordinator_with_its_spares_and_respawn_budget() -> None:
    store = MemoryStore()
    agents, launcher = Agents(world=4, per_node=1), Launcher()
    agents.claim = Membership(store.clone(), "agent", SEAL).claim_spare_name
    coord = Coordinator.from_settings(
        CoordinatorSettings(
            world_size=4,
            spares=2,
            heartbeat_timeout=10.0,
            agree_timeout=20.0,
            join_timeout=60.0,
            respawn_limit=1,
            respawn_window=30.0,
        ),
        Membership(store, "coordinator", SEAL),
        liveness=launcher,
        events=EventLog(None),
        placement=place_replicas(Layout(tp=1, pp=1, dp=4, ranks_per_node=1), 1),
        agents=agents,
        clock=ManualClock(),
    )
    coord.start()
    assert coord.spares == ("s0", "s1") and coord.roster.slots == {r: f"a{r}" for r in range(4)}
    assert coord.join_timeout == 60.0 and coord.detector.heartbeat_timeout == 10.0
    assert coord.agree_timeout == 20.0
    launcher.codes["a2"] = -9  # a crash on a live node: respawned there (limit 1), no spare
    coord.tick()
    ((rank, dead, node, member),) = agents.started
    assert (rank, dead, node) == (2, "a2", 2) and coord.spares == ("s0", "s1")
    plan = Membership(store.clone(), "a0", SEAL).plan(1)
    assert plan is not None and plan.replaced == {2: member}
