#!/usr/bin/env bash
# The static checks CI runs before the tests (README, "Run the test suite"): formatting (black,
# isort), lint (ruff), types (mypy, settings in pyproject.toml) and the docs site (mkdocs build
# --strict: a broken link or a page missing from mkdocs.yml's nav fails; skipped, saying so,
# where the [docs] extra is not installed). Each prints what it finds and the script stops at
# the first that fails. PYTHON picks the interpreter (default: the checkout's .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(dirname "${PYTHON:-.venv/bin/python}")
echo "checks: ruff, black, isort, mypy, mkdocs" >&2
"$bin/ruff" check megatron_deadpool tests scripts
"$bin/black" --check megatron_deadpool tests scripts
"$bin/isort" --check-only --quiet megatron_deadpool tests scripts
"$bin/mypy"
if [[ -x "$bin/mkdocs" ]]; then
    site=$(mktemp -d)
    # Not --quiet: with it, mkdocs 1.6 no longer fails on warnings in strict mode.
    NO_MKDOCS_2_WARNING=1 "$bin/mkdocs" build --strict --site-dir "$site"
    rm -rf "$site"
else
    echo "checks: mkdocs not installed (pip install -e '.[docs]'): docs site not built" >&2
fi
