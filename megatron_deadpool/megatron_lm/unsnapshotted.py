"""Megatron-LM options whose per-step state the snapshot does not hold, refused with `--deadpool`.

A snapshot holds what a training step changes: the distributed-optimizer shard, every buffer
of the model chunks (the MoE router's ``expert_bias`` and token counters among them), RNG
states, the LR scheduler, the loss scalers of ``--fp16`` and ``--loss-scale`` and the data
position (`replication/snapshot.py`, `replay.py`). Some options keep state a step changes
elsewhere, where a rollback or a newcomer would not find it (read in Megatron-LM core_v0.16.1
and core_v0.19.0):

- ``--fp8-format`` and ``--fp4-format``: Transformer Engine keeps its scaling state (amax
  history and scales of delayed scaling) in each module's ``fp8_meta``, which is neither a
  buffer nor optimizer state (it is saved only as a module's ``_extra_state``).

Each is refused before training starts, one line each, naming the option and what to do.
"""

from __future__ import annotations

from typing import Any

REFUSALS: dict[str, str] = {
    "fp8": (
        "--fp8-format: Transformer Engine's FP8 scaling state (amax history, scales) lives "
        "outside the optimizer and the model's buffers and is not replicated; train without "
        "FP8 (--bf16) to use --deadpool"
    ),
    "fp4": (
        "--fp4-format: Transformer Engine's FP4 scaling state lives outside the optimizer and "
        "the model's buffers and is not replicated; train without FP4 (--bf16) to use "
        "--deadpool"
    ),
}
"""Megatron's argument name -> the refusal (one line: the option, why, what to do)."""


def unsnapshotted_problems(args: Any) -> list[str]:
    """The refusals that apply to Megatron's parsed `args` (empty: none)."""
    return [message for name, message in REFUSALS.items() if getattr(args, name, None)]
