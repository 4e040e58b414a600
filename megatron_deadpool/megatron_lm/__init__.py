"""DeadPool inside Megatron-LM: `--deadpool` flags, hooks into its training loop, the runner.

What scripts and users call lives here; `runner.py` says how the three ways in work (the
`deadpool megatron-lm` launcher, `python -m megatron_deadpool.megatron_lm SCRIPT ARGS`, and a
patched `pretrain_gpt.py` that calls `prepare()`, `wrap_pretrain(pretrain)` and
`extra_args_provider(...)`). Nothing here imports Megatron until a run starts.
"""

from .runner import (
    add_deadpool_flags,
    extra_args_provider,
    install,
    main,
    prepare,
    preparse,
    run_script,
    wrap_pretrain,
)

__all__ = [
    "add_deadpool_flags",
    "extra_args_provider",
    "install",
    "main",
    "prepare",
    "preparse",
    "run_script",
    "wrap_pretrain",
]
