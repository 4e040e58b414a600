"""The Megatron-LM options `--deadpool` refuses before training starts: one table, one check.

Each option keeps state that a hot swap could not carry over or replay (read in Megatron-LM
core_v0.16.1 and core_v0.19.0, `megatron/training/arguments.py`, `initialize.py`).

State a training step changes outside the snapshot. A snapshot holds the distributed-optimizer
shard, every buffer of the model chunks (the MoE router's ``expert_bias`` and token counters
among them), RNG states, the LR scheduler, the loss scalers of ``--fp16`` and ``--loss-scale``
and the data position (`replication/snapshot.py`, `replay.py`); not:

- ``--fp8-format`` and ``--fp4-format``: Transformer Engine keeps its scaling state (amax
  history and scales of delayed scaling) in each module's ``fp8_meta``, which is neither a
  buffer nor optimizer state (it is saved only as a module's ``_extra_state``).

A batch size that changes between steps:

- ``--rampup-batch-size``: replaying the steps after a rollback needs a constant batch size.

State inside the start-up communicators. A hot swap aborts every NCCL communicator and builds
the next generation's from scratch (`devices.abort`, `hotswap.worker.rebind`). DeadPool rebinds
every process-group handle Megatron's objects hold, but these options keep state that lives
inside the start-up communicators themselves, where no handle can be swapped:

- ``--tp-comm-overlap``: Transformer Engine's userbuffers (`initialize._initialize_tp_communicators`)
  are created once, over the start-up tensor-parallel group, with CUDA IPC handles exchanged
  between its ranks; a spare's GPU is not in them and they are never rebuilt.
- ``--cuda-graph-impl`` other than ``none`` (also the older ``--enable-cuda-graph`` and
  ``--external-cuda-graph``, which Megatron turns into it): captured graphs replay the kernels
  they were captured with, NCCL kernels of communicators a recovery aborts included.
- ``--use-nccl-ub``: gradient and parameter buffers registered with NCCL (user-buffer
  registration) stay registered with the start-up communicators only.

Each is refused before training starts, one line each, naming the option and what to do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

UNSNAPSHOTTED = "state a step changes outside the snapshot"
REPLAY = "a batch size that changes between steps"
STARTUP_BOUND = "state inside the start-up communicators"


def _given(name: str) -> Callable[[Any], object]:
    """The value of Megatron's argument `name` (None where this release has no such option)."""
    return lambda args: getattr(args, name, None)


def _cuda_graphs(args: Any) -> object:
    """The CUDA graph implementation `args` ask for, the older flags included (as Megatron
    turns them into ``--cuda-graph-impl``); None where none is asked for."""
    graphs = getattr(args, "cuda_graph_impl", None)
    if getattr(args, "enable_cuda_graph", False):
        graphs = "local"
    elif getattr(args, "external_cuda_graph", False):
        graphs = "transformer_engine"
    return None if graphs in (None, "none") else graphs


@dataclass(frozen=True)
class Refusal:
    """One refused option."""

    name: str
    """Megatron's argument name."""
    reason: str
    """Why it is refused (one of the module's reason constants)."""
    message: str
    """The refusal, one line: the option, why, what to do; ``{value}`` stands for the value."""
    value: Callable[[Any], object]
    """The offending value in Megatron's parsed args; falsy where the option is not in use."""


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "fp8",
        UNSNAPSHOTTED,
        "--fp8-format: Transformer Engine's FP8 scaling state (amax history, scales) lives "
        "outside the optimizer and the model's buffers and is not replicated; train without "
        "FP8 (--bf16) to use --deadpool",
        _given("fp8"),
    ),
    Refusal(
        "fp4",
        UNSNAPSHOTTED,
        "--fp4-format: Transformer Engine's FP4 scaling state lives outside the optimizer and "
        "the model's buffers and is not replicated; train without FP4 (--bf16) to use "
        "--deadpool",
        _given("fp4"),
    ),
    Refusal(
        "rampup_batch_size",
        REPLAY,
        "--rampup-batch-size: replaying steps needs a constant batch size",
        _given("rampup_batch_size"),
    ),
    Refusal(
        "tp_comm_overlap",
        STARTUP_BOUND,
        "--tp-comm-overlap: Transformer Engine's userbuffers are set up once over the start-up "
        "tensor-parallel group (CUDA IPC handles) and are not rebuilt when a spare replaces a "
        "rank; drop --tp-comm-overlap to train with --deadpool",
        _given("tp_comm_overlap"),
    ),
    Refusal(
        "cuda_graph_impl",
        STARTUP_BOUND,
        "--cuda-graph-impl={value}: captured CUDA graphs replay kernels of the communicators "
        "they were captured with, which a recovery aborts; use --cuda-graph-impl none with "
        "--deadpool",
        _cuda_graphs,
    ),
    Refusal(
        "nccl_ub",
        STARTUP_BOUND,
        "--use-nccl-ub: buffers registered with NCCL stay registered with the start-up "
        "communicators only, which a recovery aborts; drop --use-nccl-ub to train with "
        "--deadpool",
        _given("nccl_ub"),
    ),
)
"""Every refused option, in the order its refusal is listed."""


def refused_problems(args: Any) -> list[str]:
    """The refusals that apply to Megatron's parsed `args`, in `REFUSALS`' order (empty:
    none)."""
    problems = []
    for refusal in REFUSALS:
        value = refusal.value(args)
        if value:
            problems.append(refusal.message.format(value=value))
    return problems
