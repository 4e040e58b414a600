"""The package's import rules (pyproject.toml, `[tool.importlinter]`) hold.

Layers, top to bottom: cli; bench | chaos | selftest; embedded | megatron_lm | planner
(siblings never import each other); hotswap; replication; devices | config; the leaf helpers.
The job schema and the planner import no torch, Megatron or numpy. No package's modules import
each other in a circle. `lint-imports` reads the rules from pyproject.toml and fails naming the
import that breaks one. And no module grows past 600 lines (one concept per file).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 600


@pytest.mark.timeout(120)
def test_import_contracts_are_kept() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which(
        "lint-imports"
    )
    assert lint, "import-linter is part of the test extras: pip install -e '.[test]'"
    out = subprocess.run([lint], cwd=REPO, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_no_module_is_over_600_lines() -> None:
    sizes = {
        str(path.relative_to(REPO)): len(path.read_text().splitlines())
        for path in (REPO / "megatron_deadpool").rglob("*.py")
    }
    over = {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not over, f"split these modules (one concept per file): {over}"
