#!/usr/bin/env bash
# The static checks CI runs before the tests (README, "Run the test suite"): formatting (black,
# isort), lint (ruff) and types (mypy, settings in pyproject.toml). Each prints what it finds
# and the script stops at the first that fails. PYTHON picks the interpreter (default: the
# checkout's .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(dirname "${PYTHON:-.venv/bin/python}")
echo "checks: ruff, black, isort, mypy" >&2
"$bin/ruff" check megatron_deadpool tests scripts
"$bin/black" --check megatron_deadpool tests scripts
"$bin/isort" --check-only --quiet megatron_deadpool tests scripts
"$bin/mypy"
