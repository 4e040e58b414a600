"""DeadPool's state where Megatron-LM users look: log lines in Megatron's format and scalars
through Megatron's own TensorBoard / W&B writers.

Megatron prints its iteration lines on the last rank and writes TensorBoard there, so
DeadPool's lines and scalars come from the last rank too:

     [2026-01-01 12:00:00.000000] deadpool | iteration        5/       8 | committed replica iteration: 4 | replica bytes per iteration: 1.1 MiB | replication time (ms): 2.1 |
     [2026-01-01 12:00:03.000000] deadpool | recovered | generation: 1 | dead ranks: [2] | restored iteration: 4 | recomputed iterations: 0 | recovery time (s): 2.81 | release: 0.01 | agree: 0.95 | join: 1.60 | restore: 0.25 |
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import torch.distributed as dist

from ..hotswap.protocol.messages import JobStatus
from ..hotswap.report.replica_deficit import replicated_again
from ..hotswap.worker.adapter import RecoveryRecord
from ..units import human_bytes


def megatron_line(*fields: str) -> str:
    """' [timestamp] deadpool | a | b |' - the shape of Megatron's training_log lines."""
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
    return f" [{stamp}] deadpool | " + " | ".join(fields) + " |"


def is_last_rank() -> bool:
    return dist.is_initialized() and dist.get_rank() == dist.get_world_size() - 1


def print_last(*fields: str) -> None:
    """Print one Megatron-style line on the last rank (where Megatron prints iterations)."""
    if is_last_rank():
        print(megatron_line(*fields), flush=True)


def replication_fields(
    iteration: int, total: int, committed: int | None, nbytes: int, seconds: float
) -> list[str]:
    committed_text = str(committed) if committed is not None else "none yet"
    return [
        f"iteration {iteration:8d}/{total:8d}",
        f"committed replica iteration: {committed_text}",
        f"replica bytes per iteration: {human_bytes(nbytes)}",
        f"replication time (ms): {seconds * 1000:.1f}",
    ]


def recovery_fields(record: RecoveryRecord) -> list[str]:
    fields = [
        "recovered",
        f"generation: {record.generation}",
        f"dead ranks: {record.dead}",
        f"restored iteration: {record.restore_iteration}",
        f"recomputed iterations: {record.recomputed}",
        f"recovery time (s): {record.total_s:.2f}",
    ]
    fields += [f"{k}: {v:.2f}" for k, v in record.phases_s.items()]
    return fields


def status_scalars(
    status: JobStatus | None, generation: int = 0, committed: int | None = None
) -> dict[str, float]:
    """The coordinator's view of the job's redundancy as scalars (none before it published
    one): spares available, recoveries and in-place respawns so far, the shards short of
    replicas - 0 once this rank, in `generation` and with `committed` its committed iteration,
    committed a round after the last recovery's restore iteration -, standby coordinators
    configured and reachable."""
    if status is None:
        return {}
    short = status.under_replicated
    if replicated_again(generation, committed, status.agreed_generation, status.restore_iteration):
        short = 0
    return {
        "spares-available": float(status.spares_available),
        "respawns": float(status.respawns),
        "under-replicated-shards": float(short),
        "standbys": float(status.standbys),
        "standbys-reachable": float(status.standbys_reachable),
    }


SCALARS: dict[str, str] = {
    "committed-iteration": "newest iteration every holder committed a replica of (-1: none yet)",
    "replica-bytes-per-iteration": "bytes of replicas this rank sent in the iteration",
    "replication-time-ms": "host time the iteration's replication round took, in ms",
    "generation": "generation of the job's process groups (+1 per recovery)",
    "recoveries": "recoveries completed since the job started",
    "last-recovery-s": "wall time of the last recovery, in seconds",
    "last-recovery-{phase}-s": "wall time of each phase of the last recovery (release, agree, "
    "join, restore, ...), in seconds",
    "spares-available": "spare processes waiting to take a failed rank's slot (the coordinator's "
    "count)",
    "respawns": "failed processes replaced in place on their own node so far",
    "under-replicated-shards": "optimizer shards fewer than deadpool-replicas ranks hold a "
    "committed copy of: those a failure took copies of, until the next committed round",
    "standbys": "standby coordinators configured",
    "standbys-reachable": "standby coordinators the primary reached at its last check",
}
"""Every scalar DeadPool writes as `deadpool/<name>` (Megatron-LM, last rank, every
`--tensorboard-log-interval` iterations): name -> meaning; the reference page is generated
from it and `write_scalars` writes no other name."""


def documented_scalar(name: str) -> bool:
    """Whether `name` is one of `SCALARS` (a `{phase}` matches any phase's name)."""
    if name in SCALARS:
        return True
    return name.startswith("last-recovery-") and name.endswith("-s") and name != "last-recovery-s"


def write_scalars(iteration: int, scalars: dict[str, float]) -> None:
    """Write `deadpool/<name>` scalars through Megatron's TensorBoard and W&B writers."""
    from megatron.training import get_tensorboard_writer, get_wandb_writer

    undocumented = [name for name in scalars if not documented_scalar(name)]
    assert not undocumented, f"scalars missing from report.SCALARS: {undocumented}"

    writer = get_tensorboard_writer()
    wandb_writer = get_wandb_writer()
    for name, value in scalars.items():
        if writer:
            writer.add_scalar(f"deadpool/{name}", value, iteration)
    if wandb_writer:
        wandb_writer.log({f"deadpool/{k}": v for k, v in scalars.items()}, iteration)


def dump_log_state(total_loss_dict: dict[str, Any] | None) -> dict[str, Any] | None:
    """Megatron's `training_log` running sums (tensors and counts) as JSON-safe data."""
    if total_loss_dict is None:
        return None
    out: dict[str, Any] = {}
    for key, value in total_loss_dict.items():
        if hasattr(value, "tolist"):
            out[key] = {"tensor": value.detach().cpu().tolist(), "dtype": str(value.dtype)}
        else:
            out[key] = value
    return out


def load_log_state(total_loss_dict: dict[str, Any], state: dict[str, Any]) -> None:
    """Fill `total_loss_dict` (in place: it is Megatron's own object) from `dump_log_state`."""
    import torch

    total_loss_dict.clear()
    for key, value in state.items():
        if isinstance(value, dict) and "tensor" in value:
            dtype = getattr(torch, value["dtype"].removeprefix("torch."))
            total_loss_dict[key] = torch.tensor(value["tensor"], dtype=dtype, device="cuda")
        else:
            total_loss_dict[key] = value


ITERATION_COUNTS = ("advanced iterations", "skipped iterations", "nan iterations")
"""`training_log`'s counters among its running sums (its other keys are loss sums)."""


def reset_log_sums(total_loss_dict: dict[str, Any]) -> None:
    """What Megatron's `training_log` does to its running sums once it logged an interval
    (every supported tag): each loss sum back to a zero float32 tensor of one element (on the
    sum's own device), each count to 0."""
    import torch

    for key, value in total_loss_dict.items():
        if key in ITERATION_COUNTS:
            total_loss_dict[key] = 0
        else:
            total_loss_dict[key] = torch.zeros(1, dtype=torch.float, device=value.device)
