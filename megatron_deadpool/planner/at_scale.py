"""Recovery at the scale users run (512, 1,024, 16,384 GPUs): every term with its source.

`recovery_at_scale(report, sizes)` keeps the plan's model, tp, pp, cluster and batch per
data-parallel replica, scales dp to each size and breaks one node's failure into the terms of a
DeadPool recovery, each carrying where its figure comes from (`Term.kind`):

- ``configured``: a DeadPool setting (detection: the heartbeat interval; a hang: the timeout);
- ``measured here``: measured on this project's CPU machine by the command named (agreement:
  `deadpool bench control-plane`, `measured.py`);
- ``cited``: a published figure, with its paper, issue or pull request (communicator repair:
  NeMo-RL's measured `ncclCommShrink`; rebuild: NCCL's communicator init);
- ``computed``: arithmetic on the cluster file's published figures and the model (the shard
  transfer at the fabric's bandwidth; the failed iteration at the plan's MFU);
- ``assumed``: a figure nobody has measured or published; printed as such.

Side by side: TrainMover's ~20 s at 1,024 GPUs, the DeadPool paper's < 40 s at 512 A100s and
a whole-job restart (Meta's FT-HSDP: a 10-minute stall per failure at ~100K GPUs). The target
is <= 10 s at 1,024 GPUs; `ScaleRecovery.verdict` says which terms miss it.
Pure: no torch, no communication.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..config.cluster import GB
from ..errors import ConfigError
from . import measured
from .capacity import PlanReport, RecoveryModel, plan

SIZES = (512, 1024, 16384)
"""GPU counts of the table (the DeadPool paper's 512, TrainMover's 1,024, Llama 3's 16,384)."""
TARGET_GPUS = 1024
TARGET_S = 10.0
KINDS = ("configured", "measured here", "cited", "computed", "assumed")

SHRINK_S = {32: 1.38, 1024: 2.03}
"""GPUs -> seconds of one `ncclCommShrink`, NeMo-RL PR #3186 (NVIDIA-NeMo/RL): 1.38 s at 32 GPUs
to 2.03 s at 1,024 (ANCHORS.md)."""
SHRINK_SOURCE = "NeMo-RL PR #3186: ncclCommShrink 1.38 s at 32 GPUs .. 2.03 s at 1,024"
NCCL_INIT_S = 55.0
NCCL_INIT_SOURCE = "NVIDIA/nccl#1646: 55 s to initialize communicators on a DGX B200"
BUILD_S_PER_B_PARAMS = 5.0
"""Seconds a newcomer's start-up takes per billion parameters on its GPU: Megatron-LM's model
(`get_model`), DDP buffers and optimizer built again for the slot it takes. Assumed: nothing
published times it per parameter; it brackets two published logs (`BUILD_SOURCE`)."""
BUILD_SOURCE = (
    "NVIDIA/Megatron-LM PR #6750: get_model 55-60 s for MoE pipeline chunks of several billion "
    "parameters each; NVIDIA/nccl#743: model-and-optimizer-setup 0.29 s for BERT (~0.3 B)"
)
PGTRANSPORT_GB_S = 12 / 5
"""torchft's PGTransport moved 12 GB in ~5 s (peer-to-peer live recovery): a cross-check of the
transfer term at an achieved, not a line-rate, bandwidth."""


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


@dataclass(frozen=True)
class Term:
    """One term of a recovery at one scale."""

    name: str
    seconds: float
    kind: str
    """One of `KINDS`: where the figure comes from."""
    source: str
    """The command, citation or arithmetic behind it."""


@dataclass(frozen=True)
class ScaleRecovery:
    """A node's failure at one scale, term by term."""

    gpus: int
    layout: str
    """tp x pp x dp."""
    restore_bytes: int
    """What the newcomer receives (bf16 weights + optimizer shard)."""
    terms: tuple[Term, ...]
    """detect, agree, newcomer builds, repair, newcomer joins, transfer, failed iteration - in
    that order."""
    rebuild: Term
    """The communicator term if groups are rebuilt (abort + full init) instead of repaired."""
    detect_node_s: float
    """Detection of a lost node or a hang (the heartbeat timeout) instead of a crash's."""

    @property
    def downtime_s(self) -> float:
        """From the failure until training runs again (all terms but the failed iteration)."""
        return sum(t.seconds for t in self.terms if t.name != "failed iteration")

    @property
    def recover_s(self) -> float:
        """From the failure's detection until training runs again (all terms but detect and
        the failed iteration): what the goodput model charges a recovery."""
        return sum(t.seconds for t in self.terms if t.name not in ("detect", "failed iteration"))

    @property
    def total_s(self) -> float:
        """Until the failed iteration has been computed again."""
        return sum(t.seconds for t in self.terms)

    @property
    def rebuild_total_s(self) -> float:
        """`total_s` with the groups rebuilt instead of repaired."""
        repair = sum(
            t.seconds for t in self.terms if t.name in ("repair communicators", "newcomer joins")
        )
        return self.total_s - repair + self.rebuild.seconds

    def term(self, name: str) -> Term:
        """The term called `name`."""
        return next(t for t in self.terms if t.name == name)

    def verdict(self, target_s: float = TARGET_S) -> str:
        """Whether the total meets `target_s`, and if not which terms make it miss."""
        if self.total_s <= target_s:
            return f"meets the {target_s:g} s target at {self.gpus:,} GPUs ({self.total_s:.1f} s)"
        ranked = sorted(self.terms, key=lambda t: -t.seconds)
        over = self.total_s - target_s
        culprits = []
        for t in ranked:
            culprits.append(f"{t.name} {t.seconds:.1f} s ({t.kind})")
            over -= t.seconds
            if over <= 0:
                break
        return (
            f"misses the {target_s:g} s target at {self.gpus:,} GPUs: {self.total_s:.1f} s; "
            f"without {' and '.join(culprits)} it would meet it"
        )


def shrink_s(gpus: int) -> tuple[float, bool]:
    """One communicator shrink at `gpus` (log2 interpolation of `SHRINK_S`) and whether the size
    lies outside the measured range (extrapolated, or the smallest's figure below it)."""
    (lo_n, lo_s), (hi_n, hi_s) = sorted(SHRINK_S.items())
    per_doubling = (hi_s - lo_s) / (math.log2(hi_n) - math.log2(lo_n))
    seconds = lo_s + per_doubling * (math.log2(max(gpus, lo_n)) - math.log2(lo_n))
    return seconds, not lo_n <= gpus <= hi_n


def scale_terms(
    report: PlanReport,
    gpus: int,
    *,
    detect_s: float,
    detect_node_s: float,
    network_efficiency: float,
) -> ScaleRecovery:
    """The terms of a node failure for `report`'s job (already planned at `gpus`)."""
    agree = measured.agree_s(gpus)
    sizes = ", ".join(f"{n:,}" for n in sorted(measured.AGREE_S))
    shrink, outside = shrink_s(gpus)
    c = report.cluster
    bandwidth = c.inter_node_gb_s_per_gpu * network_efficiency
    transfer = report.recovery.restore_bytes / (bandwidth * GB)
    it = report.per_iteration.compute_s
    params_b = report.per_gpu.params / 1e9
    terms = (
        Term(
            "detect",
            detect_s,
            "configured",
            f"--deadpool-heartbeat-interval {detect_s:g} s: a crash is known within one beat "
            "(a hang: --deadpool-heartbeat-timeout)",
        ),
        Term(
            "agree",
            agree,
            "measured here",
            f"`{measured.COMMAND}`, 2026-11-27, 2-core CPU, at {sizes} ranks (log2 in "
            "between, the smallest's below): an upper bound",
        ),
        Term(
            "newcomer builds",
            params_b * BUILD_S_PER_B_PARAMS,
            "assumed",
            f"{params_b:.2f} B parameters on its GPU x {BUILD_S_PER_B_PARAMS:g} s per billion: "
            "Megatron-LM's start-up for its slot, after the agreement (the embedded job's starts "
            f"at the plan: sooner by the agreement); bracketed by {BUILD_SOURCE}",
        ),
        Term(
            "repair communicators",
            shrink,
            "cited" if not outside else "assumed",
            f"{SHRINK_SOURCE} (log2 in between; past that range extrapolated: assumed); "
            "Megatron's groups repaired together (assumed); DeadPool repairs gloo groups in "
            "place, not NCCL's yet: a GPU job pays the rebuild line below today",
        ),
        Term(
            "newcomer joins",
            shrink,
            "assumed",
            "ncclCommGrow (NCCL 2.29.2) has no published timing: assumed to cost one shrink",
        ),
        Term(
            "transfer shard",
            transfer,
            "computed",
            f"{report.recovery.restore_bytes / GB:.2f} GB (bf16 weights + optimizer shard) at "
            f"{c.inter_node_gb_s_per_gpu:g} GB/s per GPU ({c.site} cluster file) x "
            f"{network_efficiency:g} efficiency; at torchft PGTransport's achieved 2.4 GB/s "
            f"(12 GB in ~5 s): {report.recovery.restore_bytes / (PGTRANSPORT_GB_S * GB):.1f} s",
        ),
        Term(
            "failed iteration",
            it,
            "computed",
            f"one iteration recomputed at most (mean: half): 6 x {report.active_params / 1e9:.1f}"
            f" B params x {report.per_iteration.tokens:,} tokens at {report.workload.mfu:.0%} "
            f"MFU of {c.gpu_tflops:g} TFLOP/s",
        ),
    )
    rebuild = Term(
        "rebuild communicators",
        NCCL_INIT_S,
        "cited",
        f"{NCCL_INIT_SOURCE} (abort + full init, what a rebuild pays: DeadPool's way with "
        "NCCL groups today)",
    )
    lay = report.layout
    return ScaleRecovery(
        gpus=gpus,
        layout=f"tp {lay.tp} x pp {lay.pp} x dp {lay.dp}",
        restore_bytes=report.recovery.restore_bytes,
        terms=terms,
        rebuild=rebuild,
        detect_node_s=detect_node_s,
    )


def recovery_at_scale(
    report: PlanReport,
    sizes: tuple[int, ...] = SIZES,
    *,
    network_efficiency: float = RecoveryModel().network_efficiency,
) -> tuple[list[ScaleRecovery], list[str]]:
    """`report`'s job at each of `sizes` GPUs (dp scaled, batch per replica kept) and the sizes
    it cannot take, with why (tp x pp does not divide them, or the plan refuses them)."""
    lay, w = report.layout, report.workload
    per_replica = w.global_batch_size // lay.dp
    out: list[ScaleRecovery] = []
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
            )
        except ConfigError as exc:
            skipped.append(f"{gpus:,} GPUs: {exc}")
            continue
        out.append(
            scale_terms(
                at,
                gpus,
                detect_s=report.recovery.detect_s,
                detect_node_s=report.recovery_hang.detect_s,
                network_efficiency=network_efficiency,
            )
        )
    return out, skipped
