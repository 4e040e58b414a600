"""Configuration: `DeadpoolConfig` validation, generated flags, the YAML job schema, fault specs.

Every bad value must raise `ConfigError` (a `ValueError`) whose message starts with or names the
field, so the CLI can print it as one line; every `DeadpoolConfig` field must have a
`--deadpool-*` flag whose help is the docstring under the field; a job survives a YAML round
trip unchanged; unknown keys and wrong types in YAML are refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from megatron_deadpool.cli import train as train_cli
from megatron_deadpool.config import job_args
from megatron_deadpool.config.cluster import ClusterConfig
from megatron_deadpool.config.deadpool import DeadpoolConfig, parse_host_port
from megatron_deadpool.config.faults import FaultSpec, check_faults, parse_fault
from megatron_deadpool.config.flags import add_flags, field_docs, flag_name, from_namespace
from megatron_deadpool.config.job import (
    JobConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    job_from_mapping,
    load_job,
)
from megatron_deadpool.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------- DeadpoolConfig
@pytest.mark.parametrize(
    "changes,field",
    [
        ({"spares": -1}, "deadpool-spare-ranks"),
        ({"spares": "2"}, "deadpool-spare-ranks"),
        ({"spares": True}, "deadpool-spare-ranks"),
        ({"replicas": 0}, "replicas"),
        ({"replicas": 1.0}, "replicas"),
        ({"replica_device": "tpu"}, "deadpool-replica-device"),
        ({"ranks_per_node": 0}, "ranks-per-node"),
        ({"heartbeat_interval": 0}, "deadpool-heartbeat-interval"),
        ({"heartbeat_interval": "1"}, "deadpool-heartbeat-interval"),
        ({"heartbeat_timeout": -3.0}, "deadpool-heartbeat-timeout"),
        ({"pg_timeout": True}, "deadpool-pg-timeout"),
        ({"heartbeat_interval": 5.0, "heartbeat_timeout": 10.0}, "deadpool-heartbeat-timeout"),
        ({"heartbeat_timeout": 10.0, "pg_timeout": 10.0}, "deadpool-pg-timeout"),
        ({"join_timeout": float("nan")}, "deadpool-join-timeout"),
        ({"heartbeat_timeout": 10.0, "join_timeout": 10.0}, "deadpool-join-timeout"),
        ({"coordinator": "nohost"}, "deadpool-coordinator"),
        ({"coordinator": "host:0"}, "deadpool-coordinator"),
        ({"coordinator": "host:65536"}, "deadpool-coordinator"),
        ({"coordinator": ":29500"}, "deadpool-coordinator"),
        ({"coordinator": "a:1,"}, "deadpool-coordinator (entry 2 of 2)"),
        ({"coordinator": "a:1,b"}, "deadpool-coordinator (entry 2 of 2)"),
        ({"coordinator": "a:1,b:2,a:1"}, "deadpool-coordinator (entry 3 of 3)"),
        ({"coordinator": "a:1,b:2", "connect_timeout": 15.0}, "deadpool-connect-timeout"),
        ({"fail": ["2@x"]}, "fail"),
        ({"fail": ["1@2", "2@0"]}, "fail"),
    ],
)
def test_bad_deadpool_values_name_their_flag(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        DeadpoolConfig(**changes)
    message = str(info.value)
    assert message.startswith(field), message
    assert "\n" not in message
    # ... and `replace` validates the same way.
    with pytest.raises(ConfigError):
        DeadpoolConfig().replace(**changes)


def test_config_errors_are_value_errors_and_defaults_are_valid() -> None:
    assert issubclass(ConfigError, ValueError)
    cfg = DeadpoolConfig()
    assert cfg.enabled is False and cfg.replicas == 1 and cfg.spares == 0
    ok = cfg.replace(enabled=True, spares=2, coordinator="node-7:29500", fail=["node:1@4:hang"])
    assert ok.coordinator == "node-7:29500" and ok.fail == ["node:1@4:hang"]
    assert cfg.fail == []  # the default list is not shared
    assert ok.coordinators == ["node-7:29500"] and cfg.coordinators == []
    listed = cfg.replace(coordinator="node-1:29400, node-9:29400")  # the primary, a standby
    assert listed.coordinators == ["node-1:29400", "node-9:29400"]


def test_host_port_parsing() -> None:
    assert parse_host_port("10.0.0.3:29500", "x") == ("10.0.0.3", 29500)
    assert parse_host_port("[::1]:80", "x") == ("::1", 80)
    assert parse_host_port("localhost:29500", "x", resolve=True) == ("localhost", 29500)
    with pytest.raises(ConfigError, match="^deadpool-coordinator: host 'no-such-host.invalid'"):
        parse_host_port("no-such-host.invalid:1", "deadpool-coordinator", resolve=True)


# ---------------------------------------------------------------------- generated flags
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_flags(parser, DeadpoolConfig, prefix="deadpool")
    return parser


def test_every_field_has_a_deadpool_flag_with_its_docstring_as_help() -> None:
    parser = _parser()
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    docs = field_docs(DeadpoolConfig)
    for f in dataclasses.fields(DeadpoolConfig):
        flag = flag_name("deadpool", f.name)
        assert flag.startswith("--deadpool"), flag
        assert flag in actions, f"no flag for DeadpoolConfig.{f.name}"
        help_text = actions[flag].help
        assert help_text and len(help_text) > 15, f"{flag} has no help"
        assert help_text == docs[f.name]
    assert "--deadpool" in actions and "--no-deadpool" in actions


def test_flags_parse_back_into_the_dataclass() -> None:
    argv = [
        "--deadpool",
        "--deadpool-spares", "2",
        "--deadpool-replicas", "2",
        "--deadpool-replica-device", "cpu",
        "--deadpool-ranks-per-node", "4",
        "--deadpool-heartbeat-interval", "0.5",
        "--deadpool-heartbeat-timeout", "3",
        "--deadpool-pg-timeout", "30",
        "--deadpool-coordinator", "127.0.0.1:29500",
        "--deadpool-fail", "1@2",
        "--deadpool-fail", "node:0@3:hang",
        "--deadpool-log-dir", "/tmp/x",
        "--deadpool-job-token", "abc",
    ]  # fmt: skip
    cfg = from_namespace(DeadpoolConfig, _parser().parse_args(argv), prefix="deadpool")
    assert cfg == DeadpoolConfig(
        enabled=True,
        spares=2,
        replicas=2,
        replica_device="cpu",
        ranks_per_node=4,
        heartbeat_interval=0.5,
        heartbeat_timeout=3.0,
        pg_timeout=30.0,
        coordinator="127.0.0.1:29500",
        fail=["1@2", "node:0@3:hang"],
        log_dir="/tmp/x",
        job_token="abc",
    )
    assert from_namespace(DeadpoolConfig, _parser().parse_args([]), prefix="deadpool") == (
        DeadpoolConfig()
    )
    off = from_namespace(DeadpoolConfig, _parser().parse_args(["--no-deadpool"]), prefix="deadpool")
    assert off.enabled is False


def test_train_cli_has_every_deadpool_flag_and_the_short_aliases() -> None:
    parser = argparse.ArgumentParser()
    train_cli.configure(parser)
    options = {opt for a in parser._actions for opt in a.option_strings}
    for f in dataclasses.fields(DeadpoolConfig):
        assert flag_name("deadpool", f.name) in options
    assert {"--spares", "--ranks-per-node", "--fail", "--tp", "--pp", "--dp"} <= options


def test_train_cli_precedence_defaults_then_yaml_then_flags(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"hidden_size": 32, "num_attention_heads": 2},
                "parallel": {"tp": 2, "dp": 2},
                "train": {"iters": 5},
                "deadpool": {"spare_ranks": 1, "ranks_per_node": 2},
            }
        )
    )
    parser = argparse.ArgumentParser()
    train_cli.configure(parser)
    job = job_args.job_from_args(
        parser.parse_args(["--config", str(config), "--tp", "1", "--dp", "4", "--fail", "1@2"])
    )
    assert (job.parallel.tp, job.parallel.dp) == (1, 4)  # flags win
    assert job.model.hidden_size == 32 and job.train.iters == 5  # from the YAML
    assert job.model.num_layers == ModelConfig().num_layers  # defaults fill the rest
    assert job.deadpool.enabled and job.deadpool.spares == 1 and job.deadpool.fail == ["1@2"]
    off = job_args.job_from_args(parser.parse_args(["--config", str(config), "--no-deadpool"]))
    assert not off.deadpool.enabled and off.deadpool.spares == 0


# ---------------------------------------------------------------------- YAML job schema
def _job() -> JobConfig:
    return JobConfig(
        model=ModelConfig(
            num_layers=4,
            hidden_size=96,
            num_attention_heads=6,
            num_query_groups=2,
            ffn_hidden_size=256,
            seq_length=32,
            vocab_size=250,
            swiglu=True,
            normalization="RMSNorm",
            add_bias_linear=False,
            position_embedding_type="rope",
        ),
        parallel=ParallelConfig(tp=2, pp=2, dp=3),
        train=TrainConfig(iters=11, micro_batch_size=1, num_microbatches=4, lr=3e-4, seed=7),
        deadpool=DeadpoolConfig(
            enabled=True,
            spares=2,
            replicas=2,
            replica_device="cpu",
            ranks_per_node=4,
            heartbeat_interval=0.25,
            heartbeat_timeout=2.0,
            pg_timeout=20.0,
            fail=["3@4:hang", "node:1@6"],
        ),
        cluster=ClusterConfig(gpus_per_node=4, modules=["cuda/12.4"], env=["NCCL_DEBUG=WARN"]),
    )


def test_yaml_round_trip_is_exact(tmp_path: Path) -> None:
    job = _job()
    text = yaml.safe_dump(job.to_dict(), sort_keys=False)
    assert job_from_mapping(yaml.safe_load(text)) == job
    path = tmp_path / "job.yaml"
    path.write_text(text)
    assert load_job(path) == job
    # Without a cluster section the job has none, and that round-trips too.
    plain = dataclasses.replace(job, cluster=None)
    assert job_from_mapping(yaml.safe_load(yaml.safe_dump(plain.to_dict()))) == plain


def test_yaml_deadpool_section_defaults_to_enabled() -> None:
    assert job_from_mapping({}).deadpool.enabled is True
    assert job_from_mapping({"deadpool": {"enabled": False}}).deadpool.enabled is False


@pytest.mark.parametrize(
    "data,message",
    [
        ({"model": {"hidden": 64}}, "config.model.hidden: unknown key"),
        ({"deadpool": {"replicaz": 1}}, "config.deadpool.replicaz: unknown key"),
        ({"bogus": {}}, "unknown section 'bogus'"),
        ({"model": {"hidden_size": "64"}}, "config.model.hidden_size: expected int"),
        ({"parallel": {"tp": True}}, "config.parallel.tp: expected int"),
        ({"train": {"lr": "fast"}}, "config.train.lr: expected float"),
        ({"deadpool": {"enabled": "yes"}}, "config.deadpool.enabled: expected bool"),
        ({"deadpool": {"spare_ranks": 1.5}}, "config.deadpool.spare_ranks: expected int"),
        ({"deadpool": {"spares": 1.5}}, "config.deadpool.spares: expected int"),
        ({"deadpool": {"spare_ranks": -1}}, "deadpool-spare-ranks: expected an integer >= 0"),
        ({"deadpool": {"spares": 1, "spare_ranks": 1}}, "'spares' is the older spelling of"),
        ({"deadpool": {"fail": "2@3"}}, "config.deadpool.fail: expected list"),
        ({"deadpool": {"fail": [3]}}, "config.deadpool.fail[0]: expected str"),
        ({"deadpool": {"replica_device": "tpu"}}, "config.deadpool.replica_device: 'tpu'"),
        ({"model": {"hidden_size": None}}, "config.model.hidden_size: must not be empty"),
        ({"model": 3}, "config.model: expected a mapping"),
        ([1, 2], "config: expected a mapping"),
        ({"parallel": {"tp": 0}}, "parallel.tp: expected an integer >= 1, got 0"),
        ({"model": {"num_layers": 3}, "parallel": {"pp": 2}}, "parallel.pp (2) must divide"),
        ({"parallel": {"tp": 3}}, "parallel.tp (3) must divide model.num_attention_heads"),
        ({"parallel": {"pp": 2}, "train": {"num_microbatches": 1}}, "train.num_microbatches"),
        ({"deadpool": {"fail": ["2@"]}}, "fail: '2@' is not"),
    ],
)
def test_bad_yaml_is_refused_naming_the_key(data: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        job_from_mapping(data)


def test_load_job_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_job(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_job(empty) == JobConfig()
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("train:\n  iterations: 3\n")
    with pytest.raises(ConfigError, match=r"^unknown\.yaml\.train\.iterations: unknown key"):
        load_job(unknown)


@pytest.mark.parametrize(
    "path",
    sorted(
        p.relative_to(REPO).as_posix()
        for p in [*REPO.glob("configs/*.yaml"), *REPO.glob("configs/models/*.yaml")]
    ),
)
def test_shipped_job_configs_load(path: str, caplog: pytest.LogCaptureFixture) -> None:
    job = load_job(REPO / path)
    assert job.parallel.world_size >= 1
    assert not caplog.records  # no deprecated key (`spares`) in what we ship


def test_spare_ranks_is_the_yaml_key_and_spares_is_read_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One word: the YAML key of spare ranks is `spare_ranks`, as --deadpool-spare-ranks; the
    older key `spares` still reads (old configs and run folders' job.yaml), with one warning
    line naming the new key; a job writes the new key."""
    new = job_from_mapping({"deadpool": {"spare_ranks": 3}})
    assert new.deadpool.spares == 3 and not caplog.records
    assert new.to_dict()["deadpool"]["spare_ranks"] == 3 and "spares" not in new.to_dict()
    assert "spares" not in new.to_dict()["deadpool"]
    with caplog.at_level(logging.WARNING):
        old = job_from_mapping({"deadpool": {"spares": 3}})
    assert old == new
    [record] = caplog.records
    text = record.getMessage()
    assert "\n" not in text and "'spares' is deprecated" in text and "'spare_ranks'" in text


