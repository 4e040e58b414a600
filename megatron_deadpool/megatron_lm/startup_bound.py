"""Megatron-LM options bound to the communicators of the job's start-up, refused with `--deadpool`.

A hot swap aborts every NCCL communicator and builds the next generation's from scratch
(`devices.abort`, `hotswap.worker.rebind`). DeadPool rebinds every process-group handle Megatron's
objects hold, but three options keep state that lives inside the start-up communicators
themselves, where no handle can be swapped (read in Megatron-LM core_v0.16.1 and core_v0.19.0,
`megatron/training/arguments.py`, `initialize.py`):

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

from typing import Any

REFUSALS: dict[str, str] = {
    "tp_comm_overlap": (
        "--tp-comm-overlap: Transformer Engine's userbuffers are set up once over the start-up "
        "tensor-parallel group (CUDA IPC handles) and are not rebuilt when a spare replaces a "
        "rank; drop --tp-comm-overlap to train with --deadpool"
    ),
    "cuda_graph_impl": (
        "--cuda-graph-impl={value}: captured CUDA graphs replay kernels of the communicators "
        "they were captured with, which a recovery aborts; use --cuda-graph-impl none with "
        "--deadpool"
    ),
    "nccl_ub": (
        "--use-nccl-ub: buffers registered with NCCL stay registered with the start-up "
        "communicators only, which a recovery aborts; drop --use-nccl-ub to train with "
        "--deadpool"
    ),
}
"""Megatron's argument name -> the refusal (one line: the option, why, what to do)."""


def startup_bound_problems(args: Any) -> list[str]:
    """The refusals that apply to Megatron's parsed `args` (empty: none)."""
    problems = []
    if getattr(args, "tp_comm_overlap", False):
        problems.append(REFUSALS["tp_comm_overlap"])
    graphs = getattr(args, "cuda_graph_impl", None)
    if getattr(args, "enable_cuda_graph", False):
        graphs = "local"
    elif getattr(args, "external_cuda_graph", False):
        graphs = "transformer_engine"
    if graphs not in (None, "none"):
        problems.append(REFUSALS["cuda_graph_impl"].format(value=graphs))
    if getattr(args, "nccl_ub", False):
        problems.append(REFUSALS["nccl_ub"])
    return problems
