"""The package's import rules (pyproject.toml, `[tool.importlinter]`) hold.

Layers, top to bottom: cli; bench | chaos | selftest; embedded | megatron_lm | planner
(siblings never import each other); hotswap; replication; devices | config; the leaf helpers.
The job schema and the planner import no torch, Megatron or numpy. No package's modules import
each other in a circle. `lint-imports` reads the rules from pyproject.toml and fails naming the
import that breaks one. And no module grows past 600 lines of code (one concept per file):
docstrings, comments and blank lines do not count - documentation is never what makes a module
too big.
"""

from __future__ import annotations

import ast
import io
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_CODE_LINES = 600


@pytest.mark.timeout(120)
def test_import_contracts_are_kept() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which(
        "lint-imports"
    )
    assert lint, "import-linter is part of the test extras: pip install -e '.[test]'"
    out = subprocess.run([lint], cwd=REPO, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def code_lines(source: str) -> int:
    """Lines that hold code: not blank, not only a comment, not part of a docstring (a string
    that stands as a statement: a module's, class's, function's or attribute's)."""
    docs: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip and tok.type != tokenize.ENDMARKER:
            code.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(code)


def test_code_lines_count_code_only() -> None:
    source = '''"""A module.

    Its docstring.
    """

import os  # a comment

# a comment line


def f(
    x: int,
) -> int:
    """A docstring."""
    y = """not a docstring:
an assigned string"""
    return x
'''
    assert code_lines(source) == 7  # import, def (3 lines), y = (2 lines), return


def test_no_module_is_over_600_lines_of_code() -> None:
    sizes = {
        str(path.relative_to(REPO)): code_lines(path.read_text())
        for path in (REPO / "megatron_deadpool").rglob("*.py")
    }
    over = {path: n for path, n in sizes.items() if n > MAX_CODE_LINES}
    assert not over, f"split these modules (one concept per file): {over}"


MAX_FOLDER_MODULES = 20


def test_no_folder_holds_more_than_20_modules() -> None:
    """A newcomer finds their way in a folder they can read at a glance: past ~20 modules a
    package is split by role (as `hotswap/` is into protocol, coordinator, worker, report and
    launch)."""
    sizes = {
        str(folder.relative_to(REPO)): sum(
            1 for p in folder.glob("*.py") if p.name != "__init__.py"
        )
        for folder in (REPO / "megatron_deadpool").rglob("*")
        if folder.is_dir() and (folder / "__init__.py").exists()
    }
    over = {folder: n for folder, n in sizes.items() if n > MAX_FOLDER_MODULES}
    assert not over, f"split these packages by role: {over}"
