"""Shared by the Megatron-LM tests (tests/megatron_lm/): the Megatron-LM trees to run, and a
fresh interpreter for code that must not touch the test process.

The end-to-end tests run each supported tag's own `pretrain_gpt.py`. MEGATRON_LM_PATH lists
the Megatron-LM trees to run them against, separated by the path separator (`:`), in any
order; each tree's tag is read from its `megatron/core/package_info.py`. A test of a tag with
no tree in the list skips, naming what to set (README, "Use with Megatron-LM" > "Tested
combinations"). `.ci/run` sets it to prepared copies of `../shared/megatron-lm/<tag>`.
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

from megatron_deadpool.megatron_lm.versions import RELEASES, read_version, release_of

REPO = Path(__file__).resolve().parents[1]
APPLY = REPO / "scripts" / "apply_patches.sh"
TAGS = tuple(r.tag for r in RELEASES)
OLDEST, NEWEST = TAGS[0], TAGS[-1]


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


def _trees() -> dict[str, Path]:
    """tag -> tree, for every supported Megatron-LM tree in MEGATRON_LM_PATH."""
    found: dict[str, Path] = {}
    for entry in filter(None, os.environ.get("MEGATRON_LM_PATH", "").split(os.pathsep)):
        tree = Path(entry).expanduser()
        info = tree / "megatron" / "core" / "package_info.py"
        if info.is_file():
            found.setdefault(release_of(read_version(info)).tag, tree)
    return found


def megatron_lm_tree(tag: str = OLDEST) -> Path:
    """The Megatron-LM tree of `tag` from MEGATRON_LM_PATH, ready to run; skips otherwise."""
    tree = _trees().get(tag)
    if tree is None:
        pytest.skip(
            f"no Megatron-LM tree at tag {tag} in MEGATRON_LM_PATH="
            f"{os.environ.get('MEGATRON_LM_PATH', '')!r}: list one tree per tag, separated by "
            f"{os.pathsep!r}, e.g. from scripts/prepare_megatron_lm.sh (README: Use with "
            "Megatron-LM, Tested combinations)"
        )
    if not (tree / "pretrain_gpt.py").is_file():
        pytest.skip(f"{tree} (MEGATRON_LM_PATH) has no pretrain_gpt.py")
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