def test_ranks_per_node_default_order() -> None:
    assert JobConfig(parallel=ParallelConfig(tp=2, dp=2)).ranks_per_node == 2  # TP per node
    explicit = JobConfig(deadpool=DeadpoolConfig(enabled=True, ranks_per_node=1))
    assert explicit.ranks_per_node == 1
    assert JobConfig(cluster=ClusterConfig(gpus_per_node=8)).ranks_per_node == 8
    with pytest.raises(ConfigError, match="differs from cluster.gpus_per_node"):
        JobConfig(
            cluster=ClusterConfig(gpus_per_node=8),
            deadpool=DeadpoolConfig(enabled=True, ranks_per_node=4),
        )


# ---------------------------------------------------------------------- fault specs
@pytest.mark.parametrize(
    "text,expected",
    [
        ("2@5", FaultSpec(iteration=5, kind="kill", rank=2)),
        ("2@5:kill", FaultSpec(iteration=5, kind="kill", rank=2)),
        ("0@1:hang", FaultSpec(iteration=1, kind="hang", rank=0)),
        ("node:1@4", FaultSpec(iteration=4, kind="kill", node=1)),
        ("node:3@12:hang", FaultSpec(iteration=12, kind="hang", node=3)),
        (" 7@2 ", FaultSpec(iteration=2, kind="kill", rank=7)),
        ("spare:1@3", FaultSpec(iteration=3, kind="kill", spare=1)),
        ("spare:0@recovery:hang", FaultSpec(0, "hang", spare=0, during_recovery=True)),
        ("2@4:raise", FaultSpec(iteration=4, kind="raise", rank=2)),
        ("node:1@1:raise", FaultSpec(iteration=1, kind="raise", node=1)),
        ("1@repair", FaultSpec(0, "kill", rank=1, in_repair="repair")),
        ("3@repair:hang", FaultSpec(0, "hang", rank=3, in_repair="repair")),
        ("0@handles", FaultSpec(0, "kill", rank=0, in_repair="handles")),
    ],
)
def test_fault_specs_parse(text: str, expected: FaultSpec) -> None:
    assert parse_fault(text) == expected


