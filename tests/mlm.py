"""Shared by the Megatron-LM tests (tests/megatron_lm/): the Megatron-LM tree to run, and a
fresh interpreter for code that must not touch the test process.

The end-to-end tests run Megatron-LM's own `pretrain_gpt.py` and skip unless MEGATRON_LM_PATH
points at a tree (README, "Use with Megatron-LM" > Prerequisites).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
APPLY = REPO / "scripts" / "apply_patches.sh"


def run_python(code: str, timeout: float = 90.0) -> subprocess.CompletedProcess:
    """Run `code` (dedented) in a fresh interpreter; stdout and stderr captured as text."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def megatron_lm_tree() -> Path:
    """The Megatron-LM tree in MEGATRON_LM_PATH, ready to run; skips the test otherwise."""
    path = os.environ.get("MEGATRON_LM_PATH")
    if not path:
        pytest.skip(
            "MEGATRON_LM_PATH is not set: export MEGATRON_LM_PATH=<Megatron-LM tree at tag "
            "core_v0.16.1> to run pretrain_gpt.py on CPU (README: Use with Megatron-LM, Prerequisites)"
        )
    tree = Path(path).expanduser()
    if not (tree / "pretrain_gpt.py").is_file():
        pytest.skip(f"MEGATRON_LM_PATH={path} has no pretrain_gpt.py")
    missing = [m for m in ("six", "regex", "einops", "pydantic", "tqdm")
               if importlib.util.find_spec(m) is None]  # fmt: skip
    if missing:
        pytest.skip(f"pretrain_gpt.py needs these packages: pip install {' '.join(missing)}")
    helpers = (
        tree / "megatron/core/datasets" / ("helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    )
    if not helpers.exists():
        pytest.skip(f"build Megatron's dataset helpers first: (cd {helpers.parent} && make "
                    f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')})")  # fmt: skip
    return tree
