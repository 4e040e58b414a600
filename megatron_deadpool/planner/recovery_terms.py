"""A node failure's recovery, term by term, each with where its figure comes from.

`node_failure(...)` breaks one crashed rank's replacement into the terms of a DeadPool recovery
at one size (detect, survivors stop, agree, newcomer builds, repair, newcomer joins, transfer,
failed iteration); `deadpool plan`'s recovery line (`capacity.plan`) and its table at 512, 1,024 and
16,384 GPUs (`at_scale`) are both this function, so the two cannot disagree. Each term carries
its kind (`Term.kind`):

- ``configured``: a DeadPool setting (detection: the heartbeat interval; a hang: the timeout);
- ``measured here``: measured on this project's CPU machine by the command named (agreement:
  `deadpool bench control-plane`, `measured.py`);
- ``cited``: a published figure, with its paper, issue or pull request (communicator repair:
  NeMo-RL's measured `ncclCommShrink`; rebuild: NCCL's communicator init);
- ``computed``: arithmetic on the cluster file's published figures and the model (the shard
  transfer at the fabric's bandwidth; the failed iteration at the plan's MFU);
- ``assumed``: a figure nobody has measured or published; printed as such.

The terms assume the groups repaired in place; `RecoveryTerms.rebuild` is the communicator term
when they are rebuilt instead (what a GPU job pays today: DeadPool repairs gloo groups only).
Pure: no torch, no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.cluster import GB, ClusterConfig
from . import measured

KINDS = ("configured", "measured here", "cited", "computed", "assumed")
TARGET_S = 10.0
"""The recovery this project aims at, at 1,024 GPUs (`RecoveryTerms.verdict`)."""
NETWORK_EFFICIENCY = 0.8
"""Share of a GPU's NIC bandwidth a bulk transfer achieves (assumed)."""

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
RECONSTRUCT = ("newcomer builds", "repair communicators", "newcomer joins")
"""The terms between the agreement and the transfer: what `deadpool plan` calls reconstruct."""


@dataclass(frozen=True)
class Term:
    """One term of a recovery at one size."""

    name: str
    seconds: float
    kind: str
    """One of `KINDS`: where the figure comes from."""
    source: str
    """The command, citation or arithmetic behind it."""


def survivors_stop_s(iteration_s: float, detect_s: float, wake_s: float) -> float:
    """After a crash is detected (`detect_s` after it), until the last survivor has stopped
    training (worst case).

    A survivor that shares no collective with the dead rank before the data-parallel gradient
    sync computes on to the end of its iteration (`iteration_s` after the failure at most),
    unless its plan waiter stops it first (`hotswap/worker/plan_waiter.py`: it wakes `wake_s`
    after the plan, published at the detection, and its plan watch aborts its groups). A lost
    node or a hang leaves survivors blocked, no error reaching them: only the waiter stops them
    (`RecoveryTerms.stop_node_s`)."""
    return max(0.0, min(iteration_s, detect_s + wake_s) - detect_s)


@dataclass(frozen=True)
class RecoveryTerms:
    """A crashed rank's replacement at one size, term by term."""

    gpus: int
    layout: str
    """tp x pp x dp."""
    restore_bytes: int
    """What the newcomer receives (bf16 weights + optimizer shard)."""
    terms: tuple[Term, ...]
    """detect, survivors stop, agree, newcomer builds, repair, newcomer joins, transfer, failed
    iteration - in that order."""
    rebuild: Term
    """The communicator term if groups are rebuilt (abort + full init) instead of repaired."""
    detect_node_s: float
    """Detection of a lost node or a hang (the heartbeat timeout) instead of a crash's."""
    stop_node_s: float
    """Survivors stop after a lost node or a hang (their plan waiters wake) instead."""

    @property
    def node_delay_s(self) -> float:
        """What a lost node or a hang adds to a crash's recovery (detection and stop)."""
        crash = self.term("detect").seconds + self.term("survivors stop").seconds
        return self.detect_node_s + self.stop_node_s - crash

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
    def reconstruct_s(self) -> float:
        """The newcomer's build, the repair and its join (`RECONSTRUCT`)."""
        return sum(self.term(name).seconds for name in RECONSTRUCT)

    @property
    def rebuilt_reconstruct_s(self) -> float:
        """`reconstruct_s` with the groups rebuilt instead of repaired."""
        return self.term("newcomer builds").seconds + self.rebuild.seconds

    @property
    def total_s(self) -> float:
        """Until the failed iteration has been computed again."""
        return sum(t.seconds for t in self.terms)

    @property
    def rebuild_total_s(self) -> float:
        """`total_s` with the groups rebuilt instead of repaired."""
        return self.total_s - self.reconstruct_s + self.rebuilt_reconstruct_s

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


@dataclass(frozen=True, kw_only=True)
class Job:
    """What the terms need to know of a planned job (`capacity.plan` fills it)."""

    gpus: int
    """Training ranks: the size of the communicators."""
    spares: int
    """Spare ranks: the coordinator agrees over gpus + spares processes."""
    layout: str
    """tp x pp x dp, as printed."""
    params_per_gpu: int
    """Parameters on the newcomer's GPU (the largest pipeline stage's)."""
    restore_bytes: int
    """What the newcomer receives: its bf16 weights and its optimizer shard."""
    host_copy_s: float | None
    """Snapshots in host memory (they do not fit the GPU): a survivor's copy back; else None."""
    iteration_s: float
    """One iteration's compute at the plan's MFU."""
    active_params: int
    """Parameters a token is computed with."""
    flops_per_param_token: int
    """6, or 8 with full activation recompute."""
    tokens: int
    """Tokens per iteration."""
    mfu: float


