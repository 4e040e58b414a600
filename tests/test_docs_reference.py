"""The docs site's reference pages (docs/reference/*.md) are what scripts/gen_reference.py writes
from the code today: a `deadpool` command, a flag, a `--deadpool-*` field, an exit code, a
launcher variable, a refused Megatron-LM option or a store key added or changed without
regenerating the pages fails here (run
`PYTHONPATH=$PWD .venv/bin/python scripts/gen_reference.py`)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def generator() -> ModuleType:
    """scripts/gen_reference.py, imported from its file."""
    spec = importlib.util.spec_from_file_location(
        "gen_reference", REPO / "scripts/gen_reference.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_committed_reference_pages_are_the_generated_ones() -> None:
    pages = generator().render()
    stale = [
        name
        for name, text in pages.items()
        if not (REPO / "docs/reference" / name).exists()
        or (REPO / "docs/reference" / name).read_text() != text
    ]
    assert not stale, f"{stale}: run PYTHONPATH=$PWD .venv/bin/python scripts/gen_reference.py"


@pytest.mark.timeout(300)
def test_reference_names_every_flag_command_and_exit_code() -> None:
    """The pages cover the code, not just match an old rendering of it."""
    from megatron_deadpool.cli.main import COMMANDS
    from megatron_deadpool.config.deadpool import DeadpoolConfig
    from megatron_deadpool.config.flags import field_docs, primary_flag
    from megatron_deadpool.errors import ExitCode

    pages = generator().render()
    for name in field_docs(DeadpoolConfig):
        assert f"## `{primary_flag(DeadpoolConfig, 'deadpool', name)}`" in pages["flags.md"], name
    for command in COMMANDS:
        assert f"\n## deadpool {command}\n" in pages["cli.md"], command
    for code in ExitCode:
        assert f"| {int(code)} | `{code.name}` |" in pages["exit-codes.md"], code
    from megatron_deadpool.megatron_lm.refused import REFUSALS

    for refusal in REFUSALS:
        assert f"| `{refusal.name}` |" in pages["refused-megatron-options.md"], refusal.name
    from megatron_deadpool.hotswap.protocol.messages import Keys

    templates = [t for n, t in vars(Keys).items() if n.isupper() and isinstance(t, str)]
    for template in templates:
        assert f"| `{template}` |" in pages["store-keys.md"], template
    from megatron_deadpool.hotswap.coordinator.events import EVENTS
    from megatron_deadpool.hotswap.report.metrics_file import METRICS
    from megatron_deadpool.megatron_lm.report import SCALARS

    for kind in EVENTS:
        assert f"| `{kind}` |" in pages["events.md"], kind
    for metric in METRICS:
        assert f"| `{metric}` |" in pages["metrics.md"], metric
    for scalar in SCALARS:
        assert f"| `deadpool/{scalar}` |" in pages["metrics.md"], scalar
    launch = (REPO / "scripts/slurm/deadpool_launch.sh").read_text()
    for variable in ("SPARE_NODES", "DEADPOOL_MODE", "DEADPOOL_RESPAWN_LIMIT", "DEADPOOL_INJECT"):
        assert re.search(rf"^#   {variable}\b", launch, re.MULTILINE)
        assert f"| `{variable}` |" in pages["launch-variables.md"], variable


def test_readme_is_short_and_ci_runs_its_test_command() -> None:
    """The README stays a front page (at most ~250 lines; the rest is the docs site), and
    `.ci/run` runs each step of the README's test command, unchanged."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    (command,) = [
        line
        for line in readme.splitlines()
        if line.startswith("python3 -m venv") and "pytest" in line
    ]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for step in command.split(" && "):
        assert any(line.startswith(step) for line in ci), step
    for page in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (REPO / page).is_file(), page
