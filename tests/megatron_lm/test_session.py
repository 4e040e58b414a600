"""A process's place in the job and what the session refuses to protect (session.py)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from megatron_deadpool.config.deadpool import DeadpoolConfig
from megatron_deadpool.errors import ConfigError


def test_task_index_and_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_deadpool.hotswap.messages import member_of
    from megatron_deadpool.megatron_lm.session import task_from_env

    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert task_from_env() == 0
    monkeypatch.setenv("SLURM_PROCID", "8")
    assert task_from_env() == 8
    monkeypatch.setenv("RANK", "5")
    assert task_from_env() == 5
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ConfigError, match="task index"):
        task_from_env()
    # The coordinator's world size decides: tasks beyond it are spares.
    assert [member_of(t, 4) for t in (0, 3, 4, 5)] == ["a0", "a3", "s0", "s1"]


def test_session_refuses_what_it_cannot_protect() -> None:
    from megatron_deadpool.megatron_lm.session import MegatronSession

    session = MegatronSession(DeadpoolConfig(enabled=True), 0, "token")
    ok = SimpleNamespace(use_distributed_optimizer=True, data_parallel_size=2,
                         distributed_timeout_minutes=10)  # fmt: skip
    session._check_megatron_args(ok)
    bad = [
        ({"use_distributed_optimizer": False, "data_parallel_size": 1}, "data-parallel size is 1"),
        ({"fp16": True}, "--fp16"),
        ({"rampup_batch_size": [4, 4, 100]}, "rampup"),
        ({"context_parallel_size": 2}, "context or expert"),
        ({"distributed_timeout_minutes": 0.1}, "below --distributed-timeout-minutes"),
    ]
    for change, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            session._check_megatron_args(SimpleNamespace(**{**vars(ok), **change}))