MALFORMED = [
    "", "2", "@5", "2@", "2@0", "x@1", "2@5:boom", "node:@1", "node:1", "-1@2", "2@5:",
    "node:1@recovery", "spare:0@recovery:flip", "spare:0@end", "spare:0@2:raise",
    "1@recovery:raise", "1@end:raise", "node:1@repair", "spare:0@repair", "1@repair:flip",
    "1@repair:raise", "node:0@handles",
]  # fmt: skip


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_fault_specs_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="^fail: "):
        parse_fault(text)


def test_fault_targets_and_range_checks() -> None:
    assert parse_fault("node:1@4").ranks(ranks_per_node=2) == [2, 3]
    assert parse_fault("3@4").ranks(ranks_per_node=2) == [3]
    assert str(parse_fault("node:1@4:hang")) == "node 1 hang at iteration 4"
    check_faults([parse_fault("3@4"), parse_fault("node:1@8")], 4, 2, 8)
    with pytest.raises(ConfigError, match="^fail: rank 4 does not exist"):
        check_faults([parse_fault("4@2")], 4, 2, 8)
    with pytest.raises(ConfigError, match="^fail: node 2 does not exist"):
        check_faults([parse_fault("node:2@2")], 4, 2, 8)
    with pytest.raises(ConfigError, match="^fail: iteration 9 is past"):
        check_faults([parse_fault("1@9")], 4, 2, 8)


def test_spare_ranks_is_the_flags_name_and_the_older_spellings_still_work() -> None:
    """One word each: spare ranks (processes, --deadpool-spare-ranks) and spare nodes
    (SPARE_NODES, --spare-nodes); --deadpool-spares and --spares still parse."""
    from megatron_deadpool.config.flags import primary_flag

    parser = _parser()
    for flag in ("--deadpool-spare-ranks", "--deadpool-spares"):
        args = parser.parse_args([flag, "3"])
        assert from_namespace(DeadpoolConfig, args, prefix="deadpool").spares == 3
    assert primary_flag(DeadpoolConfig, "deadpool", "spares") == "--deadpool-spare-ranks"
    assert primary_flag(DeadpoolConfig, "deadpool", "replicas") == "--deadpool-replicas"
    help_line = parser.format_help()
    assert "--deadpool-spare-ranks SPARES, --deadpool-spares SPARES" in help_line
