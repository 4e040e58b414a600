"""The package's import rules (pyproject.toml, `[tool.importlinter]`) hold.

Layers, top to bottom: cli; bench | chaos | selftest; embedded | megatron_lm | planner
(siblings never import each other); hotswap; replication; devices | config; the leaf helpers.
The job schema and the planner import no torch, Megatron or numpy. `lint-imports` reads the
rules from pyproject.toml and fails naming the import that breaks one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_import_contracts_are_kept() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which(
        "lint-imports"
    )
    assert lint, "import-linter is part of the test extras: pip install -e '.[test]'"
    out = subprocess.run([lint], cwd=REPO, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout
