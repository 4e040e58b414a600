"""Recovery at the scale users run (512, 1,024, 16,384 GPUs): every term with its source.

`recovery_at_scale(report, sizes)` keeps the plan's model, tp, pp, cluster, DeadPool settings and
batch per data-parallel replica, scales dp to each size and plans the job there: each size's
recovery is that plan's terms (`recovery_terms.node_failure`, the same as the plan's own line).

Side by side: TrainMover's ~20 s at 1,024 GPUs, the DeadPool paper's < 40 s at 512 A100s and
a whole-job restart (Meta's FT-HSDP: a 10-minute stall per failure at ~100K GPUs). The target
is <= 10 s at 1,024 GPUs; `RecoveryTerms.verdict` says which terms miss it.
Pure: no torch, no communication.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError
from .capacity import PlanReport, plan
from .recovery_terms import RecoveryTerms

SIZES = (512, 1024, 16384)
"""GPU counts of the table (the DeadPool paper's 512, TrainMover's 1,024, Llama 3's 16,384)."""
TARGET_GPUS = 1024


@dataclass(frozen=True)
class Comparison:
    """A published recovery figure shown next to ours."""

    name: str
    gpus: int | None
    seconds: float
    source: str
    note: str = ""


COMPARISONS = (
    Comparison(
        "TrainMover (standby machines)",
        1024,
        20.0,
        "OSDI'26, arXiv 2412.12636v3: about 20 s of downtime at 1,024 GPUs",
    ),
    Comparison(
        "DeadPool paper (hot swap)",
        512,
        40.0,
        "arXiv 2607.01646: recovery under 40 s at 512 A100s",
        "an upper bound",
    ),
    Comparison(
        "whole-job restart",
        None,
        600.0,
        "Meta FT-HSDP, arXiv 2602.00277: 10-minute stall per failure with whole-job restarts "
        "(3 min restarting the failed replica only); SageMaker HyperPod: 15-30+ min for "
        "checkpoint-restart",
        "any scale",
    ),
)


def recovery_at_scale(
    report: PlanReport, sizes: tuple[int, ...] = SIZES
) -> tuple[list[RecoveryTerms], list[str]]:
    """`report`'s job at each of `sizes` GPUs (dp scaled, batch per replica kept) and the sizes
    it cannot take, with why (tp x pp does not divide them, or the plan refuses them)."""
    lay, w = report.layout, report.workload
    per_replica = w.global_batch_size // lay.dp
    out: list[RecoveryTerms] = []
    skipped: list[str] = []
    for gpus in sizes:
        if gpus % (lay.tp * lay.pp):
            skipped.append(f"{gpus:,} GPUs: not a multiple of tp x pp = {lay.tp * lay.pp}")
            continue
        dp = gpus // (lay.tp * lay.pp)
        layout = dataclasses.replace(lay, dp=dp)
        try:
            at = plan(
                report.model,
                layout,
                replicas=min(report.replicas, max(1, gpus // lay.ranks_per_node - 1)),
                spares=report.spares,
                cluster=report.cluster,
                workload=dataclasses.replace(w, global_batch_size=per_replica * dp),
                deadpool=report.deadpool,
            )
        except ConfigError as exc:
            skipped.append(f"{gpus:,} GPUs: {exc}")
            continue
        out.append(at.failure)
    return out, skipped
