"""DeadPool's log level follows Megatron-LM's `--logging-level` / MEGATRON_LOGGING_LEVEL
(log_level.py); the end-to-end check is in test_pretrain_gpt.py (the hung-rank run)."""

from __future__ import annotations

import logging

import pytest

from megatron_deadpool.errors import ConfigError
from megatron_deadpool.megatron_lm.log_level import megatron_logging_level


def test_flag_then_environment_then_info() -> None:
    env = {"MEGATRON_LOGGING_LEVEL": "30"}
    assert megatron_logging_level(["--num-layers", "2"], {}) == logging.INFO
    assert megatron_logging_level([], env) == 30
    assert megatron_logging_level(["--logging-level", "10"], env) == 10  # Megatron's order
    assert megatron_logging_level(["--logging-level=40"], {}) == 40


def test_a_level_megatron_could_not_read_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^MEGATRON_LOGGING_LEVEL: .*got 'WARNING'"):
        megatron_logging_level([], {"MEGATRON_LOGGING_LEVEL": "WARNING"})
    with pytest.raises(ConfigError, match=r"^--logging-level: .*got 'x'"):
        megatron_logging_level(["--logging-level", "x"], {})
