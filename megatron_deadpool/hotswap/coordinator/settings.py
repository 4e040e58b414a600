"""What a coordinator is told about its job, built once: from `DeadpoolConfig` where a launcher or
`deadpool coordinator` runs one, from a benchmark's options where a benchmark does.

`Coordinator.from_settings` builds the coordinator from it; a call site adds only what is
really its own: the store's client, who sees the processes' exits, the event log, the nodes'
agents, a manual clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config.deadpool import DeadpoolConfig
from ...config.numbers import check_number


@dataclass(frozen=True, kw_only=True)
class CoordinatorSettings:
    """The numbers a coordinator decides by."""

    world_size: int
    """Ranks of the job (slots 0..world_size-1, members a0..)."""
    spares: int = 0
    """Spares started with the job (members s0..)."""
    heartbeat_timeout: float
    """Seconds of silence after which a member is hung."""
    agree_timeout: float
    """Seconds a planned survivor may take to report its holdings before it is presumed
    dead."""
    join_timeout: float = 600.0
    """Seconds a decided newcomer may take to claim its slot."""
    suspect_after: float | None = None
    """Once a survivor reported a failed collective, silence that names a member dead (None:
    the heartbeat timeout; exits are seen at once where a launcher watches the processes)."""
    sweep_interval: float | None = None
    """Seconds between heartbeat sweeps (None: the heartbeat timeout / 20)."""
    respawn_limit: int = 0
    """Respawns per node within `respawn_window` (0: every failed rank takes a spare)."""
    respawn_window: float = 600.0

    def __post_init__(self) -> None:
        check_number(self.world_size, "world_size", integer=True, minimum=1)
        check_number(self.spares, "spares", integer=True, minimum=0)
        check_number(self.respawn_limit, "respawn_limit", integer=True, minimum=0)
        for name in ("heartbeat_timeout", "agree_timeout", "join_timeout", "respawn_window"):
            check_number(getattr(self, name), name, above=0, unit="seconds")
        for name in ("suspect_after", "sweep_interval"):
            if getattr(self, name) is not None:
                check_number(getattr(self, name), name, minimum=0, unit="seconds")

    @classmethod
    def of(
        cls, cfg: DeadpoolConfig, world_size: int, spares: int, *, suspect_after: float | None
    ) -> CoordinatorSettings:
        """The settings of a job of `world_size` ranks and `spares` spares run by `cfg`;
        `suspect_after`: `cfg.suspect_after` where only heartbeats name the dead (a cluster's
        coordinator), None where a launcher sees every exit (a silence after a peer's failure
        proves nothing more there)."""
        return cls(
            world_size=world_size,
            spares=spares,
            heartbeat_timeout=cfg.heartbeat_timeout,
            agree_timeout=cfg.agreement_timeout,
            join_timeout=cfg.join_timeout,
            suspect_after=suspect_after,
            respawn_limit=cfg.respawn_limit,
            respawn_window=cfg.respawn_window,
        )

    @property
    def spare_names(self) -> list[str]:
        """The spares started with the job, in the order they take slots."""
        return [f"s{i}" for i in range(self.spares)]
