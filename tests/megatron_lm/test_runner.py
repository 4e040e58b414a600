"""The `--deadpool` flags in Megatron's parser, `preparse` and `wrap_pretrain` (runner.py)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

import pytest

from megatron_deadpool.config.deadpool import DeadpoolConfig
from megatron_deadpool.config.flags import field_docs, flag_name, from_namespace
from megatron_deadpool.errors import ConfigError
from megatron_deadpool.megatron_lm import extra_args_provider, preparse, wrap_pretrain


def test_flags_chain_the_scripts_provider_and_cover_every_field() -> None:
    def user(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--my-flag", type=int, default=0)
        return parser

    provider = extra_args_provider(user)
    assert extra_args_provider(provider) is provider  # chained once, never twice
    parser = provider(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(
        shlex.split(
            "--my-flag 3 --deadpool --deadpool-spares 2 --deadpool-replicas 1 "
            "--deadpool-ranks-per-node 2 --deadpool-heartbeat-interval 0.5 "
            "--deadpool-heartbeat-timeout 5 --deadpool-coordinator node7:29400 "
            "--deadpool-fail 2@5 --deadpool-fail node:1@3:hang --deadpool-log-dir /tmp/x"
        )
    )
    assert args.my_flag == 3
    cfg = from_namespace(DeadpoolConfig, args, prefix="deadpool")
    assert cfg.enabled and cfg.spares == 2 and cfg.ranks_per_node == 2
    assert cfg.coordinator == "node7:29400" and cfg.fail == ["2@5", "node:1@3:hang"]
    helps = {opt: a.help for a in parser._actions for opt in a.option_strings}
    for field in dataclasses.fields(DeadpoolConfig):
        name = flag_name("deadpool", field.name)
        assert name in helps, name
        assert helps[name] == field_docs(DeadpoolConfig)[field.name]


def test_no_provider_gives_just_the_deadpool_flags() -> None:
    parser = extra_args_provider(None)(argparse.ArgumentParser(allow_abbrev=False))
    assert parser.parse_args([]).deadpool_enabled is False


def test_preparse_reads_deadpool_flags_among_megatrons() -> None:
    argv = "--tensor-model-parallel-size 2 --save /ckpt --deadpool --deadpool-ranks-per-node 2"
    cfg = preparse(argv.split())
    assert cfg.enabled and cfg.ranks_per_node == 2 and cfg.spares == 0
    assert not preparse(["--num-layers", "2"]).enabled
    with pytest.raises(ConfigError, match="heartbeat-timeout"):
        preparse(["--deadpool", "--deadpool-heartbeat-timeout", "1"])
    with pytest.raises(ConfigError, match="RANK@ITER"):
        preparse(["--deadpool", "--deadpool-fail", "two@five"])


def test_wrap_pretrain_chains_flags_and_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEADPOOL_DEVICE", "cuda")  # no CPU mode in the test process
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "2"])
    seen = {}

    def pretrain(train_valid_test_dataset_provider, model_provider, model_type,
                 forward_step_func, process_non_loss_data_func=None, extra_args_provider=None,
                 args_defaults={}, store=None):  # noqa: B006  # fmt: skip
        seen["provider"] = extra_args_provider
        return "done"

    def user(parser):
        parser.add_argument("--user-flag")
        return parser

    wrapped = wrap_pretrain(pretrain)
    assert wrap_pretrain(wrapped) is wrapped
    assert wrapped(1, 2, 3, 4, extra_args_provider=user) == "done"
    parser = seen["provider"](argparse.ArgumentParser(allow_abbrev=False))
    assert {"--user-flag", "--deadpool", "--deadpool-spares"} <= set(parser._option_string_actions)


def test_core_v0_19_parses_the_arguments_before_pretrain(monkeypatch: pytest.MonkeyPatch) -> None:
    """core_v0.19.0's script calls `parse_and_validate_args(extra_args_provider=...)` itself and
    hands `pretrain` a config container (no `extra_args_provider` there): the flags are
    chained into the former, `pretrain` is called as given."""
    from megatron_deadpool.megatron_lm.runner import wrap_parse_and_validate_args

    monkeypatch.setenv("DEADPOOL_DEVICE", "cuda")  # no CPU mode in the test process
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "2"])
    seen = {}

    def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False,
                                args_defaults={}):  # noqa: B006  # fmt: skip
        seen["provider"] = extra_args_provider
        return "args"

    def pretrain(cfg_container, train_valid_test_dataset_provider, model_type,
                 forward_step_func, model_provider=None, store=None):  # fmt: skip
        seen["pretrain"] = (cfg_container, store)
        return "done"

    def user(parser):
        parser.add_argument("--user-flag")
        return parser

    parse = wrap_parse_and_validate_args(parse_and_validate_args)
    assert wrap_parse_and_validate_args(parse) is parse
    assert parse(extra_args_provider=user, args_defaults={"x": 1}) == "args"
    parser = seen["provider"](argparse.ArgumentParser(allow_abbrev=False))
    assert {"--user-flag", "--deadpool", "--deadpool-spares"} <= set(parser._option_string_actions)
    assert wrap_pretrain(pretrain)("config", 1, 2, 3, store=None) == "done"
    assert seen["pretrain"] == ("config", None)