def node_failure(
    job: Job, cluster: ClusterConfig, *, heartbeat_interval: float, heartbeat_timeout: float
) -> RecoveryTerms:
    """The terms of one crashed rank's replacement in `job` on `cluster`, with DeadPool's
    heartbeat (a lost node or a hang is detected after the timeout; the plan watch beats with the
    interval)."""
    beat = heartbeat_interval
    detect = measured.AGENT_DETECT_S
    ranks = job.gpus + job.spares
    sizes = ", ".join(f"{n:,}" for n in sorted(measured.AGREE_S))
    wake = measured.plan_wake_s(ranks)
    wake_sizes = ", ".join(f"{n:,}" for n in sorted(measured.PLAN_WAKE_S))
    shrink, outside = shrink_s(job.gpus)
    bandwidth = cluster.inter_node_gb_s_per_gpu * NETWORK_EFFICIENCY
    transfer = job.restore_bytes / (bandwidth * GB)
    transfer_source = (
        f"{job.restore_bytes / GB:.2f} GB (bf16 weights + optimizer shard) at "
        f"{cluster.inter_node_gb_s_per_gpu:g} GB/s per GPU ({cluster.site} cluster file) x "
        f"{NETWORK_EFFICIENCY:g} efficiency; at torchft PGTransport's achieved 2.4 GB/s "
        f"(12 GB in ~5 s): {job.restore_bytes / (PGTRANSPORT_GB_S * GB):.1f} s"
    )
    if job.host_copy_s is not None and job.host_copy_s > transfer:
        transfer = job.host_copy_s
        transfer_source += (
            f"; snapshots in host memory: a survivor's copy back at {cluster.host_device_gb_s:g}"
            " GB/s host-to-GPU takes longer"
        )
    params_b = job.params_per_gpu / 1e9
    terms = (
        Term(
            "detect",
            detect,
            "measured here",
            f"`{measured.AGENT_DETECT_COMMAND}` (a SIGKILL): the node agent reports the exit at "
            "once, the median on a 2-core CPU, 2026-11-29; a GPU process's teardown not "
            "included; without agents (DEADPOOL_RESPAWN_LIMIT=0) within one beat, "
            f"--deadpool-heartbeat-interval {beat:g} s",
        ),
        Term(
            "survivors stop",
            survivors_stop_s(job.iteration_s, detect, wake),
            "measured here",
            "worst case: a survivor with no collective to share with the dead rank before the "
            f"gradient sync computes to its iteration's end ({job.iteration_s:.2f} s), unless "
            f"its plan waiter wakes first (NCCL's abort; unverified on a GPU): "
            f"`{measured.PLAN_WAKE_COMMAND}`, "
            f"{measured.PLAN_WAKE_DATE}, 2-core CPU, the plan -> the last of {wake_sizes} "
            "survivors woken (log2 in between, the smallest's below); its read of the plan and "
            "the abort's start not included",
        ),
        Term(
            "agree",
            measured.agree_s(ranks),
            "measured here",
            f"`{measured.COMMAND}`, 2026-11-27, 2-core CPU, at {sizes} ranks (log2 in "
            f"between, the smallest's below; here {ranks:,} with the spares), without the "
            "survivors' failure reports (2-3 s more at 16,384 on a slower machine, 2026-12-01)",
        ),
        Term(
            "newcomer builds",
            params_b * BUILD_S_PER_B_PARAMS,
            "assumed",
            f"{params_b:.2f} B parameters on its GPU x {BUILD_S_PER_B_PARAMS:g} s per billion: "
            "its start-up for the slot (Megatron-LM's, or the embedded job's build), begun as the "
            "plan wakes it with the survivors' waiters, so the agreement overlaps it (not "
            f"subtracted here: an upper bound); bracketed by {BUILD_SOURCE}",
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
        Term("transfer shard", transfer, "computed", transfer_source),
        Term(
            "failed iteration",
            job.iteration_s,
            "computed",
            "one iteration recomputed at most (mean: half): "
            f"{job.flops_per_param_token} x {job.active_params / 1e9:.1f}"
            f" B params x {job.tokens:,} tokens at {job.mfu:.0%} "
            f"MFU of {cluster.gpu_tflops:g} TFLOP/s",
        ),
    )
    rebuild = Term(
        "rebuild communicators",
        NCCL_INIT_S,
        "cited",
        f"{NCCL_INIT_SOURCE} (abort + full init, what a rebuild pays: DeadPool's way with "
        "NCCL groups today)",
    )
    return RecoveryTerms(
        gpus=job.gpus,
        layout=job.layout,
        restore_bytes=job.restore_bytes,
        terms=terms,
        rebuild=rebuild,
        detect_node_s=heartbeat_timeout,
        stop_node_s=wake,
    )
