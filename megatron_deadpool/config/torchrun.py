"""A start under torchrun (torchelastic) is refused: torchrun restarts every worker on a failure.

torchrun's elastic agent answers any worker's exit by stopping all of the node's workers and
starting them again (or ending the job once its restarts are spent), which is exactly what
DeadPool avoids: the survivors must keep running while a spare or a respawned process takes
the failed one's slot. torchrun leaves its mark in every worker's environment
(TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, GROUP_RANK); a DeadPool launcher or worker
that finds it refuses to start, in one line that says what to run instead.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import ConfigError

TORCHRUN_MARKS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "GROUP_RANK")
"""Variables torchrun's elastic agent sets in each worker's environment."""

INSTEAD = {
    "train": "run `deadpool train ...` itself (it starts one process per rank and spare)",
    "megatron-lm": (
        "run `deadpool megatron-lm --nproc-per-node N pretrain_gpt.py ...` on one machine, or "
        "scripts/slurm/deadpool_launch.sh on a Slurm cluster, instead of torchrun"
    ),
}
"""What to run instead, by the command that was started under torchrun."""


def torchrun_mark(env: Mapping[str, str]) -> str | None:
    """The first of torchrun's variables set in `env`, or None."""
    return next((name for name in TORCHRUN_MARKS if env.get(name)), None)


def refuse_torchrun(env: Mapping[str, str], command: str) -> None:
    """`ConfigError` when `env` is a torchrun worker's: `command` ("train" or "megatron-lm")
    names what to run instead."""
    mark = torchrun_mark(env)
    if mark is None:
        return
    raise ConfigError(
        f"started under torchrun ({mark} is set), which restarts every worker when one fails; "
        f"DeadPool replaces only the failed one: {INSTEAD[command]}"
    )
