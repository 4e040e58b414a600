"""What a command needs installed before it starts: Megatron-Core for the embedded job's commands.

megatron-core is an extra (`pip install 'megatron-deadpool[megatron-core]'`), so that a
container's own megatron-core, or a Megatron-LM tree, stays in place. The commands that train
the embedded job import it in every worker; without it each worker would fail at start-up and
the job would end as if ranks had died. Checked up front instead: one line, exit code 2.
"""

from __future__ import annotations

import importlib.util

EMBEDDED_JOB_COMMANDS = ("train", "chaos", "selftest")
"""The commands whose processes run the embedded job (Megatron-Core's GPT): `deadpool megatron-lm`
takes `megatron.core` from the Megatron-LM tree it runs, and is not checked here."""


def megatron_core_found() -> bool:
    """Whether `megatron.core` can be imported here (found, not imported: cheap)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:  # `megatron` itself is missing or fails to import
        return False


def missing_requirement(command: str | None) -> str | None:
    """Why `command` cannot run in this environment (one line naming the fix), or None."""
    if command in EMBEDDED_JOB_COMMANDS and not megatron_core_found():
        return (
            f"deadpool {command} runs Megatron-Core's GPT, and megatron-core is not installed "
            "here: pip install 'megatron-deadpool[megatron-core]' (or put a Megatron-LM tree "
            "on PYTHONPATH)"
        )
    return None
