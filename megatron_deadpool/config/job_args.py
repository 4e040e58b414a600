"""The job's command line: `--config`, layout and schedule flags, every `--deadpool-*` flag.

Shared by `deadpool train` and the embedded job's worker processes, so one command line means
the same job everywhere. Precedence: `JobConfig` defaults < `--config` YAML < explicit flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..errors import ConfigError
from .deadpool import DeadpoolConfig
from .flags import add_flags, dest_name
from .job import JobConfig, ModelConfig, ParallelConfig, TrainConfig, load_job

_TRAIN_FLAGS = {  # flag dest -> (section, field)
    "tp": ("parallel", "tp"),
    "pp": ("parallel", "pp"),
    "dp": ("parallel", "dp"),
    "iters": ("train", "iters"),
    "seed": ("train", "seed"),
    "num_microbatches": ("train", "num_microbatches"),
    "micro_batch_size": ("train", "micro_batch_size"),
    "lr": ("train", "lr"),
    "save": ("train", "save"),
    "save_interval": ("train", "save_interval"),
    "load": ("train", "load"),
    "num_layers": ("model", "num_layers"),
    "hidden_size": ("model", "hidden_size"),
    "num_attention_heads": ("model", "num_attention_heads"),
    "seq_length": ("model", "seq_length"),
    "num_experts": ("model", "num_experts"),
    "moe_router_topk": ("model", "moe_router_topk"),
    "ep": ("parallel", "ep"),
    "etp": ("parallel", "etp"),
}


def add_job_flags(parser: argparse.ArgumentParser) -> None:
    """--config, the layout/schedule flags and every --deadpool-* flag (shared with the worker
    and the coordinator, so one command line means the same job everywhere)."""
    parser.add_argument("--config", help="YAML job config (configs/cpu-demo.yaml, ...)")
    g = parser.add_argument_group("layout and schedule")
    types = {"lr": float, "save": str, "load": str}
    for dest in _TRAIN_FLAGS:
        g.add_argument(f"--{dest.replace('_', '-')}", dest=dest, type=types.get(dest, int))
    d = parser.add_argument_group("DeadPool (--deadpool-* flags; --spares/--ranks-per-node/--fail)")
    add_flags(
        d,
        DeadpoolConfig,
        prefix="deadpool",
        aliases={
            "spares": ["--spare-ranks", "--spares"],
            # torchrun's spellings: processes per node, a node a failure domain
            "ranks_per_node": ["--ranks-per-node", "--nproc-per-node", "--nproc_per_node"],
            "fail": ["--fail"],
        },
        defaults={f.name: None for f in dataclasses.fields(DeadpoolConfig)},
    )


def job_from_args(args: argparse.Namespace) -> JobConfig:
    """Defaults < --config YAML < explicit flags; validated as one JobConfig."""
    base = load_job(args.config) if args.config else JobConfig()
    sections: dict[str, dict[str, Any]] = {
        "model": dataclasses.asdict(base.model),
        "parallel": dataclasses.asdict(base.parallel),
        "train": dataclasses.asdict(base.train),
        "deadpool": dataclasses.asdict(base.deadpool),
    }
    for dest, (section, name) in _TRAIN_FLAGS.items():
        if getattr(args, dest) is not None:
            sections[section][name] = getattr(args, dest)
    for f in dataclasses.fields(DeadpoolConfig):
        value = getattr(args, dest_name("deadpool", f.name))
        if value is not None:
            sections["deadpool"][f.name] = value
    if not sections["deadpool"]["enabled"]:
        sections["deadpool"]["spares"] = 0
    job = JobConfig(
        model=ModelConfig(**sections["model"]),
        parallel=ParallelConfig(**sections["parallel"]),
        train=TrainConfig(**sections["train"]),
        deadpool=DeadpoolConfig(**sections["deadpool"]),
    )
    if job.model.num_experts is not None and job.parallel.tp > 1:
        raise ConfigError(
            f"model.num_experts ({job.model.num_experts}) with parallel.tp {job.parallel.tp}: "
            "Megatron-Core's MoE layers with tensor parallelism need sequence parallelism, "
            "which the embedded job does not use; train the MoE model at tp 1 (--tp 1, with "
            "--etp to split the experts)"
        )
    return job
